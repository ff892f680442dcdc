package agent_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/client/agent"
	"github.com/tidepool-kv/tidepool/master/mastertest"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// gate is a TCP proxy to a master that can hold what its clients send:
// while closed, bytes toward the master are kept (and recorded) instead of
// forwarded, so a request of the agent's to the master hangs where the test
// wants it to.
type gate struct {
	ln     net.Listener
	target string

	mu     sync.Mutex
	cond   *sync.Cond
	closed bool
	held   []byte // what arrived while closed
	conns  []net.Conn
}

func newGate(t *testing.T, target string) *gate {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := &gate{ln: ln, target: target}
	g.cond = sync.NewCond(&g.mu)
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			g.mu.Lock()
			g.conns = append(g.conns, c, up)
			g.mu.Unlock()
			wg.Go(func() { io.Copy(c, up); c.Close() })
			wg.Go(func() { g.forward(up, c); up.Close() })
		}
	})
	t.Cleanup(func() {
		ln.Close()
		g.open()
		g.mu.Lock()
		for _, c := range g.conns {
			c.Close()
		}
		g.mu.Unlock()
		wg.Wait()
	})
	return g
}

func (g *gate) addr() string { return g.ln.Addr().String() }

// forward copies src to dst, holding what arrives while the gate is
// closed: it keeps reading (and recording) meanwhile, so a request behind
// a held HTTP/2 control frame still reaches the record.
func (g *gate) forward(dst, src net.Conn) {
	var pending []byte
	eof := false
	go func() {
		buf := make([]byte, 64<<10)
		for {
			n, err := src.Read(buf)
			g.mu.Lock()
			pending = append(pending, buf[:n]...)
			if g.closed {
				g.held = append(g.held, buf[:n]...)
			}
			eof = err != nil
			g.cond.Broadcast()
			g.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	for {
		g.mu.Lock()
		for !eof && (g.closed || len(pending) == 0) {
			g.cond.Wait()
		}
		out, done := pending, eof
		pending = nil
		g.mu.Unlock()
		if _, err := dst.Write(out); err != nil || done {
			return
		}
	}
}

func (g *gate) close() {
	g.mu.Lock()
	g.closed, g.held = true, nil
	g.mu.Unlock()
}

func (g *gate) open() {
	g.mu.Lock()
	g.closed = false
	g.cond.Broadcast()
	g.mu.Unlock()
}

// waitHeld returns once bytes holding marker arrived while closed.
func (g *gate) waitHeld(t *testing.T, marker []byte) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	g.mu.Lock()
	defer g.mu.Unlock()
	for !bytes.Contains(g.held, marker) {
		if time.Now().After(deadline) {
			t.Fatalf("no request holding %q reached the gate (%d bytes held: %q)", marker, len(g.held), g.held)
		}
		g.mu.Unlock()
		time.Sleep(5 * time.Millisecond)
		g.mu.Lock()
	}
}

// fixtureVia is newFixture's agent, reaching the in-process cluster at
// masters (a gate in front of it, say).
func fixtureVia(t *testing.T, masters string) *fixture {
	t.Helper()
	return fixtureAt(t, masters, agent.Config{})
}

// TestReviewAttachRetryAfterDeadline: an Attach whose caller stopped waiting
// (its deadline passed while the session's lock was held by a slow get)
// still maps the region in the agent, under an id nobody learned. The
// caller's retry, the only way it has to learn an id for its memory, must
// then succeed; the agent refuses it as "already a region of the session",
// so that memory is unusable for the rest of the session (the Python client
// retries exactly so, and fails every later get and put from it).
func TestReviewAttachRetryAfterDeadline(t *testing.T) {
	m := mastertest.Start(t, nil)
	mastertest.StartStore(t, []string{m.Addr()}, "s0", 64<<20, nil)
	g := newGate(t, m.Addr())
	f := fixtureVia(t, g.addr())
	ctx := testCtx(t)
	r := f.open("review-attach", 1<<20)
	const key, size = "review/attach/slow-get", 4096
	copy(r.mem, value(1, size))
	put(t, f, &pb.AgentPutRequest{Session: r.id, Keys: []string{key}, Spans: []*pb.Span{{Length: size}}})

	// A get of the session that hangs on the master: it read-holds the
	// session's lock, which Attach needs to write-hold.
	g.close()
	got := make(chan error, 1)
	go func() {
		_, err := f.ac.BatchGet(ctx, &pb.AgentGetRequest{Session: r.id, Keys: []string{key}, Spans: []*pb.Span{{Offset: size, Length: size}}})
		got <- err
	}()
	g.waitHeld(t, []byte(key))

	mem := sealable(t, 1<<20)
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err := f.ac.Attach(short, &pb.AttachRequest{Session: r.id, Path: mem.path, Size: mem.size})
	cancel()
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("Attach under a held session lock = %v, want DeadlineExceeded", err)
	}
	g.open()
	if err := <-got; err != nil {
		t.Fatalf("the slow get: %v", err)
	}
	// The abandoned Attach goes on once the get is done, and maps it.
	waitFor(t, 10*time.Second, "the abandoned Attach to map the memfd", func() bool {
		maps, _ := mem.held(t)
		return maps == 2
	})

	resp, err := f.ac.Attach(ctx, &pb.AttachRequest{Session: r.id, Path: mem.path, Size: mem.size})
	if err != nil {
		t.Fatalf("Attach again after the deadline: %v (the memory is now unusable in this session)", err)
	}
	copy(mem.mem, value(2, size))
	put(t, f, &pb.AgentPutRequest{Session: r.id, Keys: []string{"review/attach/after"}, Spans: []*pb.Span{{Length: size, Region: resp.Region}}})
}

// TestReviewClearRemovesEverythingPaged: objects removed by someone else
// while Clear walks its pages do not stop it, and nothing is left behind
// (a check of the paging; it passes).
func TestReviewClearRemovesEverythingPaged(t *testing.T) {
	f := newFixture(t, agent.Config{})
	ctx := testCtx(t)
	r := f.open("review-clear", 1<<20)
	const n = 2500 // three pages of 1000
	keys := make([]string, n)
	spans := make([]*pb.Span, n)
	for i := range n {
		keys[i] = fmt.Sprintf("review/clear/%c/%04d", 'a'+i%26, i)
		spans[i] = &pb.Span{Offset: uint64(i % 1000 * 64), Length: 64}
	}
	for lo := 0; lo < n; lo += 500 {
		put(t, f, &pb.AgentPutRequest{Session: r.id, Keys: keys[lo : lo+500], Spans: spans[lo : lo+500]})
	}
	// Remove some concurrently with the Clear.
	var wg sync.WaitGroup
	wg.Go(func() { f.ac.Remove(ctx, &pb.KeysRequest{Keys: keys[1000:1500]}) })
	resp, err := f.ac.Clear(ctx, &pb.ClearRequest{Prefix: "review/clear/"})
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if left := keysOf(t, f, "review/clear/"); len(left) != 0 {
		t.Fatalf("%d objects left after Clear (removed %d): %v", len(left), resp.Removed, left[:min(5, len(left))])
	}
	if resp.Removed > n {
		t.Fatalf("Clear removed %d of %d", resp.Removed, n)
	}
}
