package engine

import (
	"cmp"
	"slices"
	"sync"
	"time"
)

// sprayMode says how a sprayer chooses rails.
type sprayMode int

const (
	sprayScore      sprayMode = iota // lowest predicted finish time, probing round-robin now and then
	sprayRoundRobin                  // plain round-robin: the baseline to compare against
)

func (m sprayMode) String() string {
	switch m {
	case sprayScore:
		return "score"
	case sprayRoundRobin:
		return "round-robin"
	default:
		return "unknown"
	}
}

// probeEvery makes every probeEvery-th pick round-robin instead of by score, so rails the scores
// never choose still carry a slice now and then and keep their estimates fresh.
const probeEvery = 100

// sprayer chooses, for each slice of a request to one peer, which of the peer's rails carries it.
//
// It is safe for concurrent use. rails and mode are fixed at construction; mu guards the decision
// counter and the round-robin cursor, and is taken before any rail's lock, never after.
type sprayer struct {
	mode  sprayMode
	rails []*rail // the peer's rails, in a fixed order; plan's counts follow it

	mu struct {
		sync.Mutex
		decisions uint64 // picks made, to find every probeEvery-th
		next      int    // round-robin cursor into rails
	}
}

func newSprayer(mode sprayMode, rails []*rail) *sprayer {
	return &sprayer{mode: mode, rails: rails}
}

// pick chooses the rail for a slice of n bytes at now among the available rails that exclude (nil
// for none) does not reject, such as those a failed slice already tried: the lowest score(n, 1),
// the first in order on ties. Every probeEvery-th pick, and every pick in round-robin mode, goes
// round-robin instead. It returns nil when no rail qualifies. exclude runs under the sprayer's
// lock, so it must not call back into the sprayer.
//
// pick does not account for the slice; the caller calls begin, or uses take to do both at once so
// that concurrent picks see each other's slices.
func (s *sprayer) pick(n int, now time.Time, exclude func(*rail) bool) *rail {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pickLocked(n, now, exclude)
}

// take is pick followed by begin, atomically with respect to other picks.
func (s *sprayer) take(n int, now time.Time, exclude func(*rail) bool) *rail {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.pickLocked(n, now, exclude)
	if r != nil {
		s.begin(r, n)
	}
	return r
}

func (s *sprayer) pickLocked(n int, now time.Time, exclude func(*rail) bool) *rail {
	ok := func(r *rail) bool { return r.available(now) && (exclude == nil || !exclude(r)) }
	var best *rail
	bestScore := 0.0
	for _, r := range s.rails {
		if !ok(r) {
			continue
		}
		if sc := r.score(n, 1); best == nil || sc < bestScore {
			best, bestScore = r, sc
		}
	}
	if best == nil {
		return nil // no decision made: the probe schedule is unchanged
	}
	s.mu.decisions++
	if s.mode != sprayRoundRobin && s.mu.decisions%probeEvery != 0 {
		return best
	}
	for i := range s.rails {
		j := (s.mu.next + i) % len(s.rails)
		if ok(s.rails[j]) {
			s.mu.next = j + 1
			return s.rails[j]
		}
	}
	return best // unreachable: best qualified above
}

// begin accounts n bytes in flight on r: call it when a slice is dispatched to r.
func (s *sprayer) begin(r *rail, n int) { r.add(int64(n)) }

// end settles a slice of n bytes that r carried: it leaves the in-flight count and, on success,
// feeds service (measured from dispatch) to the bandwidth estimate and restores the rail's health.
// An error counts against the rail only if railFault says it is the rail's fault.
func (s *sprayer) end(r *rail, n int, service time.Duration, err error, now time.Time) {
	r.add(-int64(n))
	switch {
	case err == nil:
		r.observe(n, service)
		r.succeed(now)
	case railFault(err):
		r.fail(now)
	}
}

// plan splits a request's slices across the available rails in proportion to 1/score (predicted
// finish time of an average slice), so a rail predicted 4x faster carries about 4x the slices.
// It returns one count per s.rails entry, in that order, summing to len(spans); counts are
// rounded by largest remainder (ties to the earlier rail). In round-robin mode the split is
// equal. plan returns nil when no rail is available.
func (s *sprayer) plan(spans []span, now time.Time) []int {
	avg := 0
	if len(spans) > 0 {
		total := 0
		for _, sp := range spans {
			total += sp.n
		}
		avg = total / len(spans)
	}
	weights := make([]float64, len(s.rails))
	sum := 0.0
	for i, r := range s.rails {
		if !r.available(now) {
			continue
		}
		w := 1.0
		if s.mode != sprayRoundRobin {
			// An idle rail asked about an empty slice scores 0; give it the weight of a 1-byte
			// slice instead of dividing by zero.
			w = 1 / r.score(max(avg, 1), 1)
		}
		weights[i] = w
		sum += w
	}
	if sum == 0 {
		return nil
	}
	counts := make([]int, len(s.rails))
	type rem struct {
		i    int
		frac float64
	}
	rems := make([]rem, 0, len(s.rails))
	given := 0
	for i, w := range weights {
		if w == 0 {
			continue
		}
		q := float64(len(spans)) * w / sum
		counts[i] = int(q)
		given += counts[i]
		rems = append(rems, rem{i, q - float64(counts[i])})
	}
	slices.SortStableFunc(rems, func(a, b rem) int { return cmp.Compare(b.frac, a.frac) })
	for k := 0; given < len(spans); k++ {
		counts[rems[k%len(rems)].i]++
		given++
	}
	return counts
}
