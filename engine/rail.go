package engine

import (
	"context"
	"errors"
	"sync"
	"time"
)

const (
	ewmaAlpha     = 0.01 // weight of one observation: a rail's estimate moves over ~100 slices
	ewmaClampLo   = 0.1  // estimates stay within [0.1x, 10x] nominal, so one odd sample,
	ewmaClampHi   = 10   // or a timer tick, cannot make a rail look dead or infinitely fast
	railErrLimit  = 3    // errors within railErrWindow that pause a rail
	railErrWindow = 10 * time.Second
	railPauseMin  = 30 * time.Second  // the first pause; each further one doubles,
	railPauseMax  = 300 * time.Second // up to this

	// defaultNominal stands in for a rail's speed when the caller does not know it (10 Gbit/s);
	// the EWMA corrects it within a few hundred slices.
	defaultNominal = 10e9 / 8
)

// Rail states, as telemetry reports them.
const (
	railUp      = "up"      // healthy
	railPaused  = "paused"  // cooling down after railErrLimit errors; never picked
	railProbing = "probing" // cooldown over, half-open: the next error pauses it again, longer
)

// rail is one path to a peer (one of its listen addresses): the bytes in flight on it, an EWMA of
// the bandwidth it delivers, and its health.
//
// A rail is safe for concurrent use: every method takes r.mu. It never calls out while holding it,
// so callers may hold their own locks (the sprayer's) around rail calls.
type rail struct {
	addr    string  // immutable
	nominal float64 // bytes per second; immutable

	mu struct {
		sync.Mutex
		ewma     float64     // bytes per second, within [ewmaClampLo, ewmaClampHi] x nominal
		inflight int64       // bytes handed to the rail and not yet finished
		errs     []time.Time // errors within the last railErrWindow, oldest first
		errTotal int64       // every error since start, for telemetry
		// pausedUntil is when the current pause ends; zero when not paused. A rail whose pause has
		// ended but that has not succeeded since is half-open (halfOpen).
		pausedUntil time.Time
		halfOpen    bool
		pause       time.Duration // the length of the next pause
	}
}

// newRail returns a healthy rail whose bandwidth estimate starts at nominal bytes per second. A
// non-positive nominal (speed unknown) is taken as defaultNominal.
func newRail(addr string, nominal float64) *rail {
	if nominal <= 0 {
		nominal = defaultNominal
	}
	r := &rail{addr: addr, nominal: nominal}
	r.mu.ewma = nominal
	r.mu.pause = railPauseMin
	return r
}

// observe folds one finished transfer of bytes in service time into the bandwidth estimate.
// service is measured from dispatch, not enqueue, so queueing does not read as a slow rail. Each
// sample is clamped to [0.1x, 10x] nominal before it is averaged, which keeps the estimate in that
// range too. Empty transfers and zero durations say nothing about bandwidth and are ignored.
func (r *rail) observe(bytes int, service time.Duration) {
	if bytes <= 0 || service <= 0 {
		return
	}
	bw := float64(bytes) / service.Seconds()
	bw = min(max(bw, ewmaClampLo*r.nominal), ewmaClampHi*r.nominal)
	r.mu.Lock()
	r.mu.ewma += ewmaAlpha * (bw - r.mu.ewma)
	r.mu.Unlock()
}

// score is the predicted finish time, in seconds, of a slice of the given size sent now: the bytes
// already in flight plus the slice, over the estimated bandwidth, times a topology penalty (1 for
// a rail on the same topology, more for one that crosses a slower link).
func (r *rail) score(slice int, penalty float64) float64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return float64(r.mu.inflight+int64(slice)) / r.mu.ewma * penalty
}

// add changes the bytes in flight by delta.
func (r *rail) add(delta int64) {
	r.mu.Lock()
	r.mu.inflight += delta
	r.mu.Unlock()
}

// fail records an error at now. railErrLimit errors within railErrWindow pause the rail for
// r.mu.pause; a half-open rail (its cooldown over, no success since) is paused again on its first
// error. Each pause doubles the next one, up to railPauseMax. Errors from slices that were in
// flight when the rail was paused are counted but do not extend the pause.
func (r *rail) fail(now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.mu.errTotal++
	switch {
	case now.Before(r.mu.pausedUntil):
		return
	case r.mu.halfOpen:
		r.pauseLocked(now)
		return
	}
	errs := r.mu.errs[:0]
	for _, t := range r.mu.errs {
		if now.Sub(t) < railErrWindow {
			errs = append(errs, t)
		}
	}
	r.mu.errs = append(errs, now)
	if len(r.mu.errs) >= railErrLimit {
		r.pauseLocked(now)
	}
}

func (r *rail) pauseLocked(now time.Time) {
	r.mu.pausedUntil = now.Add(r.mu.pause)
	r.mu.pause = min(2*r.mu.pause, railPauseMax)
	r.mu.halfOpen = true
	r.mu.errs = r.mu.errs[:0]
}

// succeed records a success: the rail works, so it is fully restored: error window cleared, any
// pause lifted, and the next pause back to railPauseMin.
func (r *rail) succeed(now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.mu.errs = r.mu.errs[:0]
	r.mu.pausedUntil = time.Time{}
	r.mu.halfOpen = false
	r.mu.pause = railPauseMin
}

// available reports whether the rail may be given slices at now: anything but paused. A probing
// (half-open) rail is available, so traffic finds out whether it has recovered.
func (r *rail) available(now time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return !now.Before(r.mu.pausedUntil)
}

// state is the rail's health at now, for telemetry: railUp, railPaused or railProbing.
func (r *rail) state(now time.Time) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stateLocked(now)
}

func (r *rail) stateLocked(now time.Time) string {
	switch {
	case now.Before(r.mu.pausedUntil):
		return railPaused
	case r.mu.halfOpen:
		return railProbing
	default:
		return railUp
	}
}

// railStats is a consistent snapshot of one rail, for telemetry and `tidepool admin rails`.
type railStats struct {
	addr     string
	inflight int64   // bytes
	ewma     float64 // bytes per second
	errors   int64   // since start
	state    string
}

func (r *rail) stats(now time.Time) railStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	return railStats{
		addr:     r.addr,
		inflight: r.mu.inflight,
		ewma:     r.mu.ewma,
		errors:   r.mu.errTotal,
		state:    r.stateLocked(now),
	}
}

// railFault reports whether a slice's error says the rail itself is bad. Errors the peer answered
// with (no such segment, out of range, its own I/O failed) came over a working rail, and
// cancellation, deadlines and closing are the caller's doing; none of those count against the
// rail. Anything else (ErrUnavailable, ErrProtocol, an error a transport did not classify) does.
func railFault(err error) bool {
	if err == nil {
		return false
	}
	for _, neutral := range []error{
		ErrSegmentNotFound, ErrOutOfRange, ErrRemote, ErrInvalid, ErrClosed, ErrTimedOut, ErrForbidden,
		context.Canceled, context.DeadlineExceeded,
	} {
		if errors.Is(err, neutral) {
			return false
		}
	}
	return true
}
