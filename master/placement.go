package master

import (
	"cmp"
	"math/bits"
	"net"
	"slices"
	"strings"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Placement strategies: how the leader orders candidate segments within the
// preferred tier. Apply allocates in the first ones with room (one replica
// per node), so the order is the placement.
const (
	// FreeRatioFirst spreads load: the segment with the largest free
	// fraction first.
	FreeRatioFirst = "free-ratio"
	// RandomOfTwo samples two segments at random and takes the freer one
	// first ("power of two choices"): nearly as even, and it does not send
	// every concurrent put to the same emptiest segment.
	RandomOfTwo = "random"
	// LocalFirst prefers segments on the putting client's host, so a
	// co-located engine reads through shared memory.
	LocalFirst = "local"
)

// candidates orders the live segments for an object of size bytes: the
// preferred tier first, then by the placement strategy. clientHost is the
// putting client's address, for LocalFirst.
func (s *Server) candidates(size uint64, tier pb.Tier, clientHost string) []string {
	tier = orDRAM(tier)
	views := s.fsm.segmentViews()
	// Segments that look full stay in: Apply first releases space whose
	// leases have ended, which this view does not see yet.
	views = slices.DeleteFunc(views, func(v segmentView) bool { return !s.alive(v.node) || v.closed() || v.capacity < size })
	local := func(v segmentView) bool { return clientHost != "" && onHost(v.endpoint, clientHost) }
	slices.SortStableFunc(views, func(a, b segmentView) int {
		if (a.tier == tier) != (b.tier == tier) {
			if a.tier == tier {
				return -1
			}
			return 1
		}
		if s.cfg.Placement == LocalFirst && local(a) != local(b) {
			if local(a) {
				return -1
			}
			return 1
		}
		return freerFirst(a, b)
	})
	if s.cfg.Placement == RandomOfTwo {
		s.sampleTwo(views, tier)
	}
	// Nodes a client could not reach go last: used only where too few
	// others have room for a put's replicas or a copy. One client's report
	// must neither close the pool nor cut replica counts.
	if avoided := s.avoided(); len(avoided) > 0 {
		slices.SortStableFunc(views, func(a, b segmentView) int { return cmp.Compare(btoi(avoided[a.node]), btoi(avoided[b.node])) })
	}
	ids := make([]string, len(views))
	for i, v := range views {
		ids[i] = v.id
	}
	return ids
}

// candidatesBeside is candidates for one more replica of an object on
// segments: none on a node that holds one already, so the copy adds a
// node. nodeOf maps segment ids to nodes.
func (s *Server) candidatesBeside(size uint64, tier pb.Tier, segments []string, nodeOf map[string]string) []string {
	return slices.DeleteFunc(s.candidates(size, tier, ""), func(id string) bool {
		return slices.ContainsFunc(segments, func(held string) bool { return nodeOf[held] == nodeOf[id] })
	})
}

// freerFirst compares free ratios (cap-used)/cap exactly, by
// cross-multiplying in 128 bits: 64-bit products overflow for segments of
// 128 GiB.
func freerFirst(a, b segmentView) int {
	ha, la := bits.Mul64(a.capacity-a.used, b.capacity)
	hb, lb := bits.Mul64(b.capacity-b.used, a.capacity)
	return cmp.Or(cmp.Compare(hb, ha), cmp.Compare(lb, la))
}

// sampleTwo moves two random segments of the preferred tier to the front,
// the freer one first; views is sorted with that tier first.
func (s *Server) sampleTwo(views []segmentView, tier pb.Tier) {
	n := 0
	for n < len(views) && views[n].tier == tier {
		n++
	}
	if n < 3 {
		return
	}
	s.rngMu.Lock()
	i, j := s.rng.IntN(n), s.rng.IntN(n-1)
	s.rngMu.Unlock()
	if j >= i {
		j++
	}
	a, b := views[i], views[j]
	if freerFirst(b, a) < 0 {
		a, b = b, a
	}
	rest := slices.DeleteFunc(slices.Clone(views[:n]), func(v segmentView) bool { return v.id == a.id || v.id == b.id })
	copy(views, append([]segmentView{a, b}, rest...))
}

// onHost reports whether any rail of endpoint is on host.
func onHost(endpoint, host string) bool {
	for _, rail := range strings.Split(endpoint, ",") {
		if h, _, err := net.SplitHostPort(rail); err == nil && h == host {
			return true
		}
	}
	return false
}

// orDRAM is a put's preferred tier: DRAM unless it names one.
func orDRAM(t pb.Tier) pb.Tier {
	if t == pb.Tier_TIER_UNSPECIFIED {
		return pb.Tier_TIER_DRAM
	}
	return t
}
