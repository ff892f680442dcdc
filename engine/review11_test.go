package engine

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

// dialRaw opens a plain TCP connection to a peer, as a careless or hostile
// client would, closed at the end of the test.
func dialRaw(t *testing.T, addr string) net.Conn {
	t.Helper()
	nc, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	return nc
}

// closedByPeer reports whether the server has closed nc: a read ends at
// once with EOF or a reset rather than waiting.
func closedByPeer(nc net.Conn) bool {
	_ = nc.SetReadDeadline(time.Now().Add(10 * time.Millisecond))
	_, err := nc.Read(make([]byte, 1))
	var ne net.Error
	return err != nil && !(errors.As(err, &ne) && ne.Timeout())
}

// TestServerClosesIdleConnections: a connection that sends nothing is
// closed after IdleTimeout, and a client whose pooled connection the
// server closed so goes on over a fresh one.
func TestServerClosesIdleConnections(t *testing.T) {
	p := startPeer(t, Config{IdleTimeout: 100 * time.Millisecond}, NewMemSegment("seg", make([]byte, 1<<20)))
	nc := dialRaw(t, p.addr)
	waitFor(t, "the idle connection to close", func() bool { return closedByPeer(nc) })

	c := newClient(t, Config{NoShm: true})
	for i := range 3 {
		if _, err := run(t, c, func(b *Batch) *Task {
			return b.Write([]byte("abc"), Target{Endpoint: p.addr, Segment: "seg"}, 0, Options{})
		}); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
		waitFor(t, "the server to close the pooled connection", func() bool {
			p.mu.Lock()
			defer p.mu.Unlock()
			return len(p.mu.conns) == 0
		})
	}
}

// TestServerDropsStalledWrite: a write header for a staged (not mapped)
// segment, part of its payload and silence pinned a 1 MiB buffer until a
// deadline of 10 s plus the request's length at 1 MiB/s. The server now
// drops it within StallTimeout and its buffer is free again.
func TestServerDropsStalledWrite(t *testing.T) {
	seg := opaque{NewMemSegment("staged", make([]byte, 64<<20))}
	p := startPeer(t, Config{StallTimeout: 200 * time.Millisecond}, seg)
	var conns []net.Conn
	for range maxScratch + 8 { // more than there are buffers
		nc := dialRaw(t, p.addr)
		hdr := appendRequest(nil, opWrite, "staged", 0, 64<<20, "")
		if _, err := nc.Write(append(hdr, make([]byte, 1<<20-1)...)); err != nil {
			t.Fatal(err)
		}
		conns = append(conns, nc)
	}
	start := time.Now()
	for _, nc := range conns {
		waitFor(t, "the stalled write to be dropped", func() bool { return closedByPeer(nc) })
	}
	// A stalled write waits StallTimeout for a buffer and StallTimeout for
	// its payload: the last is dropped within a few of them.
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("stalled writes dropped after %v", took)
	}
	if made := p.scratchMade.Load(); made > maxScratch {
		t.Fatalf("%d staging buffers made, at most %d", made, maxScratch)
	}
	waitFor(t, "every staging buffer back", func() bool { return len(p.scratch) == int(p.scratchMade.Load()) })
	// And the server still serves a well-behaved write.
	c := newClient(t, Config{NoShm: true})
	want := bytes.Repeat([]byte{7}, 3<<20)
	if _, err := run(t, c, func(b *Batch) *Task { return b.Write(want, Target{Endpoint: p.addr, Segment: "staged"}, 0, Options{}) }); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(want))
	if _, err := seg.ReadAt(got, 0); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("after the stalls: %v, bytes equal %v", err, bytes.Equal(got, want))
	}
}

// TestServerConnectionCap: at MaxServerConns a new connection replaces
// the longest idle one, so idle connections cannot lock clients out.
func TestServerConnectionCap(t *testing.T) {
	p := startPeer(t, Config{MaxServerConns: 8}, NewMemSegment("seg", make([]byte, 1<<20)))
	var idle []net.Conn
	for i := range 8 {
		nc := dialRaw(t, p.addr)
		idle = append(idle, nc)
		// One at a time, so that they went idle in the order dialled
		// (under load the server's goroutines may start out of order).
		waitFor(t, "the connection to wait for a request", func() bool { return p.idleConns() == i+1 })
	}
	c := newClient(t, Config{NoShm: true})
	for i := range 4 {
		if _, err := run(t, c, func(b *Batch) *Task {
			return b.Write([]byte("abc"), Target{Endpoint: p.addr, Segment: "seg"}, int64(i), Options{})
		}); err != nil {
			t.Fatalf("write %d at the cap: %v", i, err)
		}
	}
	if closedByPeer(idle[len(idle)-1]) {
		t.Fatal("the newest idle connection was closed before the oldest")
	}
	waitFor(t, "the oldest idle connection to close", func() bool { return closedByPeer(idle[0]) })
}

// idleConns is how many server connections wait for a request.
func (e *Engine) idleConns() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	n := 0
	for _, idle := range e.mu.conns {
		if idle.since.Load() > 0 {
			n++
		}
	}
	return n
}

// TestServerKeepsServingMidRequestAtCap: a connection in the middle of a
// request is never the one the cap closes.
func TestServerKeepsServingMidRequestAtCap(t *testing.T) {
	g := &gated{Segment: NewMemSegment("slow", make([]byte, 1<<20)), entered: make(chan struct{}, 1), release: make(chan struct{})}
	p := startPeer(t, Config{MaxServerConns: 1}, g)
	c := newClient(t, Config{NoShm: true})
	b := c.NewBatch()
	task := b.Read(make([]byte, 4096), Target{Endpoint: p.addr, Segment: "slow"}, 0, Options{})
	if err := b.Submit(context.Background()); err != nil {
		t.Fatal(err)
	}
	<-g.entered
	nc := dialRaw(t, p.addr)
	waitFor(t, "the new connection to be refused", func() bool { return closedByPeer(nc) })
	close(g.release)
	waitTask(t, task)
	if task.State() != Done {
		t.Fatalf("the request in flight: %v %v", task.State(), task.Err())
	}
	_, _ = io.Copy(io.Discard, nc)
}
