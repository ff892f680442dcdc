package statuspage

import (
	"context"
	"strings"
	"testing"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestReview18TierOrderStable shows that "Usage by tier" has no fixed
// order when a pool has both real and emulated HBM: both rank as
// pb.Tier_TIER_HBM, the rows come out of a map, and the sort leaves ties
// in map order, so the two rows swap places between reloads. Fixed:
// ties sort by name.
func TestReview18TierOrderStable(t *testing.T) {
	st := func(context.Context) (*pb.StatusResponse, error) {
		return &pb.StatusResponse{Segments: []*pb.SegmentInfo{
			{Name: "s1/hbm0@1", Node: "s1", Tier: pb.Tier_TIER_HBM, Capacity: 1 << 20, Alive: true},
			{Name: "s2/hbm0-emulated@1", Node: "s2", Tier: pb.Tier_TIER_HBM, Capacity: 1 << 20, Alive: true},
			{Name: "s1/dram0@1", Node: "s1", Tier: pb.Tier_TIER_DRAM, Capacity: 1 << 20, Alive: true},
			{Name: "s1/ssd0@1", Node: "s1", Tier: pb.Tier_TIER_SSD, Capacity: 1 << 20, Alive: true},
		}}, nil
	}
	p := &Page{Title: "master m1", Status: st}
	seen := map[bool]int{}
	for range 40 {
		body := render(t, p)
		h := strings.Index(body, `class="tier" data-tier="hbm" `)
		e := strings.Index(body, `class="tier" data-tier="hbm-emulated" `)
		if h < 0 || e < 0 {
			t.Fatal("a tier row is missing")
		}
		seen[h < e]++
	}
	if len(seen) > 1 {
		t.Errorf("hbm and hbm-emulated rows swap between renders: hbm first %d times, emulated first %d times", seen[true], seen[false])
	}
}
