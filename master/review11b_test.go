package master

// Second review of issue 11 (hardening): each test here fails on the
// branch as reviewed and names what goes wrong.

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// review11bPut runs whole puts of (key, parent) pairs through Apply, in
// commands of up to 4096 items, each of 64 bytes on segment seg.
func review11bPut(t *testing.T, d *fsmDriver, seg string, items [][2]string) {
	t.Helper()
	for len(items) > 0 {
		part := items[:min(len(items), 4096)]
		items = items[len(part):]
		start := &pb.PutStartCmd{}
		end := &pb.KeysCmd{}
		for _, it := range part {
			start.Items = append(start.Items, &pb.PutStartItem{Key: it[0], Parent: it[1], Size: 64, Checksum: 1,
				Candidates: []string{seg}, DeadlineUnixNano: t0 + 1e12})
			end.Keys = append(end.Keys, it[0])
		}
		res, ok := d.apply(t0, &pb.Command{Op: &pb.Command_PutStart{PutStart: start}}).([]PutStartResult)
		if !ok {
			t.Fatal("put start: no results")
		}
		for i, r := range res {
			if r.Err != nil || r.Exists {
				t.Fatalf("put start %q: %+v", part[i][0], r)
			}
		}
		errs, ok := d.apply(t0, &pb.Command{Op: &pb.Command_PutEnd{PutEnd: end}}).([]error)
		if !ok {
			t.Fatal("put end: no results")
		}
		for i, err := range errs {
			if err != nil {
				t.Fatalf("put end %q: %v", part[i][0], err)
			}
		}
	}
}

// TestReview11bRestoreKeepsLinksOfLongChain: parentLoop gives up after
// maxChainWalk links and calls that a loop, but walks at all only for a
// key that objects already name as their parent. Live, the blocks of a
// chain come in chain order and nothing walks; a snapshot restores them in
// key order, where a key's child may come before it: then restore walks
// the whole chain above it, and drops a link the live FSM kept. The
// follower that installed the snapshot and the leader now disagree on the
// object's parent (List, Children, eviction depth).
func TestReview11bRestoreKeepsLinksOfLongChain(t *testing.T) {
	d := newDriver(t)
	const n = maxChainWalk + 16
	seg := d.register(t0, "n1", "ep", dram("dram0", uint64(n+8)*64)).SegmentIDs[0]
	items := make([][2]string, 0, n+2)
	parent := ""
	for i := range n {
		k := fmt.Sprintf("c%07d", i)
		items = append(items, [2]string{k, parent})
		parent = k
	}
	// z continues the chain; a (sorting first) continues z.
	items = append(items, [2]string{"z", parent}, [2]string{"a", "z"})
	review11bPut(t, d, seg, items)
	if got := d.f.objects.get("z").parent(); got != parent {
		t.Fatalf("live FSM: z has parent %q, want %q", got, parent)
	}
	r := restored(t, snapshotBytes(t, d.f))
	for _, k := range []string{"z", "a", parent} {
		live, back := d.f.objects.get(k), r.objects.get(k)
		if back == nil {
			t.Fatalf("%q not restored", k)
		}
		if live.parent() != back.parent() {
			t.Errorf("%q: parent %q live, %q after snapshot and restore", k, live.parent(), back.parent())
		}
	}
}

// TestReview11bRestoreOfLoopMatchesLogReplay: a loop an older master kept
// (b under a, then a under b) is broken by newObject at the later put
// when a replica replays the log, but at the key later in key order when
// one restores that master's snapshot. After the upgrade, a replica whose
// last snapshot predates the loop and one whose snapshot holds it
// disagree on which link exists.
func TestReview11bRestoreOfLoopMatchesLogReplay(t *testing.T) {
	d := newDriver(t)
	seg := d.register(t0, "n1", "ep", dram("dram0", 1<<20)).SegmentIDs[0]
	review11bPut(t, d, seg, [][2]string{{"b", "a"}})
	review11bPut(t, d, seg, [][2]string{{"a", "b"}}) // replayed by this master: a's link dropped
	// The snapshot an older master took of the same log kept both links.
	var snap pb.Snapshot
	if err := proto.Unmarshal(snapshotBytes(t, d.f), &snap); err != nil {
		t.Fatal(err)
	}
	for _, o := range snap.Objects {
		if o.Key == "a" {
			o.Parent = "b"
		}
	}
	data, err := proto.MarshalOptions{Deterministic: true}.Marshal(&snap)
	if err != nil {
		t.Fatal(err)
	}
	r := restored(t, data)
	for _, k := range []string{"a", "b"} {
		if live, back := d.f.objects.get(k).parent(), r.objects.get(k).parent(); live != back {
			t.Errorf("%q: parent %q replaying the log, %q restoring the older master's snapshot", k, live, back)
		}
	}
}

// TestReview11bBatchPutStartRefusesLoopWithinBatch: loopingParents checks
// each item against the table only, so one batch naming a under b and b
// under a passes the handler (so does BatchPutEnd); Apply then drops one
// link silently and both puts succeed. The issue: such a put is refused.
func TestReview11bBatchPutStartRefusesLoopWithinBatch(t *testing.T) {
	c := newCluster(t, 1, nil)
	m := c.leader()
	register(t, m, "store1", "10.0.0.1:7000", dram("dram0", 1<<20))
	want := map[string]string{"loop/a": "loop/b", "loop/b": "loop/a"}
	req := &pb.BatchPutStartRequest{Items: []*pb.PutStartRequest{
		{Key: "loop/a", Parent: "loop/b", Size: 64, Checksum: 1},
		{Key: "loop/b", Parent: "loop/a", Size: 64, Checksum: 1},
	}}
	resp, err := m.master().BatchPutStart(rpcCtx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	end := &pb.BatchPutEndRequest{}
	refused := 0
	for i, r := range resp.Results {
		it := req.Items[i]
		if codes.Code(r.Status.Code) == codes.InvalidArgument {
			refused++
			continue
		}
		if r.Status.Code != 0 || len(r.Replicas) == 0 {
			t.Fatalf("put start %q: %v", it.Key, r)
		}
		end.Items = append(end.Items, &pb.PutEndItem{Key: it.Key, PutId: r.PutId, Size: it.Size, Checksum: it.Checksum,
			Replicas: r.Replicas, Reservations: r.Reservations, Parent: it.Parent})
	}
	if len(end.Items) > 0 {
		eresp, err := m.master().BatchPutEnd(rpcCtx(t), end)
		if err != nil {
			t.Fatal(err)
		}
		for i, r := range eresp.Results {
			if codes.Code(r.Code) == codes.InvalidArgument {
				refused++
			} else if r.Code != 0 {
				t.Fatalf("put end %q: %v", end.Items[i].Key, r)
			}
		}
	}
	lresp, err := m.master().List(rpcCtx(t), &pb.ListRequest{Prefix: "loop/"})
	if err != nil {
		t.Fatal(err)
	}
	var kept []string
	for _, o := range lresp.Objects {
		kept = append(kept, fmt.Sprintf("%s under %q", o.Key, o.Parent))
		if o.Parent != want[o.Key] {
			t.Errorf("%s was put under %q and succeeded, but is stored under %q", o.Key, want[o.Key], o.Parent)
		}
	}
	if refused == 0 {
		t.Errorf("a batch closing a loop (a under b, b under a) was accepted whole; stored: %s", strings.Join(kept, ", "))
	}
}

// TestReview11bListNoEmptyTruncatedPage: list gathers keys shard by shard
// and describes them after, under a later hold of the lock. A key removed
// in between leaves the page short; when that is all of it, the page is
// empty and still truncated, which gives the caller no key to continue
// after (client.ListPage reads it as the end, client/ops.go:188, so
// tidepool ls stops short while p/b is there all along).
func TestReview11bListNoEmptyTruncatedPage(t *testing.T) {
	f := NewFSM()
	for i := range 50000 { // makes the walk of the other shards take a while
		f.newObject(fmt.Sprintf("q/%06d", i), 1, 0, 0, 0, "", "", nil)
	}
	f.newObject("p/a", 1, 0, 0, 0, "", "", nil)
	f.newObject("p/b", 1, 0, 0, 0, "", "", nil)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { // p/a removed and put back, over and over
		for {
			select {
			case <-stop:
				return
			default:
			}
			f.mu.Lock()
			if o := f.objects.get("p/a"); o != nil {
				f.drop(o)
			} else {
				f.newObject("p/a", 1, 0, 0, 0, "", "", nil)
			}
			f.mu.Unlock()
		}
	})
	defer wg.Wait()
	defer close(stop)
	deadline := time.Now().Add(3 * time.Second)
	for n := 0; time.Now().Before(deadline); n++ {
		objs, truncated := f.list("p/", "", 1)
		if truncated && len(objs) == 0 {
			t.Fatalf("list of p/ (limit 1, p/b present throughout) answered an empty page marked truncated, after %d pages", n)
		}
	}
}

// TestReview11bRegisterMultiRailEndpoint: a store's endpoint is its rail
// addresses joined by commas (store.Node.Endpoint, --listen a,b,...); the
// engine's 255-byte bound is for segment names, which carry no endpoint.
// A node of 8 rails with IPv6 addresses (or host names) is refused.
func TestReview11bRegisterMultiRailEndpoint(t *testing.T) {
	var rails []string
	for i := range 8 {
		rails = append(rails, fmt.Sprintf("[2001:db8:aa10:1f0%d:ba59:9fff:fe12:3456]:17000", i))
	}
	req := &pb.RegisterRequest{Node: "gpu-07", Endpoint: strings.Join(rails, ","),
		Segments: []*pb.SegmentSpec{dram("dram0", 1<<30)}}
	if err := validRegister(req); err != nil {
		t.Errorf("register of a node with 8 rails (endpoint of %d bytes): %v", len(req.Endpoint), err)
	}
}

// review11bWriterWait runs op three times, each in a goroutine while the
// test takes the FSM's write lock every millisecond, as Apply would; it
// returns the median of the three runs' longest wait for the lock, and
// how long a run of op took on average.
func review11bWriterWait(f *FSM, op func()) (worst, took time.Duration) {
	var worsts []time.Duration
	for range 3 {
		done := make(chan struct{})
		began := time.Now()
		go func() {
			defer close(done)
			op()
		}()
		var w time.Duration
	wait:
		for {
			select {
			case <-done:
				break wait
			case <-time.After(time.Millisecond):
			}
			at := time.Now()
			f.mu.Lock()
			w = max(w, time.Since(at))
			f.mu.Unlock()
		}
		took += time.Since(began)
		worsts = append(worsts, w)
	}
	slices.Sort(worsts)
	return worsts[1], took / 3
}

// review11bTable is an FSM of n objects of 64 bytes on one DRAM segment
// n1/dram0@1; every other one names "root" (not in the table) as parent.
func review11bTable(t *testing.T, n int) *FSM {
	d := newDriver(t)
	d.register(t0, "n1", "ep", dram("dram0", 1<<40))
	f := d.f
	s := f.segments["n1/dram0@1"]
	for i := range n {
		p := ""
		if i%2 == 1 {
			p = "root"
		}
		f.newObject(fmt.Sprintf("obj/%08d", i), 64, 1, 0, t0, p, "", []extent{newExtent(uint64(i)*64, s.idx)})
	}
	return f
}

// TestReview11bEvictScanHoldsOneShard: scan appends each object's
// evictable to one slice inside the shard callback, under the read lock;
// when the slice grows, the copy (and the allocation of the new array, its
// page faults and the collector's assist) of everything scanned so far
// happens under the lock. A put then waits for a hold that grows with the
// whole table, many shards' worth: at 1.6 M objects holds of 0.3-0.7 s
// were seen, against 20-50 ms with the evictables gathered per shard and
// appended after RUnlock (with that change this test passes: 2-16 ms).
// Run it without -race: the race detector slows the scan's own work per
// object some 4 times, and the limit with it, but not the copy.
func TestReview11bEvictScanHoldsOneShard(t *testing.T) {
	const n = 500000
	f := review11bTable(t, n)
	worst, took := review11bWriterWait(f, func() { f.completeObjects(func(string) bool { return true }) })
	shard := took / tableShards
	t.Logf("scans of %d objects: %v each, %v a shard; a writer's worst wait: %v", n, took, shard, worst)
	if limit := 8*shard + 2*time.Millisecond; worst > limit {
		t.Errorf("beside an eviction scan a writer waited up to %v (median of 3 scans), %.0f shards' worth of the scan (limit %v)",
			worst, float64(worst)/float64(shard), limit)
	}
}

// TestReview11bWholeTableWalksYieldToApply: the rule is that no request's
// cost grows with the whole table; List and eviction scans now take the
// table a shard at a time, but these request paths still walk all of it
// under one hold of the read lock, so every Apply (every put) waits for
// the whole walk: SegmentObjects (each SSD store's index sync, every 5 s,
// one walk per page: master/query.go:481) and Children (lookup.go:157).
// Drain and DrainStatus (nodeStates, drain.go:53: a walk per node, and
// per sweep while a node drains) and Status and each metrics scrape
// (objectStats, query.go:258) do the same more cheaply per object: logged,
// not held to the limit. The limit is 8 shards' worth of an eviction scan
// of the same table.
func TestReview11bWholeTableWalksYieldToApply(t *testing.T) {
	const n = 500000
	f := review11bTable(t, n)
	_, took := review11bWriterWait(f, func() { f.completeObjects(func(string) bool { return true }) })
	shard := took / tableShards
	limit := 8*shard + 10*time.Millisecond
	t.Logf("an eviction scan of %d objects: %v, %v a shard; limit %v", n, took, shard, limit)
	for _, tc := range []struct {
		name string
		op   func()
		held bool
	}{
		{"SegmentObjects (segmentObjects)", func() { f.segmentObjects("n1/dram0@1", "dram0", "", defaultObjectPage) }, true},
		{"Children (childrenOf)", func() { f.childrenOf("root", defaultList) }, true},
		{"DrainStatus (nodeState)", func() { f.nodeState("n1") }, false},
		{"Status (objectStats)", func() { f.objectStats() }, false},
	} {
		worst, took := review11bWriterWait(f, tc.op)
		t.Logf("%s: %v a call; a writer's worst wait %v", tc.name, took, worst)
		if tc.held && worst > limit {
			t.Errorf("%s: a writer waited up to %v (%.0f shards of a scan; limit %v)", tc.name, worst, float64(worst)/float64(shard), limit)
		}
	}
}
