package master

import (
	"math/rand/v2"
	"testing"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestFSMReplicasOnDistinctNodes: a put asking for N replicas gets at most
// one per node, best effort.
func TestFSMReplicasOnDistinctNodes(t *testing.T) {
	tests := []struct {
		name  string
		want  uint32
		nodes []string // the node of each candidate segment, in order
		got   int
	}{
		{"one by default", 0, []string{"a", "b"}, 1},
		{"two on two nodes", 2, []string{"a", "b", "c"}, 2},
		{"two segments of one node count once", 2, []string{"a", "a"}, 1},
		{"more than there are nodes", 5, []string{"a", "b", "a"}, 2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := newDriver(t)
			var cands []string
			for i, n := range tc.nodes {
				spec := &pb.SegmentSpec{Name: string(rune('p' + i)), Tier: pb.Tier_TIER_DRAM, Capacity: 1 << 20}
				res := d.register(1, n, n+":1", spec)
				cands = append(cands, res.SegmentIDs[len(res.SegmentIDs)-1])
			}
			out := d.apply(2, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{{
				Key: "k", Size: 100, Candidates: cands, DeadlineUnixNano: 100, Replicas: tc.want,
			}}}}})
			r := out.([]PutStartResult)[0]
			if r.Err != nil || len(r.Replicas) != tc.got {
				t.Fatalf("put start = %+v, want %d replicas", r, tc.got)
			}
			seen := map[string]bool{}
			d.f.mu.RLock()
			for _, e := range r.Replicas {
				n := d.f.segments[e.Segment].node
				if seen[n] {
					t.Errorf("two replicas on node %s", n)
				}
				seen[n] = true
			}
			d.f.mu.RUnlock()
		})
	}
}

func TestOnHost(t *testing.T) {
	for _, tc := range []struct {
		endpoint, host string
		want           bool
	}{
		{"10.0.0.1:7000", "10.0.0.1", true},
		{"10.0.0.2:7000,10.0.0.1:7001", "10.0.0.1", true},
		{"10.0.0.2:7000", "10.0.0.1", false},
		{"[::1]:7000", "::1", true},
		{"garbage", "10.0.0.1", false},
	} {
		if got := onHost(tc.endpoint, tc.host); got != tc.want {
			t.Errorf("onHost(%q, %q) = %v, want %v", tc.endpoint, tc.host, got, tc.want)
		}
	}
}

func TestPlacementStrategies(t *testing.T) {
	specs := map[string][]*pb.SegmentSpec{"a": {dram("m", 1<<20)}, "b": {dram("m", 1<<20)}, "c": {dram("m", 1<<20)}}
	fill := map[string]uint64{"a/m@1": 512 << 10, "b/m@1": 256 << 10}

	// Endpoints are "node:1", so host "a" is node a's host.
	s := placementServer(t, specs, fill)
	s.cfg.Placement = LocalFirst
	if got := s.candidates(1, pb.Tier_TIER_DRAM, "a"); got[0] != "a/m@1" {
		t.Fatalf("local first from host a: %v", got)
	}
	s.cfg.Placement = FreeRatioFirst
	if got := s.candidates(1, pb.Tier_TIER_DRAM, "a"); got[0] != "c/m@1" {
		t.Fatalf("free ratio first: %v", got)
	}

	s.cfg.Placement = RandomOfTwo
	s.rng = rand.New(rand.NewPCG(1, 2))
	firsts := map[string]int{}
	for range 300 {
		got := s.candidates(1, pb.Tier_TIER_DRAM, "")
		if len(got) != 3 {
			t.Fatalf("random of two dropped segments: %v", got)
		}
		firsts[got[0]]++
	}
	// The fullest segment can never win a pair; the others both do.
	if firsts["a/m@1"] != 0 || firsts["b/m@1"] == 0 || firsts["c/m@1"] == 0 {
		t.Fatalf("first choices %v", firsts)
	}
}

// TestReplicasFastestFirst: readers get DRAM replicas before HBM and SSD.
func TestReplicasFastestFirst(t *testing.T) {
	d := newDriver(t)
	segSSD := d.register(1, "a", "a:1", ssd("s", 1<<20)).SegmentIDs[0]
	segHBM := d.register(1, "b", "b:1", &pb.SegmentSpec{Name: "h", Tier: pb.Tier_TIER_HBM, Capacity: 1 << 20}).SegmentIDs[0]
	segDRAM := d.register(1, "c", "c:1", dram("d", 1<<20)).SegmentIDs[0]
	out := d.apply(2, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{{
		Key: "k", Size: 10, Candidates: []string{segSSD, segHBM, segDRAM}, DeadlineUnixNano: 100, Replicas: 3,
	}}}}})
	if r := out.([]PutStartResult)[0]; r.Err != nil || len(r.Replicas) != 3 {
		t.Fatalf("put start: %+v", r)
	}
	if err := d.putEnd(3, "k"); err != nil {
		t.Fatal(err)
	}
	var tiers []pb.Tier
	for _, r := range d.f.replicasOf([]string{"k"})[0].Replicas {
		tiers = append(tiers, r.Tier)
	}
	want := []pb.Tier{pb.Tier_TIER_DRAM, pb.Tier_TIER_HBM, pb.Tier_TIER_SSD}
	if len(tiers) != 3 || tiers[0] != want[0] || tiers[1] != want[1] || tiers[2] != want[2] {
		t.Fatalf("replica tiers %v, want %v", tiers, want)
	}
}

// TestFSMDropReplica: a replica reported corrupt goes, only for the version
// the reader checked; the last one takes the object with it.
func TestFSMDropReplica(t *testing.T) {
	d := newDriver(t)
	a := d.register(1, "a", "a:1", dram("m", 1<<20)).SegmentIDs[0]
	b := d.register(1, "b", "b:1", dram("m", 1<<20)).SegmentIDs[0]
	out := d.apply(2, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{{
		Key: "k", Size: 10, Checksum: 10, Candidates: []string{a, b}, DeadlineUnixNano: 100, Replicas: 2,
	}}}}})
	if r := out.([]PutStartResult)[0]; r.Err != nil || len(r.Replicas) != 2 {
		t.Fatalf("put start: %+v", r)
	}
	if err := d.putEnd(3, "k"); err != nil {
		t.Fatal(err)
	}
	drop := func(now int64, seg string, sum uint32) bool {
		return d.apply(now, &pb.Command{Op: &pb.Command_DropReplica{DropReplica: &pb.DropReplicaCmd{Key: "k", Segment: seg, Checksum: sum}}}).(bool)
	}
	if drop(4, a, 99) {
		t.Fatal("a report about another version dropped a replica")
	}
	if drop(4, "nosuch", 10) {
		t.Fatal("a report about an unknown segment dropped a replica")
	}
	if !drop(5, a, 10) || len(d.f.replicasOf([]string{"k"})[0].Replicas) != 1 {
		t.Fatal("the corrupt replica was not dropped")
	}
	if v := d.segment(a); v.used != 0 || v.objects != 0 {
		t.Fatalf("segment a after the drop: %+v", v)
	}
	if !drop(6, b, 10) || d.f.exists([]string{"k"})[0] {
		t.Fatal("dropping the last replica must forget the object")
	}
}
