package enginetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/engine"
)

const mib = 1 << 20

// memTransport is an in-memory engine.Transport: segments are byte slices in a map, and every
// call is counted so tests can tell whether the Shaper reached it.
type memTransport struct {
	calls atomic.Int64
	mu    struct {
		sync.Mutex
		segs   map[string][]byte
		closed bool
	}
}

func newMemTransport(segs map[string]int) *memTransport {
	m := &memTransport{}
	m.mu.segs = make(map[string][]byte)
	for name, size := range segs {
		m.mu.segs[name] = make([]byte, size)
	}
	return m
}

func (m *memTransport) Name() string { return "mem" }

func (m *memTransport) Do(ctx context.Context, op *engine.Op) error {
	m.calls.Add(1)
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mu.closed {
		return engine.ErrClosed
	}
	seg, ok := m.mu.segs[op.Target.Segment]
	if !ok {
		return fmt.Errorf("mem: %s: %w", op.Target.Segment, engine.ErrSegmentNotFound)
	}
	if op.Offset < 0 || op.Offset+int64(len(op.Buf)) > int64(len(seg)) {
		return fmt.Errorf("mem: %s[%d:+%d]: %w", op.Target.Segment, op.Offset, len(op.Buf), engine.ErrOutOfRange)
	}
	switch op.Kind {
	case engine.OpRead:
		copy(op.Buf, seg[op.Offset:])
	case engine.OpWrite:
		copy(seg[op.Offset:], op.Buf)
	default:
		return fmt.Errorf("mem: op kind %v: %w", op.Kind, engine.ErrInvalid)
	}
	return nil
}

func (m *memTransport) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.mu.closed = true
	return nil
}

func (m *memTransport) isClosed() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.mu.closed
}

// newTestShaper returns a Shaper over a memTransport holding one 1 MiB segment "seg".
func newTestShaper(t *testing.T, seed uint64) (*Shaper, *memTransport) {
	t.Helper()
	mem := newMemTransport(map[string]int{"seg": mib})
	sh := NewShaper(mem, seed)
	t.Cleanup(func() { sh.Close() })
	return sh, mem
}

func writeOp(rail string, n int) *engine.Op {
	return &engine.Op{
		Kind:   engine.OpWrite,
		Target: engine.Target{Endpoint: rail, Segment: "seg"},
		Buf:    make([]byte, n),
		Rail:   rail,
	}
}

// parallel runs n ops on rail concurrently, each of size bytes, and returns how long they took
// and the errors they returned.
func parallel(ctx context.Context, sh *Shaper, rail string, n, size int) (time.Duration, []error) {
	errs := make([]error, n)
	start := time.Now()
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { errs[i] = sh.Do(ctx, writeOp(rail, size)) })
	}
	wg.Wait()
	return time.Since(start), errs
}

func noErrors(t *testing.T, errs []error) {
	t.Helper()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("op %d: %v", i, err)
		}
	}
}

func within(t *testing.T, what string, got, lo, hi time.Duration) {
	t.Helper()
	if got < lo || got > hi {
		t.Errorf("%s took %v, want %v..%v", what, got, lo, hi)
	} else {
		t.Logf("%s took %v (band %v..%v)", what, got, lo, hi)
	}
}

// eventually polls cond every millisecond until it holds or d passes.
func eventually(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestShaperPassThrough(t *testing.T) {
	sh, mem := newTestShaper(t, 1)
	if got, want := sh.Name(), "shaped-mem"; got != want {
		t.Errorf("Name() = %q, want %q", got, want)
	}
	tgt := engine.Target{Endpoint: "a:1", Segment: "seg"}
	src := []byte("hello, rails")
	if err := sh.Do(t.Context(), &engine.Op{Kind: engine.OpWrite, Target: tgt, Offset: 100, Buf: src, Rail: "a:1"}); err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, len(src))
	if err := sh.Do(t.Context(), &engine.Op{Kind: engine.OpRead, Target: tgt, Offset: 100, Buf: dst, Rail: "a:1"}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, src) {
		t.Errorf("read %q, want %q", dst, src)
	}
	if got := mem.calls.Load(); got != 2 {
		t.Errorf("inner calls = %d, want 2", got)
	}
	if got, want := sh.Stats("a:1"), (RailStats{Ops: 2, Bytes: int64(2 * len(src))}); got != want {
		t.Errorf("Stats = %+v, want %+v", got, want)
	}
	if got := sh.Rail("a:1"); got != (RailShape{}) {
		t.Errorf("Rail of an unset rail = %+v, want zero", got)
	}

	// Errors of the inner transport come through and are counted.
	err := sh.Do(t.Context(), &engine.Op{Kind: engine.OpRead, Target: engine.Target{Endpoint: "a:1", Segment: "nope"}, Buf: dst, Rail: "a:1"})
	if !errors.Is(err, engine.ErrSegmentNotFound) {
		t.Errorf("read of a missing segment: %v, want ErrSegmentNotFound", err)
	}
	if got := sh.Stats("a:1").Errors; got != 1 {
		t.Errorf("Errors = %d, want 1", got)
	}
}

func TestShaperEmptyRailUsesFirstEndpoint(t *testing.T) {
	sh, _ := newTestShaper(t, 1)
	sh.SetRail("b:2", RailShape{Down: true})
	op := &engine.Op{Kind: engine.OpWrite, Target: engine.Target{Endpoint: "a:1,b:2", Segment: "seg"}, Buf: make([]byte, 10)}
	if err := sh.Do(t.Context(), op); err != nil {
		t.Fatal(err)
	}
	if got := sh.Stats("a:1"); got.Ops != 1 || got.Bytes != 10 {
		t.Errorf("Stats(a:1) = %+v, want 1 op of 10 bytes", got)
	}
	op.Rail = "b:2"
	if err := sh.Do(t.Context(), op); !errors.Is(err, engine.ErrUnavailable) {
		t.Errorf("op bound to the dead rail: %v, want ErrUnavailable", err)
	}
}

func TestShaperBandwidth(t *testing.T) {
	// 10 ops of 64 KiB at 3.2 MB/s: 10 * 65536 / 3.2e6 s = 205 ms on one rail. Small ops on
	// slow rails, so that the shaping and not the copies (slow under the race detector, on a
	// busy machine) takes the time; the upper bounds are loose for the same reason.
	const bw, n, size = 3.2e6, 10, 64 << 10
	t.Run("concurrent ops share the rail", func(t *testing.T) {
		sh, _ := newTestShaper(t, 1)
		sh.SetRail("a:1", RailShape{Bandwidth: bw})
		took, errs := parallel(t.Context(), sh, "a:1", n, size)
		noErrors(t, errs)
		within(t, "10 x 64 KiB at 3.2 MB/s", took, 150*time.Millisecond, time.Second)
		if got, want := sh.Stats("a:1"), (RailStats{Ops: n, Bytes: n * size}); got != want {
			t.Errorf("Stats = %+v, want %+v", got, want)
		}
	})
	t.Run("serial ops", func(t *testing.T) {
		sh, _ := newTestShaper(t, 1)
		sh.SetRail("a:1", RailShape{Bandwidth: bw})
		start := time.Now()
		for range n {
			if err := sh.Do(t.Context(), writeOp("a:1", size)); err != nil {
				t.Fatal(err)
			}
		}
		within(t, "10 serial x 64 KiB at 3.2 MB/s", time.Since(start), 150*time.Millisecond, time.Second)
	})
	t.Run("rails are independent", func(t *testing.T) {
		sh, _ := newTestShaper(t, 1)
		sh.SetRail("a:1", RailShape{Bandwidth: bw})
		sh.SetRail("b:2", RailShape{Bandwidth: bw})
		alone, errs := parallel(t.Context(), sh, "a:1", n, size)
		noErrors(t, errs)
		start := time.Now()
		var wg sync.WaitGroup
		var errsA, errsB []error
		wg.Go(func() { _, errsA = parallel(t.Context(), sh, "a:1", n, size) })
		wg.Go(func() { _, errsB = parallel(t.Context(), sh, "b:2", n, size) })
		wg.Wait()
		noErrors(t, errsA)
		noErrors(t, errsB)
		// Sharing one link would take twice as long as one rail alone; two
		// independent ones take as long. Compared with the rail alone in the
		// same test, so that a loaded machine slows both.
		if both := time.Since(start); both > alone*3/2 {
			t.Errorf("10 x 64 KiB on each of two 3.2 MB/s rails took %v, on one alone %v: the rails share a link", both, alone)
		}
	})
	t.Run("unshaped rail is not slowed by a shaped one", func(t *testing.T) {
		sh, _ := newTestShaper(t, 1)
		sh.SetRail("slow:1", RailShape{Bandwidth: 16e3}) // 64 KiB takes ~4 s
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- sh.Do(ctx, writeOp("slow:1", size)) }()
		took, errs := parallel(t.Context(), sh, "fast:1", n, size)
		noErrors(t, errs)
		within(t, "10 x 64 KiB unshaped beside a slow rail", took, 0, 2*time.Second)
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("slow op: %v, want context.Canceled", err)
		}
	})
}

func TestShaperLatency(t *testing.T) {
	sh, _ := newTestShaper(t, 7)
	const lat, jit = 20 * time.Millisecond, 10 * time.Millisecond
	sh.SetRail("a:1", RailShape{Latency: lat, Jitter: jit})
	for i := range 5 {
		start := time.Now()
		if err := sh.Do(t.Context(), writeOp("a:1", 100)); err != nil {
			t.Fatal(err)
		}
		within(t, fmt.Sprintf("op %d with 20ms+[0,10ms)", i), time.Since(start), lat, lat+jit+150*time.Millisecond)
	}

	// Latency is propagation, not serialization: concurrent ops wait it out together.
	sh.SetRail("b:2", RailShape{Latency: 50 * time.Millisecond})
	took, errs := parallel(t.Context(), sh, "b:2", 10, 100)
	noErrors(t, errs)
	within(t, "10 concurrent ops with 50ms latency", took, 50*time.Millisecond, 250*time.Millisecond)
}

func TestShaperErrorRateOne(t *testing.T) {
	sh, mem := newTestShaper(t, 1)
	sh.SetRail("a:1", RailShape{ErrorRate: 1})
	for i := range 100 {
		if err := sh.Do(t.Context(), writeOp("a:1", 100)); !errors.Is(err, engine.ErrUnavailable) {
			t.Fatalf("op %d: %v, want ErrUnavailable", i, err)
		}
	}
	if got := mem.calls.Load(); got != 0 {
		t.Errorf("inner calls = %d, want 0", got)
	}
	if got, want := sh.Stats("a:1"), (RailStats{Ops: 100, Errors: 100}); got != want {
		t.Errorf("Stats = %+v, want %+v", got, want)
	}
}

func TestShaperErrorRateHalf(t *testing.T) {
	const n = 1000
	run := func(seed uint64) []bool {
		sh, mem := newTestShaper(t, seed)
		sh.SetRail("a:1", RailShape{ErrorRate: 0.5})
		failed := make([]bool, n)
		var fails int64
		for i := range n {
			err := sh.Do(t.Context(), writeOp("a:1", 10))
			switch {
			case err == nil:
			case errors.Is(err, engine.ErrUnavailable):
				failed[i] = true
				fails++
			default:
				t.Fatalf("op %d: %v", i, err)
			}
		}
		if fails < 400 || fails > 600 {
			t.Errorf("seed %d: %d of %d ops failed, want about half", seed, fails, n)
		}
		if got := mem.calls.Load(); got != n-fails {
			t.Errorf("seed %d: inner calls = %d, want %d (the ops that did not fail)", seed, got, n-fails)
		}
		if got, want := sh.Stats("a:1"), (RailStats{Ops: n, Bytes: 10 * (n - fails), Errors: fails}); got != want {
			t.Errorf("seed %d: Stats = %+v, want %+v", seed, got, want)
		}
		return failed
	}
	a, b, c := run(42), run(42), run(43)
	if !slicesEqual(a, b) {
		t.Error("the same seed gave different failures")
	}
	if slicesEqual(a, c) {
		t.Error("different seeds gave the same failures")
	}
}

func slicesEqual(a, b []bool) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestShaperDownMidRun(t *testing.T) {
	sh, mem := newTestShaper(t, 1)
	sh.SetRail("a:1", RailShape{Bandwidth: 1e6}) // 1 MiB takes ~1 s
	sh.SetRail("b:2", RailShape{Bandwidth: 100e6})

	// An op waiting out its slot fails promptly when the rail dies.
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- sh.Do(t.Context(), writeOp("a:1", mib)) }()
	eventually(t, time.Second, "the op to reach the inner transport", func() bool { return mem.calls.Load() == 1 })
	sh.SetRail("a:1", RailShape{Down: true})
	if err := <-done; !errors.Is(err, engine.ErrUnavailable) {
		t.Fatalf("op in flight when the rail went down: %v, want ErrUnavailable", err)
	}
	within(t, "op killed by Down", time.Since(start), 0, 500*time.Millisecond)

	// So does one waiting out its latency.
	sh.SetRail("a:1", RailShape{Latency: time.Minute})
	go func() { done <- sh.Do(t.Context(), writeOp("a:1", 10)) }()
	eventually(t, time.Second, "the op to start", func() bool { return sh.Stats("a:1").Ops == 2 })
	sh.SetRail("a:1", RailShape{Latency: time.Minute, Down: true})
	if err := <-done; !errors.Is(err, engine.ErrUnavailable) {
		t.Fatalf("op in its latency when the rail went down: %v, want ErrUnavailable", err)
	}

	// While down, ops fail at once without reaching the inner transport; other rails carry on.
	calls := mem.calls.Load()
	for range 10 {
		start := time.Now()
		if err := sh.Do(t.Context(), writeOp("a:1", mib)); !errors.Is(err, engine.ErrUnavailable) {
			t.Fatalf("op on a dead rail: %v, want ErrUnavailable", err)
		}
		if d := time.Since(start); d > 100*time.Millisecond {
			t.Errorf("op on a dead rail took %v, want immediate", d)
		}
	}
	if got := mem.calls.Load(); got != calls {
		t.Errorf("inner calls on a dead rail: %d, want 0", got-calls)
	}
	_, errs := parallel(t.Context(), sh, "b:2", 4, mib)
	noErrors(t, errs)

	// Back up, with its old bandwidth: the reservations of the dead ops are gone, so a 100 KB op
	// takes ~100 ms, not the second left of the killed op's slot.
	sh.SetRail("a:1", RailShape{Bandwidth: 1e6})
	start = time.Now()
	if err := sh.Do(t.Context(), writeOp("a:1", 100_000)); err != nil {
		t.Fatalf("op after the rail came back: %v", err)
	}
	within(t, "100 KB at 1 MB/s after revival", time.Since(start), 90*time.Millisecond, 500*time.Millisecond)
	if got, want := sh.Stats("a:1"), (RailStats{Ops: 13, Bytes: 100_000, Errors: 12}); got != want {
		t.Errorf("Stats = %+v, want %+v", got, want)
	}
}

func TestShaperContextCancel(t *testing.T) {
	cases := []struct {
		name  string
		shape RailShape
		size  int
	}{
		{"during latency", RailShape{Latency: time.Minute}, 10},
		{"during jitter", RailShape{Jitter: time.Minute}, 10},
		{"during bandwidth slot", RailShape{Bandwidth: 1e6}, 10 * mib}, // ~10 s
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			mem := newMemTransport(map[string]int{"seg": 10 * mib})
			sh := NewShaper(mem, 1)
			defer sh.Close()
			sh.SetRail("a:1", tc.shape)
			ctx, cancel := context.WithCancel(t.Context())
			done := make(chan error, 1)
			go func() { done <- sh.Do(ctx, writeOp("a:1", tc.size)) }()
			eventually(t, time.Second, "the op to start", func() bool { return sh.Stats("a:1").Ops == 1 })
			time.Sleep(10 * time.Millisecond) // let it reach its wait
			start := time.Now()
			cancel()
			if err := <-done; !errors.Is(err, context.Canceled) {
				t.Fatalf("canceled op: %v, want context.Canceled", err)
			}
			// Uncanceled, the op would wait 10 s or a minute; the bound is loose
			// for the race detector on a busy machine.
			within(t, "return after cancel", time.Since(start), 0, time.Second)
			if got := sh.Stats("a:1"); got.Errors != 1 || got.Bytes != 0 {
				t.Errorf("Stats = %+v, want 1 error, 0 bytes", got)
			}
		})
	}

	t.Run("canceled slot is given back", func(t *testing.T) {
		sh, mem := newTestShaper(t, 1)
		sh.SetRail("a:1", RailShape{Bandwidth: 1e6})
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- sh.Do(ctx, writeOp("a:1", mib)) }() // books ~1 s
		eventually(t, time.Second, "the op to reach the inner transport", func() bool { return mem.calls.Load() == 1 })
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Fatalf("canceled op: %v, want context.Canceled", err)
		}
		start := time.Now()
		if err := sh.Do(t.Context(), writeOp("a:1", 10_000)); err != nil { // ~10 ms
			t.Fatal(err)
		}
		within(t, "10 KB at 1 MB/s after a canceled 1 MiB op", time.Since(start), 5*time.Millisecond, 300*time.Millisecond)
	})

	t.Run("already canceled", func(t *testing.T) {
		sh, _ := newTestShaper(t, 1)
		sh.SetRail("a:1", RailShape{Latency: time.Minute})
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		if err := sh.Do(ctx, writeOp("a:1", 10)); !errors.Is(err, context.Canceled) {
			t.Fatalf("op with a canceled ctx: %v, want context.Canceled", err)
		}
	})
}

func TestShaperClose(t *testing.T) {
	mem := newMemTransport(map[string]int{"seg": mib})
	sh := NewShaper(mem, 1)
	sh.SetRail("a:1", RailShape{Latency: time.Minute})
	done := make(chan error, 1)
	go func() { done <- sh.Do(t.Context(), writeOp("a:1", 10)) }()
	eventually(t, time.Second, "the op to start", func() bool { return sh.Stats("a:1").Ops == 1 })

	if err := sh.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, engine.ErrClosed) {
		t.Errorf("op waiting at Close: %v, want ErrClosed", err)
	}
	if !mem.isClosed() {
		t.Error("Close did not close the inner transport")
	}
	if err := sh.Do(t.Context(), writeOp("b:2", 10)); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("Do after Close: %v, want ErrClosed", err)
	}
	if got := mem.calls.Load(); got != 0 {
		t.Errorf("inner calls = %d, want 0", got)
	}
	if err := sh.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// TestShaperSetRailConcurrent changes shapes while ops flow on the same rails; run it with -race.
func TestShaperSetRailConcurrent(t *testing.T) {
	sh, _ := newTestShaper(t, 3)
	rails := []string{"a:1", "b:2"}
	shapes := []RailShape{
		{},
		{Bandwidth: 500e6, Latency: 100 * time.Microsecond},
		{Jitter: 200 * time.Microsecond, ErrorRate: 0.3},
		{Down: true},
		{Bandwidth: 200e6},
	}
	stop := make(chan struct{})
	var flips sync.WaitGroup
	flips.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			r := rails[i%len(rails)]
			sh.SetRail(r, shapes[i%len(shapes)])
			_ = sh.Rail(r)
			_ = sh.Stats(r)
			time.Sleep(50 * time.Microsecond)
		}
	})

	const workers, perWorker = 8, 200
	var ok, failed atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range perWorker {
				err := sh.Do(t.Context(), writeOp(rails[(w+i)%len(rails)], 4096))
				switch {
				case err == nil:
					ok.Add(1)
				case errors.Is(err, engine.ErrUnavailable):
					failed.Add(1)
				default:
					t.Errorf("worker %d op %d: %v", w, i, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(stop)
	flips.Wait()

	var total RailStats
	for _, r := range rails {
		st := sh.Stats(r)
		total.Ops += st.Ops
		total.Bytes += st.Bytes
		total.Errors += st.Errors
	}
	want := RailStats{Ops: workers * perWorker, Bytes: 4096 * ok.Load(), Errors: failed.Load()}
	if total != want {
		t.Errorf("summed Stats = %+v, want %+v", total, want)
	}
	t.Logf("%d ok, %d failed", ok.Load(), failed.Load())
}

// TestShaperThroughEngine plugs a Shaper into an engine through Config.Transport.
func TestShaperThroughEngine(t *testing.T) {
	mem := newMemTransport(map[string]int{"seg": 8 * mib})
	sh := NewShaper(mem, 1)
	eng := engine.New(engine.Config{Transport: sh})
	defer eng.Close()
	sh.SetRail("a:1", RailShape{Bandwidth: 100e6, Latency: time.Millisecond})
	tgt := engine.Target{Endpoint: "a:1", Segment: "seg"}

	src := make([]byte, 4*mib)
	for i := range src {
		src[i] = byte(i * 7)
	}
	dst := make([]byte, len(src))
	start := time.Now()
	for _, build := range []func(*engine.Batch){
		func(b *engine.Batch) { b.Write(src, tgt, 0, engine.Options{}) },
		func(b *engine.Batch) { b.Read(dst, tgt, 0, engine.Options{}) },
	} {
		b := eng.NewBatch()
		build(b)
		if err := b.Submit(t.Context()); err != nil {
			t.Fatal(err)
		}
		if err := b.Wait(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(dst, src) {
		t.Fatal("read back different bytes")
	}
	// 8 MiB at 100 MB/s: ~84 ms.
	within(t, "4 MiB written and read at 100 MB/s", time.Since(start), 60*time.Millisecond, 400*time.Millisecond)
	if got := sh.Stats("a:1"); got.Bytes != 8*mib || got.Errors != 0 {
		t.Errorf("Stats = %+v, want 8 MiB and no errors", got)
	}

	sh.SetRail("a:1", RailShape{Down: true})
	b := eng.NewBatch()
	task := b.Read(dst, tgt, 0, engine.Options{})
	if err := b.Submit(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := b.Wait(t.Context()); !errors.Is(err, engine.ErrUnavailable) {
		t.Errorf("read over a dead rail: %v, want ErrUnavailable", err)
	}
	if task.State() != engine.Failed {
		t.Errorf("task state = %v, want failed", task.State())
	}
}
