package engine

import (
	"context"
	"fmt"
	"math"
	"sync"
	"testing"
	"time"
)

func TestRailObserve(t *testing.T) {
	const nominal = 1e9 // bytes per second
	tests := []struct {
		name    string
		bytes   int
		service time.Duration
		times   int
		want    float64 // ewma after
	}{
		{"seeded at nominal", 0, 0, 0, nominal},
		{"one sample moves it by alpha", 2e6, time.Millisecond, 1, nominal + ewmaAlpha*(2e9-nominal)},
		{"converges", 2e6, time.Millisecond, 5000, 2e9},
		{"fast samples clamp at 10x", 1e9, time.Nanosecond, 5000, 10 * nominal},
		{"slow samples clamp at 0.1x", 1, time.Second, 5000, 0.1 * nominal},
		{"zero duration ignored", 1e9, 0, 100, nominal},
		{"empty transfer ignored", 0, time.Second, 100, nominal},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newRail("a", nominal)
			for range tt.times {
				r.observe(tt.bytes, tt.service)
			}
			got := r.stats(time.Time{}).ewma
			if math.Abs(got-tt.want) > 1e-6*tt.want {
				t.Fatalf("ewma = %g, want %g", got, tt.want)
			}
		})
	}
}

func TestRailObserveNeverLeavesClamp(t *testing.T) {
	r := newRail("a", 1e9)
	r.observe(1e9, time.Nanosecond) // a single absurd sample
	if got := r.stats(time.Time{}).ewma; got > 1e9+ewmaAlpha*10e9+1 {
		t.Fatalf("one 1e18 B/s sample moved ewma to %g", got)
	}
}

func TestRailDefaultNominal(t *testing.T) {
	for _, nominal := range []float64{0, -1} {
		if r := newRail("a", nominal); r.nominal != defaultNominal || r.stats(time.Time{}).ewma != defaultNominal {
			t.Errorf("newRail(%g): nominal %g, ewma %g, want %g", nominal, r.nominal, r.stats(time.Time{}).ewma, defaultNominal)
		}
	}
}

func TestRailScore(t *testing.T) {
	r := newRail("a", 1e9)
	tests := []struct {
		inflight int64
		slice    int
		penalty  float64
		want     float64
	}{
		{0, 1e6, 1, 1e-3},
		{1e9, 0, 1, 1},
		{3e9, 1e9, 1, 4},
		{0, 1e6, 2.5, 2.5e-3}, // another topology
	}
	for _, tt := range tests {
		r.mu.inflight = tt.inflight
		if got := r.score(tt.slice, tt.penalty); math.Abs(got-tt.want) > 1e-12 {
			t.Errorf("inflight %d: score(%d, %g) = %g, want %g", tt.inflight, tt.slice, tt.penalty, got, tt.want)
		}
	}
}

// TestRailHealth drives the health state machine through a script of events on a fake clock.
func TestRailHealth(t *testing.T) {
	s := time.Second
	type step struct {
		at    time.Duration // since t0
		event string        // "fail", "ok", or "" to only check
		state string        // after the event
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"two errors do not pause", []step{
			{0, "fail", railUp}, {1 * s, "fail", railUp}, {2 * s, "", railUp},
		}},
		{"three within 10s pause for 30s", []step{
			{0, "fail", railUp}, {1 * s, "fail", railUp}, {9 * s, "fail", railPaused},
			{39*s - 1, "", railPaused}, {39 * s, "", railProbing},
		}},
		{"errors out of the window do not count", []step{
			{0, "fail", railUp}, {5 * s, "fail", railUp}, {10 * s, "fail", railUp}, // the first aged out
			{14 * s, "fail", railPaused}, // 5s, 10s, 14s
		}},
		{"a success clears the window", []step{
			{0, "fail", railUp}, {1 * s, "fail", railUp}, {2 * s, "ok", railUp},
			{3 * s, "fail", railUp}, {4 * s, "fail", railUp}, {5 * s, "fail", railPaused},
		}},
		{"errors while paused do not extend it", []step{
			{0, "fail", railUp}, {0, "fail", railUp}, {0, "fail", railPaused},
			{10 * s, "fail", railPaused}, {30 * s, "", railProbing},
		}},
		{"half-open: one error pauses again, doubled, up to 300s", []step{
			{0, "fail", railUp}, {0, "fail", railUp}, {0, "fail", railPaused}, // 30s
			{30 * s, "fail", railPaused}, {90*s - 1, "", railPaused}, {90 * s, "", railProbing}, // 60s
			{90 * s, "fail", railPaused}, {210 * s, "", railProbing}, // 120s
			{210 * s, "fail", railPaused}, {450 * s, "", railProbing}, // 240s
			{450 * s, "fail", railPaused}, {750*s - 1, "", railPaused}, {750 * s, "", railProbing}, // 300s
			{750 * s, "fail", railPaused}, {1050 * s, "", railProbing}, // still 300s
		}},
		{"half-open: a success restores, and the next pause is 30s again", []step{
			{0, "fail", railUp}, {0, "fail", railUp}, {0, "fail", railPaused},
			{30 * s, "fail", railPaused}, {90 * s, "ok", railUp}, // paused 60s, then recovered
			{91 * s, "fail", railUp}, {92 * s, "fail", railUp}, {93 * s, "fail", railPaused},
			{123 * s, "", railProbing},
		}},
		{"a success lifts a pause", []step{
			{0, "fail", railUp}, {0, "fail", railUp}, {0, "fail", railPaused},
			{1 * s, "ok", railUp},
		}},
	}
	t0 := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newRail("a", 1e9)
			for i, st := range tt.steps {
				now := t0.Add(st.at)
				switch st.event {
				case "fail":
					r.fail(now)
				case "ok":
					r.succeed(now)
				}
				if got := r.state(now); got != st.state {
					t.Fatalf("step %d (%v at %v): state %q, want %q", i, st.event, st.at, got, st.state)
				}
				if got, want := r.available(now), st.state != railPaused; got != want {
					t.Fatalf("step %d (%v at %v): available %v, want %v", i, st.event, st.at, got, want)
				}
			}
		})
	}
}

func TestRailFault(t *testing.T) {
	tests := []struct {
		err  error
		want bool
	}{
		{nil, false},
		{fmt.Errorf("%w: dial: refused", ErrUnavailable), true},
		{fmt.Errorf("%w: bad frame", ErrProtocol), true},
		{fmt.Errorf("unclassified"), true},
		{fmt.Errorf("%w: x", ErrSegmentNotFound), false},
		{fmt.Errorf("%w: x", ErrOutOfRange), false},
		{fmt.Errorf("%w: x", ErrRemote), false},
		{ErrClosed, false},
		{fmt.Errorf("%w: %w", ErrTimedOut, context.DeadlineExceeded), false},
		{context.Canceled, false},
	}
	for _, tt := range tests {
		if got := railFault(tt.err); got != tt.want {
			t.Errorf("railFault(%v) = %v, want %v", tt.err, got, tt.want)
		}
	}
}

// TestRailConcurrent exercises every method from several goroutines; run with -race.
func TestRailConcurrent(t *testing.T) {
	r := newRail("a", 1e9)
	t0 := time.Now()
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 500 {
				now := t0.Add(time.Duration(i) * time.Millisecond)
				r.add(1000)
				_ = r.score(1000, 1)
				_ = r.available(now)
				_ = r.state(now)
				r.observe(1000, time.Microsecond)
				if (i+g)%3 == 0 {
					r.fail(now)
				} else {
					r.succeed(now)
				}
				r.add(-1000)
			}
		})
	}
	wg.Wait()
	if st := r.stats(t0); st.inflight != 0 {
		t.Fatalf("inflight %d after balanced adds", st.inflight)
	}
}
