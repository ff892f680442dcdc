package master

import (
	"math"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestFSMScore: a score counts the leading complete blocks, the leading
// blocks per tier, and sums each block's best weight.
func TestFSMScore(t *testing.T) {
	d := newDriver(t)
	reg := d.register(1, "n1", "e1", dram("d", 1<<20), ssd("s", 1<<20))
	dramSeg, ssdSeg := reg.SegmentIDs[0], reg.SegmentIDs[1]
	for _, k := range []string{"a", "b", "c"} {
		d.put(2, k, 4096, dramSeg)
	}
	d.put(2, "s", 4096, ssdSeg)
	// b gains an SSD replica and loses its DRAM one: a demotion.
	c := d.startCopy(3, "b", dramSeg, demote, 1e12, ssdSeg)
	if r := d.copyEnd(4, 0, &pb.CopyEndItem{Key: "b", CopyId: c.Id})[0]; r.Err != nil || !r.Done {
		t.Fatalf("copy end: %+v", r)
	}
	if err := d.putStart(5, "p", 4096, 1e12, dramSeg).Err; err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		keys            []string
		matched         uint32
		dramRun, ssdRun uint32
		score           float64
	}{
		{[]string{"a", "b", "c"}, 3, 1, 0, 0.8 + 0.5 + 0.8},
		{[]string{"b", "c"}, 2, 0, 1, 0.5 + 0.8},
		{[]string{"s", "b", "a"}, 3, 0, 2, 0.5 + 0.5 + 0.8},
		{[]string{"a", "p", "c"}, 1, 1, 0, 0.8}, // p's put has not ended
		{[]string{"x", "a"}, 0, 0, 0, 0},
		{nil, 0, 0, 0, 0},
	} {
		got := d.f.score(tc.keys, defaultWeights)
		var runs []uint32
		for _, tb := range got.Tiers {
			runs = append(runs, tb.Blocks)
		}
		if got.Matched != tc.matched || len(got.Tiers) != 2 || got.Tiers[0].Tier != pb.Tier_TIER_DRAM ||
			runs[0] != tc.dramRun || runs[1] != tc.ssdRun || got.Score < tc.score-1e-9 || got.Score > tc.score+1e-9 {
			t.Errorf("score %v: %v, want %d matched, dram %d, ssd %d, score %g", tc.keys, got, tc.matched, tc.dramRun, tc.ssdRun, tc.score)
		}
	}
}

// TestScoreLeasesNothing: a Score over gRPC answers as a Lookup matches,
// but leaves no lease and no use on the blocks; bad requests are
// InvalidArgument.
func TestScoreLeasesNothing(t *testing.T) {
	e := newEvictEnv(t, nil)
	m := e.m
	for _, k := range []string{"a", "b"} {
		putObject(t, m, k, 4096)
	}
	obj := func(k string) *object {
		m.srv.fsm.mu.RLock()
		defer m.srv.fsm.mu.RUnlock()
		return m.srv.fsm.objects.get(k)
	}
	usedBefore := obj("a").used.Load()
	chain := &pb.LookupRequest{Keys: []string{"a", "b", "c"}}
	s, err := m.master().Score(rpcCtx(t), &pb.ScoreRequest{Chain: chain, Weights: []*pb.TierWeight{{Tier: pb.Tier_TIER_DRAM, Weight: 2}}})
	if err != nil || s.Matched != 2 || s.Score != 4 {
		t.Fatalf("score = %v, %v; want 2 matched, score 4", s, err)
	}
	for _, k := range []string{"a", "b"} {
		if o := obj(k); o.lease.Load() != 0 || o.used.Load() != usedBefore && k == "a" {
			t.Errorf("%s after a score: lease %d, used %d (was %d)", k, o.lease.Load(), o.used.Load(), usedBefore)
		}
	}
	l, err := m.master().Lookup(rpcCtx(t), chain)
	if err != nil || l.Matched != s.Matched || obj("a").lease.Load() == 0 {
		t.Fatalf("lookup = %v, %v: want %d matched and a lease", l, err, s.Matched)
	}
	for _, req := range []*pb.ScoreRequest{
		{},
		{Chain: &pb.LookupRequest{}},
		{Chain: chain, Weights: []*pb.TierWeight{{Tier: pb.Tier_TIER_UNSPECIFIED, Weight: 1}}},
		{Chain: chain, Weights: []*pb.TierWeight{{Tier: pb.Tier_TIER_SSD, Weight: -1}}},
		{Chain: chain, Weights: []*pb.TierWeight{{Tier: pb.Tier_TIER_SSD, Weight: math.NaN()}}},
	} {
		if _, err := m.master().Score(rpcCtx(t), req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("score %v: %v, want InvalidArgument", req, err)
		}
	}
}
