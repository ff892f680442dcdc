package leaderconn

import (
	"context"
	"errors"
	"maps"
	"sync"
	"time"
)

// Wait describes a call still retrying because no master leader answers.
type Wait struct {
	// For is how long the call has waited.
	For time.Duration
	// Errs is the last error from each master address tried; one tried
	// but not answered yet (its first attempt hangs) has ErrNoAnswerYet.
	Errs map[string]error
}

// ErrNoAnswerYet stands in Wait.Errs for the address a call is waiting on.
var ErrNoAnswerYet = errors.New("no answer yet")

// First report, then one every reportEvery while the call still waits.
const (
	reportAfter = time.Second
	reportEvery = 10 * time.Second
)

type waitKey struct{}

// WithWaiting returns a context whose calls report to fn when they have
// waited a second for a master leader, and every ten seconds after, so a
// person at a terminal learns what a call waits for (as net/http/httptrace
// carries its hooks). fn runs on a goroutine of its own, never twice at
// once, and not after the call returns.
func WithWaiting(ctx context.Context, fn func(Wait)) context.Context {
	return context.WithValue(ctx, waitKey{}, fn)
}

// waiting follows one call's attempts for its context's hook; a timer
// reports, so an attempt that hangs (a master that accepts and never
// answers) is reported on time too.
type waiting struct {
	fn    func(Wait)
	start time.Time
	mu    sync.Mutex
	errs  map[string]error
	timer *time.Timer
	done  bool
}

func newWaiting(ctx context.Context) *waiting {
	fn, _ := ctx.Value(waitKey{}).(func(Wait))
	if fn == nil {
		return nil
	}
	w := &waiting{fn: fn, start: time.Now(), errs: map[string]error{}}
	w.timer = time.AfterFunc(reportAfter, w.report)
	return w
}

func (w *waiting) report() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.done {
		return
	}
	w.fn(Wait{For: time.Since(w.start), Errs: maps.Clone(w.errs)})
	w.timer.Reset(reportEvery)
}

// trying notes that addr is being tried now.
func (w *waiting) trying(addr string) {
	if w == nil {
		return
	}
	w.mu.Lock()
	if _, ok := w.errs[addr]; !ok {
		w.errs[addr] = ErrNoAnswerYet
	}
	w.mu.Unlock()
}

// failed records addr's error.
func (w *waiting) failed(addr string, err error) {
	if w == nil {
		return
	}
	w.mu.Lock()
	w.errs[addr] = err
	w.mu.Unlock()
}

// end stops the reports: the call returns.
func (w *waiting) end() {
	if w == nil {
		return
	}
	w.timer.Stop()
	w.mu.Lock() // a report under way finishes first
	w.done = true
	w.mu.Unlock()
}
