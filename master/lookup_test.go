package master

import (
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// chainPut puts keys as one chain (each the parent of the next) with one
// BatchPutStart, so they share one recency.
func chainPut(t *testing.T, m *member, size uint64, opts *pb.PutStartRequest, keys ...string) {
	t.Helper()
	reqs := sized(size, opts, keys...)
	for i := range reqs {
		if i > 0 {
			reqs[i].Parent = keys[i-1]
		}
	}
	putBatch(t, m, reqs...)
}

func lookup(t *testing.T, m *member, req *pb.LookupRequest) *pb.LookupResponse {
	t.Helper()
	resp, err := m.master().Lookup(rpcCtx(t), req)
	if err != nil {
		t.Fatalf("lookup %v: %v", req.Keys, err)
	}
	return resp
}

// TestLookup: the matched prefix is exact, described column by column with
// the fastest replica first, and leased; count_only matches without a
// lease; bad requests are refused.
func TestLookup(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, noWriteBack)
	m := e.m
	startFakeStore(t, m, "s", reportOK, dram("a", segCap), ssd("b", 8*segCap))
	startFakeStore(t, m, "t", reportOK, dram("a", segCap))
	chain := keyNames("c", 6)
	chainPut(t, m, 4*kib, &pb.PutStartRequest{Replicas: 2}, chain[:4]...)
	chainPut(t, m, 4*kib, &pb.PutStartRequest{Tier: pb.Tier_TIER_SSD}, chain[5])

	for _, tc := range []struct {
		name string
		keys []string
		want int
	}{
		{"the whole cached prefix", chain[:4], 4},
		{"a longer chain stops at the first miss", chain, 4},
		{"a chain whose first block is missing", chain[4:], 0},
		{"a later block present after a gap does not count", []string{chain[0], "nope", chain[2]}, 1},
		{"one block", chain[:1], 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			packed := &pb.LookupRequest{}
			packed.PackKeys(tc.keys)
			if r := lookup(t, m, packed); int(r.Matched) != tc.want {
				t.Fatalf("packed keys matched %d, want %d", r.Matched, tc.want)
			}
			resp := lookup(t, m, &pb.LookupRequest{Keys: tc.keys})
			if int(resp.Matched) != tc.want || len(resp.Sizes) != tc.want || len(resp.ReplicaCounts) != tc.want {
				t.Fatalf("matched %d (sizes %d, counts %d), want %d", resp.Matched, len(resp.Sizes), len(resp.ReplicaCounts), tc.want)
			}
			at := 0
			for i, n := range resp.ReplicaCounts {
				if n != 2 || resp.Sizes[i] != 4*kib {
					t.Fatalf("block %d: %d replicas, %d bytes; want 2 of %d", i, n, resp.Sizes[i], 4*kib)
				}
				nodes := []string{resp.Segments[resp.ReplicaSegments[at]].Node, resp.Segments[resp.ReplicaSegments[at+1]].Node}
				if slices.Sort(nodes); !slices.Equal(nodes, []string{"s", "t"}) {
					t.Fatalf("block %d on nodes %v, want s and t", i, nodes)
				}
				at += int(n)
			}
			if resp.LeaseTtlMs != uint64(m.srv.cfg.LeaseTTL.Milliseconds()) {
				t.Fatalf("lease %d ms", resp.LeaseTtlMs)
			}
			n := lookup(t, m, &pb.LookupRequest{Keys: tc.keys, CountOnly: true})
			if int(n.Matched) != tc.want || len(n.Sizes) != 0 || len(n.Segments) != 0 {
				t.Fatalf("count only: %v, want %d and no locations", n, tc.want)
			}
		})
	}

	// Matched blocks are leased; unmatched ones and count-only lookups are not.
	lookup(t, m, &pb.LookupRequest{Keys: []string{chain[5]}, CountOnly: true})
	leasedMatched := m.srv.fsm.leaseEnd([]string{chain[0]}) > 0
	leasedAfterGap := m.srv.fsm.leaseEnd([]string{chain[5]}) > 0
	if !leasedMatched || leasedAfterGap {
		t.Fatalf("leased: matched block %v, count-only block %v; want true, false", leasedMatched, leasedAfterGap)
	}

	for _, tc := range []struct {
		name string
		req  *pb.LookupRequest
	}{
		{"no keys", &pb.LookupRequest{}},
		{"an empty key", &pb.LookupRequest{Keys: []string{chain[0], ""}}},
		{"too many keys", &pb.LookupRequest{Keys: make([]string, MaxBatchKeys+1)}},
		{"too many packed keys", &pb.LookupRequest{PackedKeys: []byte("x"), KeyLengths: make([]uint32, MaxBatchKeys+1)}},
		{"an empty packed key", &pb.LookupRequest{PackedKeys: []byte(chain[0]), KeyLengths: []uint32{uint32(len(chain[0])), 0}}},
		{"keys listed and packed", &pb.LookupRequest{Keys: chain[:1], PackedKeys: []byte(chain[1]), KeyLengths: []uint32{uint32(len(chain[1]))}}},
		{"a packed key past the bytes", &pb.LookupRequest{PackedKeys: []byte(chain[0]), KeyLengths: []uint32{uint32(len(chain[0])) + 1}}},
		{"packed bytes left over", &pb.LookupRequest{PackedKeys: []byte(chain[0] + "x"), KeyLengths: []uint32{uint32(len(chain[0]))}}},
		{"packed bytes without lengths", &pb.LookupRequest{PackedKeys: []byte(chain[0])}},
	} {
		if _, err := m.master().Lookup(rpcCtx(t), tc.req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: %v, want InvalidArgument", tc.name, err)
		}
	}
}

// TestLookupLeaseStopsEviction: blocks a lookup matched are not evicted
// until the lease ends, though they are the least recently used.
func TestLookupLeaseStopsEviction(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, func(cfg *Config) { cfg.LeaseTTL = 2 * time.Second; cfg.NoWriteBack = true })
	m := e.m
	startFakeStore(t, m, "s", reportOK, dram("a", segCap))
	e.waitEvictable(t)
	old := keyNames("old", 4)
	chainPut(t, m, 64*kib, nil, old...)
	if r := lookup(t, m, &pb.LookupRequest{Keys: old}); r.Matched != 4 {
		t.Fatalf("matched %d", r.Matched)
	}
	// Recency would pick old first; make the lookup's recency the oldest.
	m.srv.fsm.touch(old, 1)
	// Fill well past the watermark: the sweep and allocation must evict
	// around the leased chain.
	putBatch(t, m, sized(64*kib, nil, keyNames("new", 12)...)...)
	putBatch(t, m, sized(64*kib, nil, keyNames("more", 4)...)...)
	if n := e.count(t, "tidepool_master_evictions_total"); n == 0 {
		t.Fatal("nothing was evicted: the test needs pressure")
	}
	if r := lookup(t, m, &pb.LookupRequest{Keys: old, CountOnly: true}); r.Matched != 4 {
		t.Fatalf("a leased block was evicted: %d of 4 left", r.Matched)
	}
}

// TestLookupRefusedLeaseShrinks: a block whose removal is in flight is not
// leased, and the answer stops before it.
func TestLookupRefusedLeaseShrinks(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, nil)
	m := e.m
	startFakeStore(t, m, "s", reportOK, dram("a", segCap))
	chain := keyNames("c", 4)
	chainPut(t, m, 4*kib, nil, chain...)
	_, done := m.srv.startRemove([]string{chain[2]})
	defer done()
	if r := lookup(t, m, &pb.LookupRequest{Keys: chain}); r.Matched != 2 {
		t.Fatalf("matched %d with block 2 being removed, want 2", r.Matched)
	}
}

// TestChildren lists the chains that continue from a block.
func TestChildren(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, nil)
	m := e.m
	startFakeStore(t, m, "s", reportOK, dram("a", segCap))
	chainPut(t, m, 4*kib, nil, "root", "x1", "x2")
	chainPut(t, m, 4*kib, nil, "root2", "y1")
	reqs := sized(4*kib, nil, "z1", "z0")
	reqs[0].Parent, reqs[1].Parent = "root", "root"
	putBatch(t, m, reqs...)
	for key, want := range map[string][]string{"root": {"x1", "z0", "z1"}, "x1": {"x2"}, "x2": nil, "nope": nil} {
		resp, err := m.master().Children(rpcCtx(t), &pb.ChildrenRequest{Key: key})
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, o := range resp.Objects {
			got = append(got, o.Key)
			if o.Parent != key {
				t.Errorf("child %s has parent %q", o.Key, o.Parent)
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("children of %s: %v, want %v", key, got, want)
		}
	}
	resp, err := m.master().Children(rpcCtx(t), &pb.ChildrenRequest{Key: "root", Limit: 2})
	if err != nil || len(resp.Objects) != 2 || !resp.Truncated {
		t.Fatalf("limit 2: %v, %v", resp, err)
	}
	if _, err := m.master().Children(rpcCtx(t), &pb.ChildrenRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("no key: %v", err)
	}
}

// TestLookupPromotes: blocks a lookup finds on SSD alone count towards
// promotion, as gets do.
func TestLookupPromotes(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, nil)
	m := e.m
	startFakeStore(t, m, "s", reportOK, dram("a", segCap), ssd("b", 8*segCap))
	chainPut(t, m, 4*kib, &pb.PutStartRequest{Tier: pb.Tier_TIER_SSD}, "p0", "p1")
	for range DefaultPromoteAfter {
		lookup(t, m, &pb.LookupRequest{Keys: []string{"p0", "p1"}})
	}
	waitFor(t, 10*time.Second, "promoted", func() error {
		got := placement(t, m, "p0", "p1")
		for _, k := range []string{"p0", "p1"} {
			if len(got[k]) != 2 || got[k][0] != sDRAM {
				return status.Errorf(codes.Unavailable, "%s on %v", k, got[k])
			}
		}
		return nil
	})
}

// TestLookupMetrics: lookups count the keys they probe and the blocks they
// match, by the tier of each block's fastest replica; count-only lookups
// count theirs as unlocated.
func TestLookupMetrics(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, noWriteBack)
	m := e.m
	startFakeStore(t, m, "s", reportOK, dram("a", segCap), ssd("b", 8*segCap))
	chain := keyNames("c", 6)
	chainPut(t, m, 4*kib, nil, chain[:3]...)
	chainPut(t, m, 4*kib, &pb.PutStartRequest{Tier: pb.Tier_TIER_SSD}, chain[3])
	lookup(t, m, &pb.LookupRequest{Keys: chain})                      // 6 probed, 3 in DRAM and 1 in SSD
	lookup(t, m, &pb.LookupRequest{Keys: chain[:2], CountOnly: true}) // 2 probed, 2 unlocated
	lookup(t, m, &pb.LookupRequest{Keys: []string{"nope"}})           // 1 probed
	for _, tc := range []struct {
		family string
		labels []string
		want   float64
	}{
		{"tidepool_master_lookup_blocks_probed_total", nil, 9},
		{"tidepool_master_lookup_blocks_matched_total", []string{"tier", "dram"}, 3},
		{"tidepool_master_lookup_blocks_matched_total", []string{"tier", "ssd"}, 1},
		{"tidepool_master_lookup_blocks_matched_total", []string{"tier", "unlocated"}, 2},
	} {
		if got := countLabeled(t, e.reg, tc.family, tc.labels...); got != tc.want {
			t.Errorf("%s%v = %v, want %v", tc.family, tc.labels, got, tc.want)
		}
	}
}
