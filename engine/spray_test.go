package engine

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"
)

var sprayT0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// testRails returns rails a, b, c, ... with the given nominal speeds in GB/s.
func testRails(gbps ...float64) []*rail {
	rails := make([]*rail, len(gbps))
	for i, g := range gbps {
		rails[i] = newRail(string(rune('a'+i)), g*1e9)
	}
	return rails
}

func pauseRail(r *rail, now time.Time) {
	for range railErrLimit {
		r.fail(now)
	}
}

func TestPickSequence(t *testing.T) {
	// 1 GB slices over rails of 4, 2, 1 and 1 GB/s: each goes to the lowest predicted finish
	// (inflight + slice) / ewma, ties to the earlier rail. a takes slices until its backlog makes
	// b (then c and d) finish sooner.
	s := newSprayer(sprayScore, testRails(4, 2, 1, 1))
	var got string
	for range 12 {
		got += s.take(1e9, sprayT0, nil).addr
	}
	// finish times after each: a .25 .5 | b .5 | a .75 1 | b 1 | c 1 | d 1 | a 1.25 1.5 | b 1.5 | a 1.75
	if want := "aabaabcdaaba"; got != want {
		t.Fatalf("picks %q, want %q", got, want)
	}
	// Now all four finish at 2 s; pick alone accounts nothing, so it answers a (the tie) until
	// begin.
	for range 3 {
		if r := s.pick(1e9, sprayT0, nil); r.addr != "a" {
			t.Fatalf("pick = %s, want a", r.addr)
		}
	}
	s.begin(s.pick(1e9, sprayT0, nil), 1e9)
	if r := s.pick(1e9, sprayT0, nil); r.addr != "b" {
		t.Fatalf("pick after begin = %s, want b", r.addr)
	}
}

func TestPickProbesEvery100th(t *testing.T) {
	// a is slow and idle, so scores never choose it; every 100th decision is round-robin over
	// a, b, c in turn.
	s := newSprayer(sprayScore, testRails(1, 4, 2))
	var probes []string
	for i := 1; i <= 400; i++ {
		r := s.pick(1e6, sprayT0, nil)
		if i%probeEvery == 0 {
			probes = append(probes, r.addr)
		} else if r.addr != "b" {
			t.Fatalf("decision %d picked %s, want b", i, r.addr)
		}
	}
	if want := []string{"a", "b", "c", "a"}; !slices.Equal(probes, want) {
		t.Fatalf("probes %v, want %v", probes, want)
	}
}

func TestPickSkipsPausedAndExcluded(t *testing.T) {
	rails := testRails(4, 2, 1)
	s := newSprayer(sprayScore, rails)
	pauseRail(rails[0], sprayT0)
	notB := func(r *rail) bool { return r.addr == "b" }
	for i := range 1000 { // probes included
		if r := s.pick(1e6, sprayT0, nil); r == rails[0] {
			t.Fatalf("decision %d picked paused rail a", i)
		}
		if r := s.pick(1e6, sprayT0, notB); r != rails[2] {
			t.Fatalf("decision %d with b excluded picked %v, want c", i, r.addr)
		}
	}
	if r := s.pick(1e6, sprayT0, func(r *rail) bool { return r != rails[0] }); r != nil {
		t.Fatalf("only the paused rail left: picked %s, want nil", r.addr)
	}
	// After the cooldown a is available again (probing) and, fastest, chosen.
	if r := s.pick(1e6, sprayT0.Add(railPauseMin), nil); r != rails[0] {
		t.Fatalf("after cooldown picked %v, want a", r.addr)
	}
}

func TestPickNoRails(t *testing.T) {
	rails := testRails(1, 1)
	s := newSprayer(sprayScore, rails)
	for _, r := range rails {
		pauseRail(r, sprayT0)
	}
	if r := s.pick(1, sprayT0, nil); r != nil {
		t.Fatalf("all paused: picked %s", r.addr)
	}
	if r := s.take(1, sprayT0, nil); r != nil {
		t.Fatalf("all paused: took %s", r.addr)
	}
	if r := newSprayer(sprayScore, nil).pick(1, sprayT0, nil); r != nil {
		t.Fatalf("no rails: picked %s", r.addr)
	}
}

func TestPickRoundRobinMode(t *testing.T) {
	rails := testRails(4, 2, 1, 1)
	s := newSprayer(sprayRoundRobin, rails)
	pauseRail(rails[2], sprayT0)
	var got string
	for range 7 {
		got += s.take(1e6, sprayT0, nil).addr
	}
	if want := "abdabda"; got != want {
		t.Fatalf("round-robin picks %q, want %q", got, want)
	}
}

func TestSprayBeginEnd(t *testing.T) {
	now := sprayT0
	tests := []struct {
		name      string
		err       error
		wantEWMA  bool // the sample was observed
		wantState string
		wantErrs  int64
	}{
		{"success observes", nil, true, railUp, 0},
		{"rail fault counts", fmt.Errorf("%w: reset", ErrUnavailable), false, railPaused, railErrLimit},
		{"peer answer is neutral", fmt.Errorf("%w: x", ErrSegmentNotFound), false, railUp, 0},
		{"timeout is neutral", ErrTimedOut, false, railUp, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newRail("a", 1e9)
			s := newSprayer(sprayScore, []*rail{r})
			for range railErrLimit {
				s.begin(r, 1e6)
			}
			if got := r.stats(now).inflight; got != railErrLimit*1e6 {
				t.Fatalf("inflight %d after begin", got)
			}
			for range railErrLimit {
				s.end(r, 1e6, 100*time.Microsecond, tt.err, now) // 10 GB/s observed
			}
			st := r.stats(now)
			if st.inflight != 0 || st.state != tt.wantState || st.errors != tt.wantErrs {
				t.Fatalf("after end: %+v, want inflight 0, state %s, errors %d", st, tt.wantState, tt.wantErrs)
			}
			if moved := st.ewma != 1e9; moved != tt.wantEWMA {
				t.Fatalf("ewma %g: observed %v, want %v", st.ewma, moved, tt.wantEWMA)
			}
		})
	}
}

func TestPlan(t *testing.T) {
	spans := func(k int) []span {
		out := make([]span, k)
		for i := range out {
			out[i] = span{i * sliceBase, sliceBase}
		}
		return out
	}
	tests := []struct {
		name   string
		mode   sprayMode
		gbps   []float64
		paused []int   // rail indexes
		busy   []int64 // bytes in flight per rail
		slices int
		want   []int
	}{
		{"proportional 4:2:1:1", sprayScore, []float64{4, 2, 1, 1}, nil, nil, 64, []int{32, 16, 8, 8}},
		{"largest remainder", sprayScore, []float64{4, 2, 1, 1}, nil, nil, 10, []int{5, 3, 1, 1}}, // 5, 2.5, 1.25, 1.25
		{"equal rails, ties to the earlier", sprayScore, []float64{1, 1, 1}, nil, nil, 64, []int{22, 21, 21}},
		{"one slice", sprayScore, []float64{1, 4, 2}, nil, nil, 1, []int{0, 1, 0}},
		{"paused rail carries none", sprayScore, []float64{4, 2, 1, 1}, []int{0}, nil, 64, []int{0, 32, 16, 16}},
		// b's backlog of 64 slices makes its weight 2/65 instead of 2: quotas 33.24, 0.51, 16.62,
		// 16.62.
		{"backlog counts", sprayScore, []float64{2, 2, 1, 1}, nil, []int64{0, 64 * sliceBase, 0, 0}, 67,
			[]int{33, 0, 17, 17}},
		{"round-robin: equal", sprayRoundRobin, []float64{4, 2, 1, 1}, nil, nil, 64, []int{16, 16, 16, 16}},
		{"round-robin: paused skipped", sprayRoundRobin, []float64{4, 2, 1, 1}, []int{1}, nil, 64, []int{22, 0, 21, 21}},
		{"all paused", sprayScore, []float64{4, 2}, []int{0, 1}, nil, 64, nil},
		{"no rails", sprayScore, nil, nil, nil, 64, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rails := testRails(tt.gbps...)
			for _, i := range tt.paused {
				pauseRail(rails[i], sprayT0)
			}
			for i, b := range tt.busy {
				rails[i].add(b)
			}
			if got := newSprayer(tt.mode, rails).plan(spans(tt.slices), sprayT0); !slices.Equal(got, tt.want) {
				t.Fatalf("plan = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestPlanSums(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for range 500 {
		rails := make([]*rail, 1+r.IntN(8))
		for i := range rails {
			rails[i] = newRail("r", 1e8+r.Float64()*1e11)
			rails[i].add(r.Int64N(1 << 30))
		}
		n := r.IntN(1 << 30)
		sl := cutSlices(n)
		for _, mode := range []sprayMode{sprayScore, sprayRoundRobin} {
			counts := newSprayer(mode, rails).plan(sl, sprayT0)
			sum := 0
			for _, c := range counts {
				if c < 0 {
					t.Fatalf("negative count in %v", counts)
				}
				sum += c
			}
			if len(counts) != len(rails) || sum != len(sl) {
				t.Fatalf("%v plan over %d rails for %d slices: %v", mode, len(rails), len(sl), counts)
			}
		}
	}
	// An empty request still gets a plan of zeros.
	if got := newSprayer(sprayScore, testRails(1, 2)).plan(nil, sprayT0); !slices.Equal(got, []int{0, 0}) {
		t.Fatalf("plan(nil) = %v, want [0 0]", got)
	}
}

// TestSprayConcurrent runs take/end/plan from several goroutines; run with -race.
func TestSprayConcurrent(t *testing.T) {
	rails := testRails(4, 2, 1, 1)
	s := newSprayer(sprayScore, rails)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 1000 {
				now := sprayT0.Add(time.Duration(i) * time.Millisecond)
				r := s.take(sliceBase, now, nil)
				if r == nil {
					continue
				}
				var err error
				if (i+g)%50 == 0 {
					err = ErrUnavailable
				}
				_ = s.plan(cutSlices(1<<20), now)
				s.end(r, sliceBase, 50*time.Microsecond, err, now)
			}
		})
	}
	wg.Wait()
	for _, r := range rails {
		if st := r.stats(sprayT0); st.inflight != 0 {
			t.Fatalf("rail %s: inflight %d after balanced take/end", st.addr, st.inflight)
		}
	}
}
