package engine

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestReview23BatchWaitCountsEveryTask: a batch larger than a few slabs,
// some tasks contiguous (merged into one request), some invalid (failed
// before any I/O), with Done asked for by other goroutines before, during
// and after the transfers and Wait called from several goroutines, one of
// them before Submit has returned. When any Wait returns nil every task
// is terminal, and every Done channel, however made, is closed.
func TestReview23BatchWaitCountsEveryTask(t *testing.T) {
	const n = 700 // over two slabs of 256
	mem := NewMemSegment("dram", make([]byte, n*64))
	p := startPeer(t, Config{}, mem)
	c := newClient(t, Config{MaxInflight: 4})
	tgt := Target{Endpoint: p.addr, Segment: "dram"}

	for round := range 5 {
		b := c.NewBatch()
		buf := make([]byte, n*64)
		tasks := make([]*Task, n)
		for i := range n {
			switch {
			case i%97 == 5:
				tasks[i] = b.Write(buf[i*64:(i+1)*64], Target{Segment: "dram"}, int64(i*64), Options{}) // no endpoint: invalid
			default:
				tasks[i] = b.Write(buf[i*64:(i+1)*64], tgt, int64(i*64), Options{}) // contiguous: merged
			}
		}
		early := make([]<-chan struct{}, n)
		for i := 0; i < n; i += 3 {
			early[i] = tasks[i].Done()
		}
		var wg sync.WaitGroup
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		waits := make(chan error, 4)
		started := make(chan struct{})
		for range 3 {
			wg.Go(func() {
				<-started
				for {
					err := b.Wait(ctx)
					if err != nil && strings.Contains(err.Error(), "Wait before Submit") {
						continue // raced Submit
					}
					waits <- err
					return
				}
			})
		}
		for i := 1; i < n; i += 3 {
			wg.Go(func() { <-started; <-tasks[i].Done() })
		}
		close(started)
		if err := b.Submit(context.Background()); err != nil {
			t.Fatal(err)
		}
		for range 3 {
			err := <-waits
			if ctx.Err() != nil {
				t.Fatalf("round %d: Wait did not return: %v", round, err)
			}
			for i, tk := range tasks {
				if !tk.State().Terminal() {
					t.Fatalf("round %d: Wait returned %v with task %d %v", round, err, i, tk.State())
				}
			}
		}
		wg.Wait()
		cancel()
		for i, tk := range tasks {
			for _, ch := range []<-chan struct{}{early[i], tk.Done()} {
				if ch == nil {
					continue
				}
				select {
				case <-ch:
				default:
					t.Fatalf("round %d: task %d (%v): Done not closed", round, i, tk.State())
				}
			}
			if want := i%97 != 5; (tk.State() == Done) != want {
				t.Fatalf("round %d: task %d: %v %v", round, i, tk.State(), tk.Err())
			}
		}
	}
}

// TestReview23SubmitOnClosedEngine: a batch submitted to a closed engine
// fails every task, and its Wait returns at once with ErrClosed, the Done
// channels asked for before and after all closed.
func TestReview23SubmitOnClosedEngine(t *testing.T) {
	c := New(Config{})
	c.Close()
	b := c.NewBatch()
	var tasks []*Task
	for i := range 300 {
		tasks = append(tasks, b.Read(make([]byte, 8), Target{Endpoint: "127.0.0.1:1", Segment: "s"}, int64(i*8), Options{}))
	}
	before := tasks[7].Done()
	if err := b.Submit(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Submit on a closed engine = %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := b.Wait(ctx); !errors.Is(err, ErrClosed) {
		t.Fatalf("Wait = %v, want ErrClosed", err)
	}
	for _, ch := range []<-chan struct{}{before, tasks[299].Done()} {
		select {
		case <-ch:
		default:
			t.Fatal("Done not closed")
		}
	}
}
