package master

import (
	"slices"
	"testing"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// placementServer is a Server with just what candidates reads: an FSM and
// the leader's heartbeat table.
func placementServer(t *testing.T, specs map[string][]*pb.SegmentSpec, fill map[string]uint64, dead ...string) *Server {
	t.Helper()
	d := newDriver(t)
	s := &Server{fsm: d.f}
	s.mu.lastSeen = map[string]time.Time{}
	for _, node := range sortedKeys(specs) {
		res := d.register(t0, node, node+":1", specs[node]...)
		if !slices.Contains(dead, node) {
			s.mu.lastSeen[node] = time.Unix(0, t0)
		}
		for _, id := range res.SegmentIDs {
			if n := fill[id]; n > 0 {
				d.put(t0, "fill-"+id, n, id)
			}
		}
	}
	return s
}

func TestCandidates(t *testing.T) {
	const gib = 1 << 30
	tests := []struct {
		name  string
		specs map[string][]*pb.SegmentSpec
		fill  map[string]uint64 // bytes used per segment id
		dead  []string
		size  uint64
		tier  pb.Tier
		want  []string
	}{
		{
			name:  "most free ratio first",
			specs: map[string][]*pb.SegmentSpec{"a": {dram("m", 1<<20)}, "b": {dram("m", 4<<20)}, "c": {dram("m", 2<<20)}},
			fill:  map[string]uint64{"a/m@1": 512 << 10, "b/m@1": 1 << 20, "c/m@1": 1 << 10},
			size:  1, tier: pb.Tier_TIER_DRAM,
			want: []string{"c/m@1", "b/m@1", "a/m@1"},
		},
		{
			name:  "preferred tier first",
			specs: map[string][]*pb.SegmentSpec{"a": {dram("d", 1<<20), ssd("s", 1<<20)}},
			fill:  map[string]uint64{"a/d@1": 1 << 19},
			size:  1, tier: pb.Tier_TIER_DRAM,
			want: []string{"a/d@1", "a/s@1"},
		},
		{
			// A full segment stays a candidate, last: Apply may first free
			// space whose leases have ended.
			name:  "dead nodes are left out, full segments go last",
			specs: map[string][]*pb.SegmentSpec{"a": {dram("m", 1<<20)}, "b": {dram("m", 1<<20)}, "c": {dram("m", 1<<20)}, "d": {dram("m", 4096)}},
			fill:  map[string]uint64{"b/m@1": 1<<20 - 4096},
			dead:  []string{"c"},
			size:  8192, tier: pb.Tier_TIER_DRAM,
			want: []string{"a/m@1", "b/m@1"},
		},
		{
			// Free bytes times capacity no longer fits in 64 bits.
			name:  "large segments",
			specs: map[string][]*pb.SegmentSpec{"a": {dram("m", 512*gib)}, "b": {dram("m", 512*gib)}},
			fill:  map[string]uint64{"a/m@1": 390 * gib, "b/m@1": 20 * gib},
			size:  1, tier: pb.Tier_TIER_DRAM,
			want: []string{"b/m@1", "a/m@1"},
		},
		{
			// Under 1 KiB of capacity the ratio must not collapse to 0 == 0.
			name:  "small segments",
			specs: map[string][]*pb.SegmentSpec{"a": {dram("m", 960)}, "b": {dram("m", 960)}},
			fill:  map[string]uint64{"a/m@1": 640},
			size:  1, tier: pb.Tier_TIER_DRAM,
			want: []string{"b/m@1", "a/m@1"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := placementServer(t, tc.specs, tc.fill, tc.dead...)
			if got := s.candidates(tc.size, tc.tier, ""); !slices.Equal(got, tc.want) {
				t.Fatalf("candidates = %v, want %v", got, tc.want)
			}
		})
	}
}
