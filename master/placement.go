package master

import (
	"cmp"
	"math/bits"
	"slices"
	"strings"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// candidates orders the live segments for an object of size bytes: the
// preferred tier first, then most free space first (free-ratio-first), so
// load spreads over the pool. Apply allocates in the first one with room.
func (s *Server) candidates(size uint64, tier pb.Tier) []string {
	views := s.fsm.segmentViews()
	// Segments that look full stay in: Apply first releases space whose
	// leases have ended, which this view does not see yet.
	views = slices.DeleteFunc(views, func(v segmentView) bool { return !s.alive(v.node) || v.capacity < size })
	slices.SortStableFunc(views, func(a, b segmentView) int {
		if (a.tier == tier) != (b.tier == tier) {
			if a.tier == tier {
				return -1
			}
			return 1
		}
		// Compare free ratios (cap-used)/cap exactly, by cross-multiplying
		// in 128 bits: 64-bit products overflow for segments of 128 GiB.
		ha, la := bits.Mul64(a.capacity-a.used, b.capacity)
		hb, lb := bits.Mul64(b.capacity-b.used, a.capacity)
		return cmp.Or(cmp.Compare(hb, ha), cmp.Compare(lb, la))
	})
	ids := make([]string, len(views))
	for i, v := range views {
		ids[i] = v.id
	}
	return ids
}

// tierName is the short lower-case name of a tier, as in flags and metrics.
func tierName(t pb.Tier) string {
	return strings.ToLower(strings.TrimPrefix(t.String(), "TIER_"))
}
