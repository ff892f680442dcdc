package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

var roundTripSizes = []int{1, 100, 4095, 4096, 4097, 64 << 10, 1 << 20, 1<<20 + 1, 3<<20 + 12345, 8 << 20, 16 << 20}

func TestWriteThenRead(t *testing.T) {
	for _, tc := range []struct {
		name string
		wrap func(*MemSegment) Segment
	}{
		{"mapped", func(m *MemSegment) Segment { return m }},
		{"unmapped", func(m *MemSegment) Segment { return opaque{m} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			total := 0
			for _, n := range roundTripSizes {
				total += n
			}
			mem := NewMemSegment("dram", make([]byte, total))
			p := startPeer(t, Config{}, tc.wrap(mem))
			c := newClient(t, Config{})
			tgt := Target{Endpoint: p.addr, Segment: "dram"}
			r := rand.New(rand.NewPCG(1, 2))

			// One batch writes every size at its own offset, a second reads them all back.
			srcs := make([][]byte, len(roundTripSizes))
			wb := c.NewBatch()
			off := int64(0)
			for i, n := range roundTripSizes {
				srcs[i] = randomBytes(r, n)
				wb.Write(srcs[i], tgt, off, Options{})
				off += int64(n)
			}
			if err := wb.Submit(context.Background()); err != nil {
				t.Fatal(err)
			}
			if err := wb.Wait(context.Background()); err != nil {
				t.Fatal(err)
			}
			rb := c.NewBatch()
			dsts := make([][]byte, len(roundTripSizes))
			tasks := make([]*Task, len(roundTripSizes))
			off = 0
			for i, n := range roundTripSizes {
				dsts[i] = make([]byte, n)
				tasks[i] = rb.Read(dsts[i], tgt, off, Options{Priority: High})
				off += int64(n)
			}
			if err := rb.Submit(context.Background()); err != nil {
				t.Fatal(err)
			}
			if err := rb.Wait(context.Background()); err != nil {
				t.Fatal(err)
			}
			off = 0
			for i, n := range roundTripSizes {
				if s := tasks[i].State(); s != Done || tasks[i].Err() != nil {
					t.Errorf("size %d: state %v, err %v", n, s, tasks[i].Err())
				}
				if !bytes.Equal(dsts[i], srcs[i]) {
					t.Errorf("size %d: read back differs", n)
				}
				if !bytes.Equal(mem.Bytes()[off:off+int64(n)], srcs[i]) {
					t.Errorf("size %d: segment differs", n)
				}
				off += int64(n)
			}
		})
	}
}

func TestConcurrentBatches(t *testing.T) {
	const (
		workers = 8
		rounds  = 5
		size    = 300 << 10
	)
	mem := NewMemSegment("dram", make([]byte, workers*size))
	p := startPeer(t, Config{}, mem)
	c := newClient(t, Config{ConnsPerPeer: 2, MaxInflight: 3}) // fewer conns and slots than work
	tgt := Target{Endpoint: p.addr, Segment: "dram"}

	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 7))
			off := int64(w * size)
			for range rounds {
				// Two tasks per batch, on the two halves of this worker's range.
				src := randomBytes(r, size)
				wb := c.NewBatch()
				wb.Write(src[:size/2], tgt, off, Options{})
				wb.Write(src[size/2:], tgt, off+size/2, Options{Priority: Low})
				if err := wb.Submit(context.Background()); err != nil {
					errs <- err
					return
				}
				if err := wb.Wait(context.Background()); err != nil {
					errs <- err
					return
				}
				dst := make([]byte, size)
				rb := c.NewBatch()
				rb.Read(dst, tgt, off, Options{})
				if err := rb.Submit(context.Background()); err != nil {
					errs <- err
					return
				}
				if err := rb.Wait(context.Background()); err != nil {
					errs <- err
					return
				}
				if !bytes.Equal(dst, src) {
					errs <- fmt.Errorf("worker %d: read back differs", w)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if n := p.accepts.Load(); n > 2 {
		t.Errorf("peer accepted %d connections, pool allows 2", n)
	}
}

func TestSegmentNotFound(t *testing.T) {
	p := startPeer(t, Config{}, NewMemSegment("dram", make([]byte, 1024)))
	c := newClient(t, Config{ConnsPerPeer: 1})
	missing := Target{Endpoint: p.addr, Segment: "gone"}

	task, err := run(t, c, func(b *Batch) *Task { return b.Read(make([]byte, 10), missing, 0, Options{}) })
	if !errors.Is(err, ErrSegmentNotFound) || task.State() != Failed || !errors.Is(task.Err(), ErrSegmentNotFound) {
		t.Fatalf("read: state %v, err %v", task.State(), err)
	}
	// A write's payload is discarded, so the next request on the same connection parses.
	task, err = run(t, c, func(b *Batch) *Task { return b.Write(make([]byte, 100<<10), missing, 0, Options{}) })
	if !errors.Is(err, ErrSegmentNotFound) || task.State() != Failed {
		t.Fatalf("write: state %v, err %v", task.State(), err)
	}

	// Unregister fences: a segment that was served is then not found.
	if _, err := run(t, c, func(b *Batch) *Task {
		return b.Write([]byte("x"), Target{Endpoint: p.addr, Segment: "dram"}, 0, Options{})
	}); err != nil {
		t.Fatal(err)
	}
	p.Unregister("dram")
	if _, err := run(t, c, func(b *Batch) *Task {
		return b.Read(make([]byte, 1), Target{Endpoint: p.addr, Segment: "dram"}, 0, Options{})
	}); !errors.Is(err, ErrSegmentNotFound) {
		t.Fatalf("after Unregister: err %v", err)
	}
	if n := p.accepts.Load(); n != 1 {
		t.Errorf("peer accepted %d connections; error responses must keep the connection", n)
	}
}

func TestOutOfRange(t *testing.T) {
	const size = 1 << 20
	p := startPeer(t, Config{}, NewMemSegment("dram", make([]byte, size)))
	c := newClient(t, Config{ConnsPerPeer: 1})
	tgt := Target{Endpoint: p.addr, Segment: "dram"}

	cases := []struct {
		name string
		add  func(b *Batch) *Task
	}{
		{"read past end", func(b *Batch) *Task { return b.Read(make([]byte, 10), tgt, size-5, Options{}) }},
		{"read after end", func(b *Batch) *Task { return b.Read(make([]byte, 1), tgt, size, Options{}) }},
		{"write past end", func(b *Batch) *Task { return b.Write(make([]byte, 300<<10), tgt, size-1, Options{}) }},
		{"negative offset", func(b *Batch) *Task { return b.Write(make([]byte, 1), tgt, -1, Options{}) }},
		// Split into chunks, some in range: the task still fails as a whole.
		{"large read past end", func(b *Batch) *Task { return b.Read(make([]byte, 2*size), tgt, 0, Options{}) }},
	}
	for _, tc := range cases {
		task, err := run(t, c, tc.add)
		if !errors.Is(err, ErrOutOfRange) || task.State() != Failed {
			t.Errorf("%s: state %v, err %v", tc.name, task.State(), err)
		}
	}
	// The connection survived all of that.
	src := []byte("still here")
	if _, err := run(t, c, func(b *Batch) *Task { return b.Write(src, tgt, size-int64(len(src)), Options{}) }); err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, len(src))
	if _, err := run(t, c, func(b *Batch) *Task { return b.Read(dst, tgt, size-int64(len(src)), Options{}) }); err != nil || !bytes.Equal(dst, src) {
		t.Fatalf("read back %q, %v", dst, err)
	}
	if n := p.accepts.Load(); n != 1 {
		t.Errorf("peer accepted %d connections, want 1", n)
	}
}

func TestSegmentIOError(t *testing.T) {
	p := startPeer(t, Config{}, failingWrites{NewMemSegment("disk", make([]byte, 4<<20))})
	c := newClient(t, Config{ConnsPerPeer: 1})
	tgt := Target{Endpoint: p.addr, Segment: "disk"}
	task, err := run(t, c, func(b *Batch) *Task { return b.Write(make([]byte, 3<<20/2), tgt, 0, Options{}) })
	if !errors.Is(err, ErrRemote) || task.State() != Failed {
		t.Fatalf("state %v, err %v", task.State(), err)
	}
	if _, err := run(t, c, func(b *Batch) *Task { return b.Read(make([]byte, 10), tgt, 0, Options{}) }); err != nil {
		t.Fatalf("read after failed write: %v", err)
	}
	if n := p.accepts.Load(); n != 1 {
		t.Errorf("peer accepted %d connections, want 1", n)
	}
}

func TestMalformedFrames(t *testing.T) {
	reg := prometheus.NewRegistry()
	mem := NewMemSegment("dram", make([]byte, 1024))
	p := startPeer(t, Config{Registerer: reg}, mem)
	valid := appendRequest(nil, opRead, "dram", 0, 8, "")
	with := func(i int, v byte) []byte { b := bytes.Clone(valid); b[i] = v; return b }
	garbage := [][]byte{
		[]byte("GET / HTTP/1.1\r\n\r\n"),
		with(2, 1),                     // version 1, which carried no ticket
		with(3, 0x7f),                  // op
		{0x54, 0x50, 2, 1, 0xff, 0xff}, // name length 65535
		appendRequest(nil, opWrite, "dram", 0, MaxOpLen+1, ""),
	}
	for i, g := range garbage {
		nc, err := net.Dial("tcp", p.addr)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := nc.Write(g); err != nil {
			t.Fatal(err)
		}
		nc.SetReadDeadline(time.Now().Add(10 * time.Second))
		if n, err := io.Copy(io.Discard, nc); err != nil || n != 0 {
			t.Errorf("garbage %d: server answered %d bytes, err %v; want the connection closed", i, n, err)
		}
		nc.Close()
	}

	// Others are still served.
	c := newClient(t, Config{})
	copy(mem.Bytes(), "tidepool")
	dst := make([]byte, 8)
	if _, err := run(t, c, func(b *Batch) *Task { return b.Read(dst, Target{Endpoint: p.addr, Segment: "dram"}, 0, Options{}) }); err != nil || string(dst) != "tidepool" {
		t.Fatalf("read %q, %v", dst, err)
	}
	if got := counterValue(t, reg, "tidepool_engine_malformed_frames_total", nil); got != float64(len(garbage)) {
		t.Errorf("malformed frames = %v, want %d", got, len(garbage))
	}
}

func TestPeerDiesMidTransfer(t *testing.T) {
	bh := newBlackhole(t)
	c := newClient(t, Config{})
	b := c.NewBatch()
	task := b.Write(make([]byte, 2<<20), Target{Endpoint: bh.addr(), Segment: "seg"}, 0, Options{})
	if err := b.Submit(context.Background()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the first slices to arrive", func() bool { return bh.received.Load() >= 64<<10 })
	// A dead peer refuses new connections too: a slice that dialled after
	// the drop would otherwise wait on a live listener forever (the write
	// has no deadline), which made this test flaky under load.
	bh.ln.Close()
	bh.dropConns()
	waitTask(t, task)
	if task.State() != Failed || !errors.Is(task.Err(), ErrUnavailable) {
		t.Fatalf("state %v, err %v", task.State(), task.Err())
	}
}

func TestPeerEngineClosedMidRead(t *testing.T) {
	g := &gated{
		Segment: NewMemSegment("slow", make([]byte, 1<<20)),
		entered: make(chan struct{}, 1),
		release: make(chan struct{}),
	}
	p := startPeer(t, Config{}, g)
	c := newClient(t, Config{})
	b := c.NewBatch()
	task := b.Read(make([]byte, 4096), Target{Endpoint: p.addr, Segment: "slow"}, 0, Options{})
	if err := b.Submit(context.Background()); err != nil {
		t.Fatal(err)
	}
	<-g.entered // the server is inside ReadAt: the request is mid-flight

	closed := make(chan error, 1)
	go func() { closed <- p.Close() }()
	waitTask(t, task)
	if task.State() != Failed || !errors.Is(task.Err(), ErrUnavailable) {
		t.Fatalf("state %v, err %v", task.State(), task.Err())
	}
	close(g.release) // Close waits for the connection goroutine, which waits for ReadAt
	if err := <-closed; err != nil {
		t.Fatal(err)
	}

	// A closed peer refuses new work the same way.
	task, err := run(t, c, func(b *Batch) *Task {
		return b.Read(make([]byte, 1), Target{Endpoint: p.addr, Segment: "slow"}, 0, Options{})
	})
	if task.State() != Failed || !errors.Is(err, ErrUnavailable) {
		t.Fatalf("after close: state %v, err %v", task.State(), err)
	}
}

func TestDeadline(t *testing.T) {
	bh := newBlackhole(t)
	c := newClient(t, Config{})
	tgt := Target{Endpoint: bh.addr(), Segment: "seg"}

	t.Run("option", func(t *testing.T) {
		task, err := run(t, c, func(b *Batch) *Task {
			return b.Read(make([]byte, 10), tgt, 0, Options{Deadline: time.Now().Add(50 * time.Millisecond)})
		})
		if task.State() != TimedOut || !errors.Is(err, ErrTimedOut) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("state %v, err %v", task.State(), err)
		}
	})
	t.Run("already passed", func(t *testing.T) {
		task, err := run(t, c, func(b *Batch) *Task {
			return b.Write(make([]byte, 10), tgt, 0, Options{Deadline: time.Now().Add(-time.Second)})
		})
		if task.State() != TimedOut || !errors.Is(err, ErrTimedOut) {
			t.Fatalf("state %v, err %v", task.State(), err)
		}
	})
	t.Run("context", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		b := c.NewBatch()
		task := b.Read(make([]byte, 4<<20), tgt, 0, Options{}) // chunked: every chunk must stop
		if err := b.Submit(ctx); err != nil {
			t.Fatal(err)
		}
		waitTask(t, task)
		if task.State() != TimedOut || !errors.Is(task.Err(), ErrTimedOut) {
			t.Fatalf("state %v, err %v", task.State(), task.Err())
		}
	})
}

func TestCancel(t *testing.T) {
	bh := newBlackhole(t)
	c := newClient(t, Config{MaxInflight: 1})
	tgt := Target{Endpoint: bh.addr(), Segment: "seg"}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b := c.NewBatch()
	running := b.Read(make([]byte, 10), tgt, 0, Options{})
	queued := b.Read(make([]byte, 10), tgt, 0, Options{}) // waits for the one slot
	if err := b.Submit(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the request to reach the peer", func() bool { return bh.received.Load() > 0 })
	if s := queued.State(); s != Pending {
		t.Errorf("second task is %v with MaxInflight 1, want pending", s)
	}
	cancel()
	if err := b.Wait(context.Background()); !errors.Is(err, context.Canceled) {
		t.Fatalf("Wait = %v", err)
	}
	for _, task := range []*Task{running, queued} {
		if task.State() != Canceled || !errors.Is(task.Err(), context.Canceled) {
			t.Errorf("state %v, err %v", task.State(), task.Err())
		}
	}
}

func TestCloseFailsTasksInFlight(t *testing.T) {
	bh := newBlackhole(t)
	c := New(Config{})
	b := c.NewBatch()
	task := b.Read(make([]byte, 10), Target{Endpoint: bh.addr(), Segment: "seg"}, 0, Options{})
	if err := b.Submit(context.Background()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the request to reach the peer", func() bool { return bh.received.Load() > 0 })
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if s := task.State(); s != Failed || !errors.Is(task.Err(), ErrClosed) {
		t.Fatalf("after Close: state %v, err %v", s, task.Err())
	}
	b = c.NewBatch()
	task = b.Read(make([]byte, 10), Target{Endpoint: bh.addr(), Segment: "seg"}, 0, Options{})
	if err := b.Submit(context.Background()); !errors.Is(err, ErrClosed) || task.State() != Failed {
		t.Fatalf("Submit after Close = %v, task %v", err, task.State())
	}
	if err := c.Serve(bh.ln); !errors.Is(err, ErrClosed) {
		t.Errorf("Serve after Close = %v", err)
	}
}

func TestBatchMisuse(t *testing.T) {
	c := newClient(t, Config{})
	ctx := context.Background()

	b := c.NewBatch()
	if err := b.Wait(ctx); !errors.Is(err, ErrInvalid) {
		t.Errorf("Wait before Submit = %v", err)
	}
	if err := b.Submit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := b.Wait(ctx); err != nil {
		t.Errorf("empty batch: Wait = %v", err)
	}
	if err := b.Submit(ctx); !errors.Is(err, ErrInvalid) {
		t.Errorf("second Submit = %v", err)
	}
	late := b.Read(nil, Target{Endpoint: "127.0.0.1:1", Segment: "s"}, 0, Options{})
	if late.State() != Failed || !errors.Is(late.Err(), ErrInvalid) {
		t.Errorf("task added after Submit: %v, %v", late.State(), late.Err())
	}

	for _, tgt := range []Target{{Segment: "s"}, {Endpoint: "127.0.0.1:1"}, {Endpoint: "127.0.0.1:1", Segment: string(make([]byte, 256))}, {Endpoint: "127.0.0.1:1", Segment: "s", Ticket: string(make([]byte, MaxTicket+1))}} {
		task, err := run(t, c, func(b *Batch) *Task { return b.Read(make([]byte, 1), tgt, 0, Options{}) })
		if task.State() != Failed || !errors.Is(err, ErrInvalid) {
			t.Errorf("target %q: state %v, err %v", tgt.Endpoint, task.State(), err)
		}
	}
}

func TestUnreachablePeer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	c := newClient(t, Config{})
	task, err := run(t, c, func(b *Batch) *Task {
		return b.Read(make([]byte, 1), Target{Endpoint: addr, Segment: "s"}, 0, Options{})
	})
	if task.State() != Failed || !errors.Is(err, ErrUnavailable) {
		t.Fatalf("state %v, err %v", task.State(), err)
	}
}

// TestStaleIdleConn: a pooled connection the peer dropped while idle is retried on a new one.
func TestStaleIdleConn(t *testing.T) {
	mem := NewMemSegment("dram", make([]byte, 16))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	p1 := New(Config{})
	p1.Register(mem)
	served := make(chan error, 1)
	go func() { served <- p1.Serve(ln) }()
	c := newClient(t, Config{ConnsPerPeer: 1})
	tgt := Target{Endpoint: addr, Segment: "dram"}
	if _, err := run(t, c, func(b *Batch) *Task { return b.Write([]byte("a"), tgt, 0, Options{}) }); err != nil {
		t.Fatal(err)
	}
	p1.Close()
	if err := <-served; err != nil {
		t.Fatal(err)
	}

	// A new engine on the same port: the client's pooled connection points at the dead one.
	ln, err = net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("cannot rebind %s: %v", addr, err)
	}
	p2 := New(Config{})
	p2.Register(mem)
	go func() { served <- p2.Serve(ln) }()
	defer func() { p2.Close(); <-served }()
	if _, err := run(t, c, func(b *Batch) *Task { return b.Write([]byte("b"), tgt, 0, Options{}) }); err != nil {
		t.Fatalf("write after peer restart: %v", err)
	}
}

func TestMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	// Peer and client share the registry, as a store and its in-process client would.
	p := startPeer(t, Config{Registerer: reg}, NewMemSegment("dram", make([]byte, 1<<20)))
	c := newClient(t, Config{Registerer: reg})
	tgt := Target{Endpoint: p.addr, Segment: "dram"}
	if _, err := run(t, c, func(b *Batch) *Task { return b.Write(make([]byte, 1000), tgt, 0, Options{}) }); err != nil {
		t.Fatal(err)
	}
	if _, err := run(t, c, func(b *Batch) *Task { return b.Read(make([]byte, 10), tgt, 1<<20, Options{}) }); err == nil {
		t.Fatal("read past end succeeded")
	}
	checks := []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"tidepool_engine_tasks_total", map[string]string{"op": "write", "state": "done"}, 1},
		{"tidepool_engine_tasks_total", map[string]string{"op": "read", "state": "failed"}, 1},
		{"tidepool_engine_transferred_bytes_total", map[string]string{"op": "write"}, 1000},
		{"tidepool_engine_served_bytes_total", map[string]string{"op": "write"}, 1000},
	}
	for _, c := range checks {
		if got := counterValue(t, reg, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
}

// counterValue returns the counter (or histogram count) with exactly these labels; 0 if absent.
func counterValue(t *testing.T, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if matches(m, labels) {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

func matches(m *dto.Metric, labels map[string]string) bool {
	if len(m.GetLabel()) != len(labels) {
		return false
	}
	for _, l := range m.GetLabel() {
		if labels[l.GetName()] != l.GetValue() {
			return false
		}
	}
	return true
}

func TestMergeContiguous(t *testing.T) {
	buf := make([]byte, 4096)
	other := make([]byte, 1024)
	tgt := Target{Endpoint: "h:1", Segment: "s"}
	read := func(b []byte, off int64, o Options) *Task { return newTask(OpRead, b, tgt, off, o) }
	tests := []struct {
		name  string
		tasks []*Task
		sizes []int
	}{
		{"adjacent in segment and memory", []*Task{read(buf[:1024], 0, Options{}), read(buf[1024:2048], 1024, Options{}), read(buf[2048:], 2048, Options{})}, []int{3}},
		{"gap in the segment", []*Task{read(buf[:1024], 0, Options{}), read(buf[1024:2048], 4096, Options{})}, []int{1, 1}},
		{"separate buffers", []*Task{read(buf[:1024], 0, Options{}), read(other, 1024, Options{})}, []int{1, 1}},
		{"different priority", []*Task{read(buf[:1024], 0, Options{}), read(buf[1024:2048], 1024, Options{Priority: High})}, []int{1, 1}},
		{"write after read", []*Task{read(buf[:1024], 0, Options{}), newTask(OpWrite, buf[1024:2048], tgt, 1024, Options{})}, []int{1, 1}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var sizes []int
			for _, g := range mergeContiguous(tc.tasks) {
				sizes = append(sizes, len(g))
			}
			if !slices.Equal(sizes, tc.sizes) {
				t.Fatalf("groups %v, want %v", sizes, tc.sizes)
			}
		})
	}
}

// TestMergedReadsEndToEnd reads consecutive blocks into one buffer: one
// request on the wire, every task Done with its own bytes.
func TestMergedReadsEndToEnd(t *testing.T) {
	mem := make([]byte, 1<<20)
	for i := range mem {
		mem[i] = byte(i * 7)
	}
	p := startPeer(t, Config{}, NewMemSegment("dram", mem))
	c := newClient(t, Config{NoShm: true})
	buf := make([]byte, 8*4096)
	b := c.NewBatch()
	var tasks []*Task
	for i := range 8 {
		tasks = append(tasks, b.Read(buf[i*4096:(i+1)*4096], Target{Endpoint: p.addr, Segment: "dram"}, int64(i*4096), Options{}))
	}
	if err := b.Submit(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := b.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, task := range tasks {
		if task.State() != Done {
			t.Fatalf("task %v", task.State())
		}
	}
	if !bytes.Equal(buf, mem[:len(buf)]) {
		t.Fatal("merged read returned the wrong bytes")
	}
}

// TestTaskDone: a task's Done channel, made on demand, is closed whether
// it is asked for before the task ends, after, or while it ends.
func TestTaskDone(t *testing.T) {
	for i := range 1000 {
		tk := newTask(OpRead, nil, Target{}, 0, Options{})
		var early <-chan struct{}
		if i%2 == 0 { // else the first Done races the end
			early = tk.Done()
		}
		var wg sync.WaitGroup
		got := make(chan (<-chan struct{}), 1)
		wg.Go(func() { got <- tk.Done() })
		wg.Go(func() { tk.finish(Done, nil) })
		wg.Wait()
		for _, ch := range []<-chan struct{}{early, <-got, tk.Done()} {
			if ch == nil {
				continue
			}
			select {
			case <-ch:
			default:
				t.Fatal("Done not closed after the task ended")
			}
		}
	}
}

// TestBatchRun: Run does what Submit and Wait do together: every task is
// terminal when it returns, with the first error in task order; a second
// Run, or one on a closed engine, fails every task at once.
func TestBatchRun(t *testing.T) {
	mem := NewMemSegment("dram", make([]byte, 1<<20))
	p := startPeer(t, Config{}, mem)
	c := newClient(t, Config{})
	tgt := Target{Endpoint: p.addr, Segment: "dram"}
	ctx := context.Background()

	src := randomBytes(rand.New(rand.NewPCG(3, 4)), 64<<10)
	b := c.NewBatch()
	w := b.Write(src, tgt, 4096, Options{})
	bad := b.Write(src, tgt, 1<<20-100, Options{}) // past the segment's end
	late := b.Write(src, Target{Endpoint: p.addr, Segment: "nope"}, 0, Options{})
	if err := b.Run(ctx); !errors.Is(err, ErrOutOfRange) {
		t.Fatalf("Run = %v, want the first failed task's ErrOutOfRange", err)
	}
	for i, tk := range []*Task{w, bad, late} {
		if !tk.State().Terminal() {
			t.Fatalf("task %d is %v after Run returned", i, tk.State())
		}
	}
	if w.State() != Done || late.State() != Failed {
		t.Fatalf("states %v, %v", w.State(), late.State())
	}
	if !bytes.Equal(mem.Bytes()[4096:4096+len(src)], src) {
		t.Fatal("the write Run reported done is not in the segment")
	}
	if err := b.Run(ctx); !errors.Is(err, ErrInvalid) {
		t.Errorf("second Run = %v", err)
	}

	c.Close()
	b = c.NewBatch()
	tk := b.Write(src, tgt, 0, Options{})
	if err := b.Run(ctx); !errors.Is(err, ErrClosed) || tk.State() != Failed {
		t.Fatalf("Run on a closed engine = %v, task %v", err, tk.State())
	}
}
