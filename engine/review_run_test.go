package engine

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

// runAsync runs b in another goroutine and returns its result's channel.
func runAsync(ctx context.Context, b *Batch) <-chan error {
	ch := make(chan error, 1)
	go func() { ch <- b.Run(ctx) }()
	return ch
}

// runResult waits, bounded, for Run's result.
func runResult(t *testing.T, ch <-chan error, what string) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: Run still running after 10s", what)
		return nil
	}
}

// TestReviewRunCanceledMidTransfer: canceling Run's ctx while a task is on
// the wire to a peer that never answers ends Run, with the task Canceled,
// as Submit's ctx does.
func TestReviewRunCanceledMidTransfer(t *testing.T) {
	bh := newBlackhole(t)
	c := newClient(t, Config{NoShm: true})
	b := c.NewBatch()
	tk := b.Write(make([]byte, 256<<10), Target{Endpoint: bh.addr(), Segment: "dram"}, 0, Options{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch := runAsync(ctx, b)
	waitFor(t, "bytes at the peer", func() bool { return bh.received.Load() > 0 })
	cancel()
	err := runResult(t, ch, "after cancel")
	if !errors.Is(err, context.Canceled) || tk.State() != Canceled {
		t.Fatalf("Run = %v, task %v; want Canceled", err, tk.State())
	}
}

// TestReviewRunCloseWhileRunning: Close while a Run waits on a stuck peer
// fails its task ErrClosed and returns; Run returns too (Close waits for
// the dispatch Run counted, in Run's own goroutine).
func TestReviewRunCloseWhileRunning(t *testing.T) {
	bh := newBlackhole(t)
	c := newClient(t, Config{NoShm: true})
	b := c.NewBatch()
	tk := b.Write(make([]byte, 256<<10), Target{Endpoint: bh.addr(), Segment: "dram"}, 0, Options{})
	ch := runAsync(context.Background(), b)
	waitFor(t, "bytes at the peer", func() bool { return bh.received.Load() > 0 })
	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	err := runResult(t, ch, "after Close")
	if !errors.Is(err, ErrClosed) || tk.State() != Failed {
		t.Fatalf("Run = %v, task %v; want Failed with ErrClosed", err, tk.State())
	}
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return")
	}
}

// TestReviewRunOnceWithSubmit: a batch is started once, whether by Run or
// Submit: the other then fails ErrInvalid without touching the tasks, and
// Wait after Run answers at once.
func TestReviewRunOnceWithSubmit(t *testing.T) {
	mem := NewMemSegment("dram", make([]byte, 1<<20))
	p := startPeer(t, Config{}, mem)
	c := newClient(t, Config{NoShm: true})
	tgt := Target{Endpoint: p.addr, Segment: "dram"}
	src := randomBytes(rand.New(rand.NewPCG(5, 6)), 8192)
	ctx := context.Background()

	b := c.NewBatch()
	tk := b.Write(src, tgt, 0, Options{})
	if err := b.Submit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := b.Run(ctx); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Run after Submit = %v", err)
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := b.Wait(wctx); err != nil || tk.State() != Done {
		t.Fatalf("Wait after a refused Run = %v, task %v", err, tk.State())
	}

	b = c.NewBatch()
	tk = b.Write(src, tgt, 8192, Options{})
	if err := b.Run(ctx); err != nil || tk.State() != Done {
		t.Fatalf("Run = %v, task %v", err, tk.State())
	}
	if err := b.Submit(ctx); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Submit after Run = %v", err)
	}
	if err := b.Wait(wctx); err != nil {
		t.Fatalf("Wait after Run = %v", err)
	}
	late := b.Write(src, tgt, 0, Options{})
	if late.State() != Failed || !errors.Is(late.Err(), ErrInvalid) {
		t.Fatalf("a task added after Run is %v (%v)", late.State(), late.Err())
	}
}

// TestReviewRunTCPConcurrent: Runs from several goroutines, each with
// tasks over TCP (some merged into one request, others not), with fewer
// in-flight slots than tasks: every task is Done when its Run returns and
// its bytes are in the segment, and reading them back with Run agrees.
// goleak (TestMain) checks that no goroutine is left.
func TestReviewRunTCPConcurrent(t *testing.T) {
	const runners, per, size = 6, 24, 4096
	mem := NewMemSegment("dram", make([]byte, runners*per*size))
	p := startPeer(t, Config{}, mem)
	c := newClient(t, Config{NoShm: true, MaxInflight: 3})
	tgt := Target{Endpoint: p.addr, Segment: "dram"}
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, runners)
	for r := range runners {
		wg.Go(func() {
			src := randomBytes(rand.New(rand.NewPCG(uint64(r), 9)), per*size)
			b := c.NewBatch()
			var tasks []*Task
			for i := range per {
				off := int64((r*per + i) * size)
				buf := src[i*size : (i+1)*size]
				if i%3 == 2 {
					buf = bytes.Clone(buf) // breaks the run: its own request
				}
				tasks = append(tasks, b.Write(buf, tgt, off, Options{}))
			}
			if err := b.Run(ctx); err != nil {
				errs <- err
				return
			}
			for _, tk := range tasks {
				if tk.State() != Done {
					errs <- errors.New("a write not Done after Run: " + tk.State().String())
					return
				}
			}
			got := make([]byte, per*size)
			rb := c.NewBatch()
			rb.Read(got, tgt, int64(r*per*size), Options{})
			if err := rb.Run(ctx); err != nil {
				errs <- err
				return
			}
			if !bytes.Equal(got, src) {
				errs <- errors.New("read back differs from what Run wrote")
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestReviewRunEndedCtxAndDeadline: Run with a ctx already canceled, or
// a task whose deadline has passed, ends them without I/O, through shared
// memory as through TCP; the segment is untouched.
func TestReviewRunEndedCtxAndDeadline(t *testing.T) {
	for _, noShm := range []bool{false, true} {
		mem := NewMemSegment("dram", make([]byte, 1<<16))
		p := startPeer(t, Config{}, mem)
		c := newClient(t, Config{NoShm: noShm})
		tgt := Target{Endpoint: p.addr, Segment: "dram"}
		src := bytes.Repeat([]byte{0xAB}, 4096)
		// Warm the shm mapping (when on), so the next ops could copy at once.
		b := c.NewBatch()
		b.Read(make([]byte, 1), tgt, 0, Options{})
		if err := b.Run(context.Background()); err != nil {
			t.Fatal(err)
		}

		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		b = c.NewBatch()
		tk := b.Write(src, tgt, 0, Options{})
		if err := b.Run(ctx); !errors.Is(err, context.Canceled) || tk.State() != Canceled {
			t.Fatalf("noShm %v: Run with an ended ctx = %v, task %v", noShm, err, tk.State())
		}
		b = c.NewBatch()
		tk = b.Write(src, tgt, 8192, Options{Deadline: time.Now().Add(-time.Second)})
		if err := b.Run(context.Background()); !errors.Is(err, ErrTimedOut) || tk.State() != TimedOut {
			t.Fatalf("noShm %v: Run past the deadline = %v, task %v", noShm, err, tk.State())
		}
		if bytes.Contains(mem.Bytes(), []byte{0xAB}) {
			t.Fatalf("noShm %v: a task Run ended without I/O wrote the segment", noShm)
		}
	}
}
