package enginetest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/tidepool-kv/tidepool/engine"
)

// RailShape is how one rail (a peer address) behaves. The zero value is an unshaped, healthy link.
type RailShape struct {
	// Bandwidth is the link's rate in bytes per second; 0 (or less) means unshaped. All ops on the
	// rail share it, as on a serialized link.
	Bandwidth float64
	// Latency is added to every op before its transfer, plus a uniform jitter in [0, Jitter).
	// Latency is not serialized: concurrent ops wait it out in parallel.
	Latency, Jitter time.Duration
	// ErrorRate is the probability in [0, 1] that an op fails with an error wrapping
	// engine.ErrUnavailable. A failed op pays its latency but no bandwidth, and the inner transport
	// never sees it.
	ErrorRate float64
	// Down makes the rail a dead link: every op fails at once with engine.ErrUnavailable, and ops
	// waiting on the rail when it goes down fail too.
	Down bool
}

// RailStats counts what a rail carried.
type RailStats struct {
	Ops    int64 // ops that started on the rail, failed or not
	Bytes  int64 // bytes of the ops that succeeded
	Errors int64 // ops that returned an error: injected, Down, the inner transport's, ctx or Close
}

// Shaper is an engine.Transport that wraps another one and shapes each rail's traffic by its
// RailShape: latency and jitter, a per-rail bandwidth shared by concurrent ops, random errors and
// dead links. Rails without a shape pass through unshaped. It is safe for concurrent use, and
// SetRail may be called while traffic flows.
//
// An op travels over op.Rail, or over the first of its target's rails (engine.Target.Rails) when
// Rail is empty. Do then:
//
//  1. fails at once if the rail is Down;
//  2. waits Latency plus a jitter drawn from [0, Jitter);
//  3. fails if the seeded error draw says so, without calling the inner transport;
//  4. reserves the rail's next transmission slot of len(op.Buf)/Bandwidth seconds, starting at
//     the later of now and the end of the last slot reserved;
//  5. runs the inner transfer at once, then waits out the rest of its slot.
//
// Step 5 overlaps the real transfer with the shaped one, so on a transport faster than the shape
// (loopback, memory) the measured throughput matches Bandwidth instead of falling short of it by
// the real transfer time; on a slower one the inner transport is the bottleneck. The cost is that
// the bytes may have landed (a write) before Do fails on a cancellation or a Down during the
// wait, as they may over a real link that fails mid-transfer.
//
// An op that fails after reserving gives its slot back if no later op has reserved behind it;
// going Down drops every reservation. A Bandwidth change applies to slots reserved after it.
//
// Waits use real time and end early, with ctx.Err(), when ctx is done; with an error wrapping
// engine.ErrUnavailable when the rail goes Down; and with one wrapping engine.ErrClosed on Close.
type Shaper struct {
	inner  engine.Transport
	closed chan struct{} // closed by Close; waiters select on it

	closeOnce sync.Once
	closeErr  error

	mu struct {
		sync.Mutex
		rails map[string]*rail
		rng   *rand.Rand // draws errors and jitter
	}
}

// rail is one link's state; every field is guarded by Shaper.mu.
type rail struct {
	shape     RailShape
	down      chan struct{} // closed while shape.Down, so waiters on the rail wake when it dies
	busyUntil time.Time     // end of the last transmission slot reserved
	stats     RailStats
}

// slot is a reserved stretch of link time.
type slot struct {
	start, end time.Time
}

// NewShaper returns a Shaper over inner whose random draws (errors, jitter) come from a PCG
// generator seeded with seed. The Shaper owns inner: Close closes it.
func NewShaper(inner engine.Transport, seed uint64) *Shaper {
	s := &Shaper{inner: inner, closed: make(chan struct{})}
	s.mu.rails = make(map[string]*rail)
	s.mu.rng = rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	return s
}

// SetRail sets the shape of the rail at addr. It takes effect for ops already waiting on the rail
// where it can: going Down fails them, and a new Bandwidth applies to the slots reserved from now
// on.
func (s *Shaper) SetRail(addr string, shape RailShape) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.railLocked(addr)
	switch {
	case shape.Down && !r.shape.Down:
		close(r.down)
		r.busyUntil = time.Time{}
	case !shape.Down && r.shape.Down:
		r.down = make(chan struct{})
	}
	r.shape = shape
}

// Rail returns the shape of the rail at addr: the zero RailShape if it was never set.
func (s *Shaper) Rail(addr string) RailShape {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r, ok := s.mu.rails[addr]; ok {
		return r.shape
	}
	return RailShape{}
}

// Stats returns what the rail at addr has carried so far.
func (s *Shaper) Stats(addr string) RailStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r, ok := s.mu.rails[addr]; ok {
		return r.stats
	}
	return RailStats{}
}

// Name returns "shaped-" and the inner transport's name.
func (s *Shaper) Name() string { return "shaped-" + s.inner.Name() }

// Close fails the ops waiting in the Shaper and every later Do with ErrClosed, and closes the
// inner transport. It returns the inner transport's Close error; later calls return it again.
func (s *Shaper) Close() error {
	s.closeOnce.Do(func() {
		close(s.closed)
		s.closeErr = s.inner.Close()
	})
	return s.closeErr
}

// Do moves op's bytes through the inner transport, shaped by the rail's RailShape; the type's
// comment gives the steps.
func (s *Shaper) Do(ctx context.Context, op *engine.Op) error {
	select {
	case <-s.closed:
		return fmt.Errorf("enginetest: shaper: %w", engine.ErrClosed)
	default:
	}
	addr := op.Rail
	if addr == "" {
		addr = op.Target.Rails()[0]
	}

	shape, down, fail, delay := s.begin(addr)
	if shape.Down {
		return s.fail(addr, errDown(addr))
	}
	if delay > 0 {
		if err := s.wait(ctx, addr, time.Now().Add(delay), down); err != nil {
			return s.fail(addr, err)
		}
	}
	if fail {
		return s.fail(addr, fmt.Errorf("enginetest: rail %s: injected fault: %w", addr, engine.ErrUnavailable))
	}

	sl, down, ok := s.reserve(addr, len(op.Buf))
	if !ok {
		return s.fail(addr, errDown(addr))
	}
	if err := s.inner.Do(ctx, op); err != nil {
		s.release(addr, sl)
		return s.fail(addr, err)
	}
	if err := s.wait(ctx, addr, sl.end, down); err != nil {
		s.release(addr, sl)
		return s.fail(addr, err)
	}

	s.mu.Lock()
	s.mu.rails[addr].stats.Bytes += int64(len(op.Buf))
	s.mu.Unlock()
	return nil
}

// begin counts an op on the rail and makes its random draws: whether it fails, and its delay.
func (s *Shaper) begin(addr string) (shape RailShape, down <-chan struct{}, fail bool, delay time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.railLocked(addr)
	r.stats.Ops++
	shape = r.shape
	if shape.Down {
		return shape, r.down, false, 0
	}
	if shape.ErrorRate > 0 {
		fail = s.mu.rng.Float64() < shape.ErrorRate
	}
	delay = max(shape.Latency, 0)
	if shape.Jitter > 0 {
		delay += time.Duration(s.mu.rng.Int64N(int64(shape.Jitter)))
	}
	return shape, r.down, fail, delay
}

// reserve books the rail's next transmission slot for n bytes under the rail's current shape. An
// unshaped rail gets an empty slot that ends now. ok is false if the rail is Down.
func (s *Shaper) reserve(addr string, n int) (sl slot, down <-chan struct{}, ok bool) {
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.mu.rails[addr]
	if r.shape.Down {
		return slot{}, nil, false
	}
	if r.shape.Bandwidth <= 0 {
		return slot{start: now, end: now}, r.down, true
	}
	sl.start = now
	if r.busyUntil.After(now) {
		sl.start = r.busyUntil
	}
	sl.end = sl.start.Add(time.Duration(float64(n) / r.shape.Bandwidth * float64(time.Second)))
	r.busyUntil = sl.end
	return sl, r.down, true
}

// release gives a failed op's slot back when it is the last one reserved; a slot with later ones
// behind it stays booked, since they have already been timed after it.
func (s *Shaper) release(addr string, sl slot) {
	if !sl.end.After(sl.start) {
		return
	}
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if r := s.mu.rails[addr]; r.busyUntil.Equal(sl.end) {
		r.busyUntil = sl.start
		if now.After(sl.start) {
			r.busyUntil = now
		}
	}
}

// fail counts an op's error on the rail and returns it.
func (s *Shaper) fail(addr string, err error) error {
	s.mu.Lock()
	s.mu.rails[addr].stats.Errors++
	s.mu.Unlock()
	return err
}

// wait blocks until deadline, or until ctx is done, the rail goes down or the Shaper is closed.
func (s *Shaper) wait(ctx context.Context, addr string, deadline time.Time, down <-chan struct{}) error {
	d := time.Until(deadline)
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-down:
		return errDown(addr)
	case <-s.closed:
		return fmt.Errorf("enginetest: shaper: %w", engine.ErrClosed)
	}
}

// railLocked returns the rail at addr, creating an unshaped one. s.mu must be held.
func (s *Shaper) railLocked(addr string) *rail {
	r, ok := s.mu.rails[addr]
	if !ok {
		r = &rail{down: make(chan struct{})}
		s.mu.rails[addr] = r
	}
	return r
}

func errDown(addr string) error {
	return fmt.Errorf("enginetest: rail %s is down: %w", addr, engine.ErrUnavailable)
}

var _ engine.Transport = (*Shaper)(nil)
