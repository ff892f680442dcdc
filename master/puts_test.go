package master

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// The put path's guarantees across a failover: a put the old leader placed
// publishes through the new one, the new leader never places a put in the
// old one's reservations while a write there may still land, and their
// unpublished space is freed once none can.

func TestPutPlacedBeforeFailover(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 3, func(cfg *Config) {
		cfg.PutTimeout = 500 * time.Millisecond
		cfg.ReserveWindow = 200 * time.Millisecond
	})
	leader := c.leader()
	register(t, leader, "s", "ep", dram("a", 1<<20))
	var started []*pb.PutStartResult
	for i := range 4 {
		r, err := leader.master().PutStart(rpcCtx(t), &pb.PutStartRequest{Key: fmt.Sprintf("old%d", i), Size: 4096})
		if err != nil {
			t.Fatal(err)
		}
		started = append(started, r)
	}
	for i, m := range c.members {
		if m == leader {
			c.kill(i)
		}
	}
	leader = c.leader()
	// The new leader places new puts away from everything the old one
	// placed, and a put of the old one publishes with its placement.
	var fresh []*pb.Replica
	for i := range 16 {
		fresh = append(fresh, putObject(t, leader, fmt.Sprintf("new%d", i), 4096))
	}
	for _, n := range fresh {
		for _, o := range started {
			if overlaps(n, o.Replicas[0]) {
				t.Fatalf("new put at %v overlaps %v, placed by the old leader", n, o.Replicas[0])
			}
		}
	}
	endPlaced(t, leader, "old0", started[0])
	if !exists(t, leader, "old0")[0] {
		t.Fatal("the put of the old leader is not visible after its PutEnd")
	}
	// A publish twice (a retry after an unknown outcome) succeeds again.
	endPlaced(t, leader, "old0", started[0])
	// The rest never end: their space is freed once no write can land.
	waitFor(t, 20*time.Second, "the old leader's reservation released", func() error {
		st, err := leader.master().Status(rpcCtx(t), &pb.StatusRequest{})
		if err != nil {
			return err
		}
		if s := st.Segments[0]; s.Reserved != 0 || s.Used != 17*4096 {
			return fmt.Errorf("used %d, reserved %d; want %d used, nothing reserved", s.Used, s.Reserved, 17*4096)
		}
		return nil
	})
	leader = c.leader() // a loaded machine may have elected another meanwhile
	resp, err := leader.master().BatchPutEnd(rpcCtx(t), &pb.BatchPutEndRequest{Items: []*pb.PutEndItem{{
		Key: "old1", PutId: started[1].PutId, Size: 4096, Replicas: started[1].Replicas, Reservations: started[1].Reservations,
	}}})
	if err != nil || codes.Code(resp.Results[0].Code) != codes.FailedPrecondition {
		t.Fatalf("PutEnd after its space was freed: %v, %v; want FailedPrecondition", resp, err)
	}
}

// TestPutGrants: a PutEnd asks for grants, puts of keys not known yet; a
// grant is used by a PutEnd naming it, and revoked by its id.
func TestPutGrants(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1, nil)
	m := c.leader()
	mc := m.master()
	register(t, m, "s", "ep", dram("a", 1<<20))
	r, err := mc.PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "k0", Size: 1000})
	if err != nil {
		t.Fatal(err)
	}
	shape := &pb.PutStartRequest{Size: 1000}
	resp, err := mc.BatchPutEnd(rpcCtx(t), &pb.BatchPutEndRequest{
		Items:  []*pb.PutEndItem{{Key: "k0", PutId: r.PutId, Size: 1000}}, // its leader knows where
		Grants: []*pb.PutStartRequest{shape, shape, shape},
	})
	if err != nil || resp.Results[0].Code != 0 || len(resp.Unplaced) != 0 {
		t.Fatalf("put end with grants: %v, %v", resp, err)
	}
	// Runs of contiguous grants, three in all.
	type grant struct {
		id  uint64
		rep *pb.Replica
	}
	var g []grant
	for _, run := range resp.Grants {
		for i := range uint64(run.Count) {
			rep := &pb.Replica{Segment: run.Replicas[0].Segment, Offset: run.Replicas[0].Offset + i*run.Stride, Length: run.Replicas[0].Length}
			g = append(g, grant{run.FirstPutId + i, rep})
		}
	}
	if len(g) != 3 || g[0].rep.Length != 1000 {
		t.Fatalf("grants %v, want 3 of 1000 bytes", resp.Grants)
	}
	for i, a := range g {
		for _, b := range g[i+1:] {
			if overlaps(a.rep, b.rep) || a.id == b.id {
				t.Fatalf("grants overlap: %v and %v", a, b)
			}
		}
	}
	// A grant is invisible until used; used, it is the key's put.
	use := func(key string, gr grant, size uint64) *pb.ItemStatus {
		resp, err := mc.BatchPutEnd(rpcCtx(t), &pb.BatchPutEndRequest{Items: []*pb.PutEndItem{{
			Key: key, PutId: gr.id, Size: size, Checksum: 7,
		}}})
		if err != nil {
			t.Fatal(err)
		}
		return resp.Results[0]
	}
	if st := use("g0", g[0], 1000); st.Code != 0 {
		t.Fatalf("use grant: %v", st)
	}
	gr, err := mc.GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{"g0"}})
	if err != nil || gr.Results[0].Checksum != 7 || gr.Results[0].Replicas[0].Offset != g[0].rep.Offset {
		t.Fatalf("g0 after its grant was used: %v, %v", gr, err)
	}
	if st := use("g1", g[1], 999); codes.Code(st.Code) != codes.InvalidArgument {
		t.Fatalf("a grant used for another size: %v, want InvalidArgument", st)
	}
	// An item without replicas that this leader did not place is answered
	// as unplaced, for the client to send again with them.
	resp, err = mc.BatchPutEnd(rpcCtx(t), &pb.BatchPutEndRequest{Items: []*pb.PutEndItem{{Key: "x", PutId: 12345, Size: 10}}})
	if err != nil || len(resp.Unplaced) != 1 || resp.Unplaced[0] != 0 || codes.Code(resp.Results[0].Code) != codes.FailedPrecondition {
		t.Fatalf("put end of an unknown put without replicas: %v, %v", resp, err)
	}
	// Revoked by id with no key; a second revoke finds nothing.
	for want := range []codes.Code{codes.OK, codes.FailedPrecondition} {
		res, err := mc.PutRevoke(rpcCtx(t), &pb.KeysRequest{Keys: []string{""}, PutIds: []uint64{g[2].id}})
		if err != nil || codes.Code(res.Results[0].Code) != []codes.Code{codes.OK, codes.FailedPrecondition}[want] {
			t.Fatalf("revoke grant (%d): %v, %v", want, res, err)
		}
	}
	if _, err := mc.PutRevoke(rpcCtx(t), &pb.KeysRequest{Keys: []string{""}}); err == nil {
		t.Fatal("a revoke with an empty key and no put id was accepted")
	}
	// Sparse results answer only the items that failed, by index.
	s0, err := mc.PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "s0", Size: 1000})
	if err != nil {
		t.Fatal(err)
	}
	resp, err = mc.BatchPutEnd(rpcCtx(t), &pb.BatchPutEndRequest{SparseResults: true, Items: []*pb.PutEndItem{
		{Key: "s0", PutId: s0.PutId, Size: 1000},
		{Key: "y", PutId: 12345, Size: 10},
	}})
	if err != nil || len(resp.Results) != 1 || !slices.Equal(resp.Failed, []uint32{1}) || codes.Code(resp.Results[0].Code) != codes.FailedPrecondition {
		t.Fatalf("sparse put end of one placed and one unknown put: %v, %v", resp, err)
	}
	// Grants asked by shape and count, after those asked one a request
	// (older clients), as one prefix: a zero count asks none.
	resp, err = mc.BatchPutEnd(rpcCtx(t), &pb.BatchPutEndRequest{
		Items:     []*pb.PutEndItem{{Key: "y", PutId: 12345, Size: 10}},
		Grants:    []*pb.PutStartRequest{{Size: 500}},
		GrantAsks: []*pb.GrantAsk{{Size: 2000, Count: 0}, {Size: 1000, Count: 2}, {Size: 3000, Count: 3}},
	})
	if err != nil {
		t.Fatal(err)
	}
	var sizes []uint64
	for _, run := range resp.Grants {
		for range run.Count {
			sizes = append(sizes, run.Replicas[0].Length)
		}
	}
	if want := []uint64{500, 1000, 1000, 3000, 3000, 3000}; !slices.Equal(sizes, want) {
		t.Fatalf("grants of sizes %v, want %v", sizes, want)
	}
	m.srv.fsm.proposed.Range(func(k, _ any) bool {
		t.Errorf("proposal %v still held after its put ended", k)
		return true
	})
}

// TestGrantAsks: grants asked one a request become asks of consecutive
// requests of one shape, ahead of the request's grant_asks.
func TestGrantAsks(t *testing.T) {
	a := func(size uint64, tier pb.Tier, reps, n uint32) *pb.GrantAsk {
		return &pb.GrantAsk{Size: size, Tier: tier, Replicas: reps, Count: n}
	}
	r := func(size uint64, tier pb.Tier, reps uint32) *pb.PutStartRequest {
		return &pb.PutStartRequest{Size: size, Tier: tier, Replicas: reps}
	}
	ssd := pb.Tier_TIER_SSD
	for _, tc := range []struct {
		name string
		req  *pb.BatchPutEndRequest
		want []*pb.GrantAsk
	}{
		{"none", &pb.BatchPutEndRequest{}, nil},
		{"asks alone", &pb.BatchPutEndRequest{GrantAsks: []*pb.GrantAsk{a(1, 0, 0, 5)}}, []*pb.GrantAsk{a(1, 0, 0, 5)}},
		{"runs of requests", &pb.BatchPutEndRequest{Grants: []*pb.PutStartRequest{r(1, 0, 0), r(1, 0, 0), r(1, ssd, 0), r(1, ssd, 2), r(1, 0, 0)}},
			[]*pb.GrantAsk{a(1, 0, 0, 2), a(1, ssd, 0, 1), a(1, ssd, 2, 1), a(1, 0, 0, 1)}},
		{"requests first", &pb.BatchPutEndRequest{Grants: []*pb.PutStartRequest{r(2, 0, 0)}, GrantAsks: []*pb.GrantAsk{a(1, 0, 0, 3)}},
			[]*pb.GrantAsk{a(2, 0, 0, 1), a(1, 0, 0, 3)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := grantAsks(tc.req)
			if !slices.EqualFunc(got, tc.want, func(x, y *pb.GrantAsk) bool { return proto.Equal(x, y) }) {
				t.Fatalf("grantAsks = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestPutsNeverShareSpace: concurrent puts, revokes and removes of random
// sizes into a small segment, with evictions and reservations coming and
// going: at every step no two live objects, and no object and open
// reservation, share a byte.
func TestPutsNeverShareSpace(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1, func(cfg *Config) {
		cfg.ReserveWindow = 50 * time.Millisecond
		cfg.PutTimeout = 200 * time.Millisecond
	})
	m := c.leader()
	register(t, m, "s", "ep", dram("a", 8<<20))
	waitFor(t, 5*time.Second, "evictable", func() error {
		if m.srv.cfg.Now().Before(m.srv.evictableFrom()) {
			return fmt.Errorf("not yet")
		}
		return nil
	})
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 11))
			for i := range 80 {
				key := fmt.Sprintf("w%d/%d", w, i)
				r, err := m.master().PutStart(rpcCtx(t), &pb.PutStartRequest{Key: key, Size: 1 + rng.Uint64N(96<<10)})
				switch status.Code(err) {
				case codes.ResourceExhausted, codes.DeadlineExceeded:
					// Abandoned puts hold their space for the grace: on a
					// slow run the segment can be out of evictable room,
					// or a placement (with its evictions) outlast the
					// 200 ms put timeout.
					continue
				}
				if err != nil {
					t.Error(err)
					return
				}
				switch rng.IntN(8) {
				case 0:
					_, err = m.master().PutRevoke(rpcCtx(t), &pb.KeysRequest{Keys: []string{key}, PutIds: []uint64{r.PutId}})
				case 1: // abandoned: expires
				default:
					_, err = m.master().PutEnd(rpcCtx(t), &pb.KeysRequest{Keys: []string{key}, PutIds: []uint64{r.PutId}})
				}
				if err != nil {
					t.Error(err)
				}
				if err := disjoint(m.srv.fsm); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
}

// disjoint checks that object replicas, copies, pending frees and
// reservations of every segment never overlap.
func disjoint(f *FSM) error {
	f.mu.RLock()
	defer f.mu.RUnlock()
	type owned struct {
		span
		who string
	}
	bySeg := map[string][]owned{}
	for _, o := range f.objects.all() {
		for _, r := range f.exts(o) {
			id := f.segID(r)
			bySeg[id] = append(bySeg[id], owned{span{r.offset(), o.size}, "object " + o.key()})
		}
	}
	for _, p := range f.pending {
		bySeg[p.Extent.Segment] = append(bySeg[p.Extent.Segment], owned{span{p.Extent.Offset, p.Extent.Length}, "pending free"})
	}
	for id, s := range f.segments {
		for _, r := range s.resv {
			for _, sp := range r.spans {
				bySeg[id] = append(bySeg[id], owned{sp, fmt.Sprintf("reservation %d", r.id)})
			}
		}
	}
	for seg, os := range bySeg {
		slices.SortFunc(os, func(a, b owned) int { return int(a.off) - int(b.off) })
		for i := 1; i < len(os); i++ {
			if os[i].off < os[i-1].off+os[i-1].len {
				return fmt.Errorf("segment %s: %s at [%d,+%d) overlaps %s at [%d,+%d)", seg,
					os[i].who, os[i].off, os[i].len, os[i-1].who, os[i-1].off, os[i-1].len)
			}
		}
	}
	return nil
}
