package main

import (
	"io"
	"log/slog"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// TestHTTPConnectionsBounded: a peer cannot make a daemon's HTTP server
// hold a connection that sends nothing (it is closed within the header
// timeout, 5 s), nor lock others out by opening more than maxHTTPConns of
// them: /healthz still answers once the idle ones are closed.
func TestHTTPConnectionsBounded(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	stop, err := serveHTTP(addr, prometheus.NewRegistry(), func() error { return nil }, nil, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	var idle []net.Conn
	t.Cleanup(func() {
		for _, c := range idle {
			c.Close()
		}
	})
	for range maxHTTPConns + 44 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, c)
	}
	start := time.Now()
	// The server closes the first idle connection: its read ends.
	_ = idle[0].SetReadDeadline(time.Now().Add(20 * time.Second))
	if n, err := idle[0].Read(make([]byte, 1)); err == nil || n != 0 {
		t.Fatalf("idle connection read %d bytes, %v; want it closed by the server", n, err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("idle connection closed after %v, want within the 5 s header timeout", took)
	}
	hc := &http.Client{Timeout: 30 * time.Second}
	resp, err := hc.Get("http://" + addr + "/healthz")
	if err != nil {
		t.Fatalf("/healthz with %d idle connections open: %v", len(idle), err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(body) != "ok\n" {
		t.Fatalf("/healthz: %s %q", resp.Status, body)
	}
	t.Logf("idle connection closed and /healthz answered past %d idle connections in %v", len(idle), time.Since(start).Round(time.Millisecond))
}
