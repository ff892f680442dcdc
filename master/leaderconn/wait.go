package leaderconn

import (
	"context"
	"time"
)

// Wait describes a call still retrying because no master leader answers.
type Wait struct {
	// For is how long the call has waited.
	For time.Duration
	// Errs is the last error from each master address tried.
	Errs map[string]error
}

// First report, then one every reportEvery while the call still waits.
const (
	reportAfter = time.Second
	reportEvery = 10 * time.Second
)

type waitKey struct{}

// WithWaiting returns a context whose calls report to fn when they have
// waited a second for a master leader, and every ten seconds after, so a
// person at a terminal learns what a call waits for (as net/http/httptrace
// carries its hooks). fn runs on the caller's goroutine.
func WithWaiting(ctx context.Context, fn func(Wait)) context.Context {
	return context.WithValue(ctx, waitKey{}, fn)
}

// waiting follows one call's retries for its context's hook.
type waiting struct {
	fn    func(Wait)
	start time.Time
	next  time.Duration
	errs  map[string]error
}

func newWaiting(ctx context.Context) *waiting {
	fn, _ := ctx.Value(waitKey{}).(func(Wait))
	if fn == nil {
		return nil
	}
	return &waiting{fn: fn, start: time.Now(), next: reportAfter}
}

// failed records addr's error and reports if it is time.
func (w *waiting) failed(addr string, err error) {
	if w == nil {
		return
	}
	if w.errs == nil {
		w.errs = map[string]error{}
	}
	w.errs[addr] = err
	if d := time.Since(w.start); d >= w.next {
		w.next = d + reportEvery
		errs := make(map[string]error, len(w.errs))
		for a, e := range w.errs {
			errs[a] = e
		}
		w.fn(Wait{For: d, Errs: errs})
	}
}
