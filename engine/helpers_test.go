package engine

import (
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// testPeer is an engine serving on a loopback port, closed at the end of the test.
type testPeer struct {
	*Engine
	addr    string
	accepts *atomic.Int64 // connections the listener accepted
}

func startPeer(t testing.TB, cfg Config, segs ...Segment) testPeer {
	t.Helper()
	e := New(cfg)
	for _, s := range segs {
		if err := e.Register(s); err != nil {
			t.Fatal(err)
		}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cl := &countingListener{Listener: ln}
	served := make(chan error, 1)
	go func() { served <- e.Serve(cl) }()
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if err := <-served; err != nil && !errors.Is(err, ErrClosed) {
			t.Errorf("Serve: %v", err)
		}
	})
	return testPeer{Engine: e, addr: ln.Addr().String(), accepts: &cl.n}
}

// newClient returns an engine that only dials, closed at the end of the test.
func newClient(t testing.TB, cfg Config) *Engine {
	e := New(cfg)
	t.Cleanup(func() { e.Close() })
	return e
}

type countingListener struct {
	net.Listener
	n atomic.Int64
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.n.Add(1)
	}
	return c, err
}

// blackhole accepts connections, swallows whatever is sent and never answers: a stuck peer.
type blackhole struct {
	ln       net.Listener
	received atomic.Int64
	wg       sync.WaitGroup
	mu       sync.Mutex
	conns    []net.Conn
}

func newBlackhole(t testing.TB) *blackhole {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &blackhole{ln: ln}
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			b.mu.Lock()
			b.conns = append(b.conns, c)
			b.mu.Unlock()
			b.wg.Add(1)
			go func() {
				defer b.wg.Done()
				buf := make([]byte, 64<<10)
				for {
					n, err := c.Read(buf)
					b.received.Add(int64(n))
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	t.Cleanup(b.Close)
	return b
}

func (b *blackhole) addr() string { return b.ln.Addr().String() }

// dropConns closes every accepted connection: the peer dies mid-transfer.
func (b *blackhole) dropConns() {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, c := range b.conns {
		c.Close()
	}
}

func (b *blackhole) Close() {
	b.ln.Close()
	b.dropConns()
	b.wg.Wait()
}

// waitFor polls cond until it holds or the test's patience runs out.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// waitTask waits for t to be terminal, bounded so a hang fails the test instead of stalling it.
func waitTask(tb testing.TB, t *Task) {
	tb.Helper()
	select {
	case <-t.Done():
	case <-time.After(10 * time.Second):
		tb.Fatalf("task still %v after 10s", t.State())
	}
}

// run submits a one-task batch and waits for it.
func run(tb testing.TB, e *Engine, add func(b *Batch) *Task) (*Task, error) {
	tb.Helper()
	b := e.NewBatch()
	task := add(b)
	if err := b.Submit(context.Background()); err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := b.Wait(ctx)
	if errors.Is(err, context.DeadlineExceeded) && !task.State().Terminal() {
		tb.Fatalf("task still %v after 10s", task.State())
	}
	return task, err
}

func randomBytes(r *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// opaque hides Mapped, so the server takes the ReadAt/WriteAt path.
type opaque struct{ Segment }

// failingWrites is a segment whose writes fail, like a disk with I/O errors.
type failingWrites struct{ Segment }

func (failingWrites) WriteAt([]byte, int64) (int, error) { return 0, io.ErrShortWrite }

// gated blocks in ReadAt until released, and says when a read has entered it.
type gated struct {
	Segment
	entered chan struct{}
	release chan struct{}
}

func (g *gated) ReadAt(p []byte, off int64) (int, error) {
	select {
	case g.entered <- struct{}{}:
	default:
	}
	<-g.release
	return g.Segment.ReadAt(p, off)
}
