package main

import (
	"bytes"
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

func TestAgentFlags(t *testing.T) {
	var stdout, stderr bytes.Buffer
	e := &env{stdin: strings.NewReader(""), stdout: &stdout, stderr: &stderr, getenv: func(string) string { return "" }}
	if code := run(context.Background(), e, []string{"agent", "--help"}); code != 0 {
		t.Fatalf("agent --help exited %d: %s", code, stderr.String())
	}
	for _, flag := range []string{"-socket", "-masters", "-no-shm", "-session-idle", "-max-session-bytes", "-http", "-log-level", "-tier", "-replicas", "-tenant"} {
		if help := stderr.String(); !strings.Contains(help, "  "+flag+" ") && !strings.Contains(help, "  "+flag+"\n") {
			t.Errorf("agent --help does not document %s:\n%s", flag, stderr.String())
		}
	}
	for _, tc := range []struct {
		args []string
		msg  string
	}{
		{[]string{"agent", "--max-session-bytes", "lots", "--http", ""}, "--max-session-bytes"},
		{[]string{"agent", "--max-session-bytes", "0", "--http", ""}, "--max-session-bytes"},
		{[]string{"agent", "--session-idle", "0s", "--http", ""}, "--session-idle"},
		{[]string{"agent", "extra"}, "want 0 arguments"},
	} {
		stderr.Reset()
		if code := run(context.Background(), e, tc.args); code != 2 || !strings.Contains(stderr.String(), tc.msg) {
			t.Errorf("run(%q) = %d, stderr %q; want 2 and %q", tc.args, code, stderr.String(), tc.msg)
		}
	}
}

// shortDir is a temporary directory whose paths fit a unix socket's 107 bytes.
func shortDir(t *testing.T) string {
	dir, err := os.MkdirTemp("", "tpa")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func TestListenUnix(t *testing.T) {
	dir := shortDir(t)
	path := filepath.Join(dir, "a.sock")

	ln, err := listenUnix(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v, %v; want 0600", fi.Mode(), err)
	}
	if _, err := listenUnix(path); err == nil || !strings.Contains(err.Error(), "another process is listening") {
		t.Fatalf("second listen on a live socket: %v", err)
	}

	// A socket file whose listener is gone (a killed agent) is replaced.
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	ln.Close()
	ln, err = listenUnix(path)
	if err != nil {
		t.Fatalf("listen over a stale socket: %v", err)
	}
	ln.Close()

	plain := filepath.Join(dir, "plain")
	if err := os.WriteFile(plain, []byte("keep me"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := listenUnix(plain); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Fatalf("listen over a regular file: %v", err)
	}
	if b, err := os.ReadFile(plain); err != nil || string(b) != "keep me" {
		t.Fatalf("the regular file was touched: %q, %v", b, err)
	}
}

// TestRunAgent starts `tidepool agent`, opens a session through its socket
// (no master needed for that), and stops it with the signal context.
func TestRunAgent(t *testing.T) {
	sock := filepath.Join(shortDir(t), "agent.sock")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stderr bytes.Buffer
	e := &env{stdin: strings.NewReader(""), stdout: &bytes.Buffer{}, stderr: &stderr, getenv: func(string) string { return "" }}
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, e, []string{"agent", "--socket", sock, "--http", "", "--masters", "127.0.0.1:1", "--max-session-bytes", "1MiB", "--log-level", "error"})
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		select {
		case code := <-done:
			t.Fatalf("agent exited %d: %s", code, stderr.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("the agent did not create its socket")
		}
		time.Sleep(10 * time.Millisecond)
	}
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ac := pb.NewAgentClient(conn)
	rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
	defer rcancel()
	open, err := ac.Open(rctx, &pb.OpenRequest{Client: "test", ShmBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ac.Open(rctx, &pb.OpenRequest{ShmBytes: 1<<20 + 1}); err == nil {
		t.Fatal("--max-session-bytes was not applied")
	}
	if _, err := ac.Close(rctx, &pb.SessionRef{Session: open.Session}); err != nil {
		t.Fatal(err)
	}
	cancel()
	select {
	case code := <-done:
		if code != 0 {
			t.Fatalf("agent exited %d: %s", code, stderr.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the agent did not stop")
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("the socket is still there after shutdown: %v", err)
	}
}
