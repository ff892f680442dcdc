package master

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// nodesOfSegments names the nodes of segment ids ("node/name@epoch").
func nodesOfSegments(segs []string) []string {
	var out []string
	for _, s := range segs {
		if n, _, _ := strings.Cut(s, "/"); !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	slices.Sort(out)
	return out
}

// declareDead applies what the sweep applies for a silent store.
func declareDead(t *testing.T, m *member, fs *fakeStore) {
	t.Helper()
	if _, err := m.srv.apply(context.Background(), &pb.Command{Op: &pb.Command_NodeDown{NodeDown: &pb.NodeDownCmd{Node: fs.node, Epoch: fs.epoch}}}); err != nil {
		t.Fatal(err)
	}
}

func repairStatus(t *testing.T, m *member) (under, repairing uint64) {
	t.Helper()
	st, err := m.master().Status(rpcCtx(t), &pb.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return st.UnderReplicated, st.Repairing
}

// TestRepairAfterStoreDies: objects put on two nodes are back on two,
// neither the dead one, once a store holding them is declared dead; the
// status tells how many are below their count while the copies run.
func TestRepairAfterStoreDies(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, noWriteBack)
	m := e.m
	u := startFakeStore(t, m, "u", holdCopies, dram("a", segCap))
	v := startFakeStore(t, m, "v", holdCopies, dram("a", segCap))
	w := startFakeStore(t, m, "w", holdCopies, dram("a", segCap))
	keys := keyNames("k", 12)
	putBatch(t, m, sized(4*kib, &pb.PutStartRequest{Replicas: 2}, keys...)...)
	var onU []string
	for k, segs := range placement(t, m, keys...) {
		if nodes := nodesOfSegments(segs); len(nodes) != 2 {
			t.Fatalf("%s on %v, want two nodes", k, segs)
		} else if slices.Contains(nodes, "u") {
			onU = append(onU, k)
		}
	}
	if len(onU) == 0 {
		t.Fatal("nothing on u")
	}
	if under, _ := repairStatus(t, m); under != 0 {
		t.Fatalf("%d under-replicated before any store died", under)
	}

	declareDead(t, m, u)
	waitFor(t, 10*time.Second, "repair copies handed out", func() error {
		if n := v.held() + w.held(); n != len(onU) {
			return fmt.Errorf("%d copies held, want %d", n, len(onU))
		}
		return nil
	})
	if under, repairing := repairStatus(t, m); under != uint64(len(onU)) || repairing != uint64(len(onU)) {
		t.Fatalf("status: %d under-replicated, %d repairing; want %d of each", under, repairing, len(onU))
	}
	v.mode.Store(int32(reportOK))
	w.mode.Store(int32(reportOK))
	waitFor(t, 10*time.Second, "every object back on two live nodes", func() error {
		for k, segs := range placement(t, m, keys...) {
			if nodes := nodesOfSegments(segs); !slices.Equal(nodes, []string{"v", "w"}) {
				return fmt.Errorf("%s on %v", k, segs)
			}
		}
		if under, repairing := repairStatus(t, m); under != 0 || repairing != 0 {
			return fmt.Errorf("%d under-replicated, %d repairing", under, repairing)
		}
		return nil
	})
	if n := e.count(t, "tidepool_master_copies_total", "reason", "repair", "result", "ok"); n != float64(len(onU)) {
		t.Fatalf("%v repair copies, want %d", n, len(onU))
	}
	for _, task := range append(v.tasks(), w.tasks()...) {
		src, dst := task.Source.Node, task.Target.Node
		if src == dst || src == "u" || dst == "u" {
			t.Fatalf("repair copy %s -> %s of %s", src, dst, task.Key)
		}
	}
}

// TestRepairWaitsForANode: with no node left that holds no replica, an
// object stays below its count (and says so) until a node joins.
func TestRepairWaitsForANode(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, noWriteBack)
	m := e.m
	u := startFakeStore(t, m, "u", reportOK, dram("a", segCap))
	startFakeStore(t, m, "v", reportOK, dram("a", segCap))
	putBatch(t, m, sized(4*kib, &pb.PutStartRequest{Replicas: 2}, "x", "y")...)
	declareDead(t, m, u)
	waitFor(t, 5*time.Second, "both below their count", func() error {
		if under, _ := repairStatus(t, m); under != 2 {
			return fmt.Errorf("%d under-replicated", under)
		}
		return nil
	})
	m.srv.sweep() // a sweep with nowhere to copy to starts nothing
	if n := copiesInFlight(m.srv.fsm); n != 0 {
		t.Fatalf("%d copies with no node to copy to", n)
	}
	startFakeStore(t, m, "z", reportOK, dram("a", segCap))
	waitFor(t, 10*time.Second, "repaired onto the new node", func() error {
		for k, segs := range placement(t, m, "x", "y") {
			if nodes := nodesOfSegments(segs); !slices.Equal(nodes, []string{"v", "z"}) {
				return fmt.Errorf("%s on %v", k, segs)
			}
		}
		return nil
	})
}

// TestRepairNeverPromotes: a replica is not re-made in a faster tier than
// the one it is copied from; the object stays below its count instead.
func TestRepairNeverPromotes(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, noWriteBack)
	m := e.m
	u := startFakeStore(t, m, "u", reportOK, ssd("b", 8*segCap))
	startFakeStore(t, m, "v", reportOK, ssd("b", 8*segCap))
	startFakeStore(t, m, "w", reportOK, dram("a", segCap))
	putBatch(t, m, sized(4*kib, &pb.PutStartRequest{Tier: pb.Tier_TIER_SSD, Replicas: 2}, "x")...)
	if got := nodesOfSegments(placement(t, m, "x")["x"]); !slices.Equal(got, []string{"u", "v"}) {
		t.Fatalf("x on %v, want u and v", got)
	}
	declareDead(t, m, u)
	for range 3 {
		m.srv.sweep()
	}
	if n := copiesInFlight(m.srv.fsm); n != 0 {
		t.Fatalf("%d copies: an SSD replica re-made in DRAM", n)
	}
	if under, _ := repairStatus(t, m); under != 1 {
		t.Fatalf("%d under-replicated, want 1", under)
	}
}

// TestDrainKeepsReplicaCount: draining a node of objects put on two nodes
// moves its replicas to a third rather than dropping them.
func TestDrainKeepsReplicaCount(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, noWriteBack)
	m := e.m
	for _, n := range []string{"u", "v", "w"} {
		startFakeStore(t, m, n, reportOK, dram("a", segCap))
	}
	keys := keyNames("k", 8)
	putBatch(t, m, sized(4*kib, &pb.PutStartRequest{Replicas: 2}, keys...)...)
	stream, err := e.admin().Drain(rpcCtx(t), &pb.DrainRequest{Node: "u"})
	if err != nil {
		t.Fatal(err)
	}
	for {
		p, err := stream.Recv()
		if err != nil {
			t.Fatalf("drain: %v", err)
		}
		if p.Done {
			break
		}
	}
	for k, segs := range placement(t, m, keys...) {
		if nodes := nodesOfSegments(segs); !slices.Equal(nodes, []string{"v", "w"}) {
			t.Fatalf("%s on %v after u drained, want v and w", k, segs)
		}
	}
	if under, _ := repairStatus(t, m); under != 0 {
		t.Fatalf("%d under-replicated after a drain", under)
	}
}

// TestReportUnreachable: placement avoids a node a client reported it could
// not reach, while another node is left; a report of more than a batch's
// segments is refused.
func TestReportUnreachable(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, noWriteBack)
	m := e.m
	startFakeStore(t, m, "u", reportOK, dram("a", segCap))
	startFakeStore(t, m, "v", reportOK, dram("a", segCap))
	resp, err := m.master().ReportUnreachable(rpcCtx(t), &pb.UnreachableReport{Segments: []string{"u/a@1", "nope/a@1"}})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(resp.Nodes, []string{"u"}) {
		t.Fatalf("avoided %v, want [u]", resp.Nodes)
	}
	for i, r := range putBatch(t, m, sized(4*kib, &pb.PutStartRequest{}, keyNames("p", 6)...)...) {
		if r.Replicas[0].Node != "v" {
			t.Fatalf("put %d placed on %s, an avoided node", i, r.Replicas[0].Node)
		}
	}
	// With every node avoided, placement uses them all rather than none.
	if _, err := m.master().ReportUnreachable(rpcCtx(t), &pb.UnreachableReport{Segments: []string{"v/a@1"}}); err != nil {
		t.Fatal(err)
	}
	putBatch(t, m, sized(4*kib, &pb.PutStartRequest{}, "q")...)

	_, err = m.master().ReportUnreachable(rpcCtx(t), &pb.UnreachableReport{Segments: make([]string, maxUnreachable+1)})
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("an oversized report: %v, want InvalidArgument", err)
	}
}

// TestReplicaCountInSnapshot: the count a put asked for, and so the set of
// objects below it, survive a snapshot and restore.
func TestReplicaCountInSnapshot(t *testing.T) {
	d := newDriver(t)
	s1 := d.register(t0, "n1", "ep1", dram("a", 1<<20)).SegmentIDs
	s2 := d.register(t0, "n2", "ep2", dram("a", 1<<20)).SegmentIDs
	out := d.apply(t0, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{{
		Key: "k", Size: 100, Replicas: 3, Candidates: []string{s1[0], s2[0]}, DeadlineUnixNano: t0 + 1e9,
	}}}}})
	if r := out.([]PutStartResult)[0]; r.Err != nil || len(r.Replicas) != 2 {
		t.Fatalf("put start: %+v", r)
	}
	if err := d.putEnd(t0, "k"); err != nil {
		t.Fatal(err)
	}
	d.put(t0, "one", 100, s1[0])
	check := func(f *FSM, under int) {
		t.Helper()
		if st := f.repairs(); st.under != under {
			t.Fatalf("%d under-replicated, want %d", st.under, under)
		}
		f.mu.RLock()
		defer f.mu.RUnlock()
		if w := f.want(f.objects.get("k")); w != 3 {
			t.Fatalf("k wants %d replicas, want 3", w)
		}
		if w := f.want(f.objects.get("one")); w != 1 {
			t.Fatalf("one wants %d replicas, want 1", w)
		}
	}
	check(d.f, 1) // two nodes only for three replicas
	f := restored(t, snapshotBytes(t, d.f))
	check(f, 1)
	d.nodeDown(t0, "n2", 1)
	check(d.f, 1)
	d.nodeDown(t0, "n1", 1)
	if st := d.f.repairs(); st.under != 0 {
		t.Fatalf("%d under-replicated with the object gone", st.under)
	}
}

// TestSegmentFail: a segment whose I/O failed leaves the pool with its
// replicas: an object with another replica keeps it, one without is lost;
// it stays out across a snapshot and comes back when its node registers
// again.
func TestSegmentFail(t *testing.T) {
	d := newDriver(t)
	s1 := d.register(t0, "n1", "ep1", dram("a", 1<<20), ssd("b", 1<<20)).SegmentIDs
	s2 := d.register(t0, "n2", "ep2", ssd("b", 1<<20)).SegmentIDs
	d.put(t0, "alone", 4096, s1[1])
	out := d.apply(t0, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{{
		Key: "both", Size: 4096, Replicas: 2, Candidates: []string{s1[1], s2[0]}, DeadlineUnixNano: t0 + 1e9,
	}}}}})
	if r := out.([]PutStartResult)[0]; r.Err != nil || len(r.Replicas) != 2 {
		t.Fatalf("put start: %+v", r)
	}
	if err := d.putEnd(t0, "both"); err != nil {
		t.Fatal(err)
	}
	fail := func(name string, epoch uint64) any {
		return d.apply(t0, &pb.Command{Op: &pb.Command_SegmentFail{SegmentFail: &pb.SegmentFailCmd{Node: "n1", Epoch: epoch, Name: name}}})
	}
	if err, _ := fail("b", 2).(error); !errors.Is(err, ErrUnknownNode) {
		t.Fatalf("a stale epoch: %v", err)
	}
	if out := fail("b", 1); out != nil {
		t.Fatalf("fail n1/b: %v", out)
	}
	if err, _ := fail("b", 1).(error); !errors.Is(err, ErrNotFound) {
		t.Fatalf("failing it twice: %v", err)
	}
	check := func(f *FSM, what string) {
		t.Helper()
		if slices.ContainsFunc(f.segmentViews(), func(v segmentView) bool { return v.id == s1[1] }) {
			t.Fatalf("%s: the failed segment is still in the pool", what)
		}
		keys := listKeys(f)
		if slices.Contains(keys, "alone") || !slices.Contains(keys, "both") {
			t.Fatalf("%s: objects %v, want both alone gone", what, keys)
		}
		if st := f.repairs(); st.under != 1 {
			t.Fatalf("%s: %d under-replicated, want 1", what, st.under)
		}
	}
	check(d.f, "after the failure")
	check(restored(t, snapshotBytes(t, d.f)), "restored")
	res := d.register(t0, "n1", "ep1", dram("a", 1<<20), ssd("b", 1<<20))
	if len(res.SegmentIDs) != 2 || !slices.ContainsFunc(d.f.segmentViews(), func(v segmentView) bool { return v.id == res.SegmentIDs[1] }) {
		t.Fatalf("the segment is not back after its node registered again: %v", res.SegmentIDs)
	}
}
