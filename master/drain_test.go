package master

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

func (d *fsmDriver) drainCmd(now int64, node string, cancel bool) any {
	return d.apply(now, &pb.Command{Op: &pb.Command_Drain{Drain: &pb.DrainCmd{Node: node, Cancel: cancel}}})
}

func (d *fsmDriver) nodeDrained(now int64, node string, epoch uint64) any {
	return d.apply(now, &pb.Command{Op: &pb.Command_NodeDown{NodeDown: &pb.NodeDownCmd{Node: node, Epoch: epoch, Drained: true}}})
}

func isDraining(f *FSM, seg string) bool {
	for _, v := range f.segmentViews() {
		if v.id == seg {
			return v.draining
		}
	}
	return false
}

// TestFSMDrain: a node is taken out as drained only while marked draining
// and holding nothing: no replica, no copy writing into it.
func TestFSMDrain(t *testing.T) {
	d := newDriver(t)
	d.register(t0, "n1", "ep1", dram("a", 4096))
	d.register(t0, "n2", "ep2", dram("a", 4096))
	d.register(t0, "n3", "ep3", dram("a", 4096))
	d.put(t0, "k", 100, "n1/a@1")
	d.put(t0, "j", 100, "n2/a@1")
	wantErr := func(out any, want error, what string) {
		t.Helper()
		err, _ := out.(error)
		if !errors.Is(err, want) {
			t.Fatalf("%s: Apply = %v, want %v", what, out, want)
		}
		checkInvariants(t, d.f)
	}
	wantErr(d.drainCmd(t0, "nope", false), ErrUnknownNode, "drain of an unknown node")
	wantErr(d.nodeDrained(t0, "n3", 1), ErrDraining, "drained without a drain, though empty")

	if out := d.drainCmd(t0, "n1", false); out != nil {
		t.Fatal(out)
	}
	if !isDraining(d.f, "n1/a@1") || isDraining(d.f, "n2/a@1") {
		t.Fatalf("draining marks: %+v", d.f.segmentViews())
	}
	wantErr(d.nodeDrained(t0+1, "n1", 1), ErrDraining, "drained while holding k")
	wantErr(d.nodeDrained(t0+1, "n1", 2), ErrUnknownNode, "drained at another epoch")
	if !visible(t, d.f, "k") || len(d.f.liveNodes()) != 3 {
		t.Fatal("a refused drained changed the state")
	}

	// k moves away; j starts copying into n1, which holds its target.
	c := d.startCopy(t0+2, "k", "n1/a@1", drain, t0+1e9, "n2/a@1")
	if r := d.copyEnd(t0+3, 0, &pb.CopyEndItem{Key: "k", CopyId: c.Id})[0]; !r.Done {
		t.Fatalf("drain copy end = %+v", r)
	}
	in := d.startCopy(t0+4, "j", "n2/a@1", promote, t0+1e9, "n1/a@1")
	wantErr(d.nodeDrained(t0+5, "n1", 1), ErrDraining, "drained while a copy writes into it")
	d.copyEnd(t0+6, 0, &pb.CopyEndItem{Key: "j", CopyId: in.Id, Failed: true})

	if out := d.nodeDrained(t0+7, "n1", 1); out != nil {
		t.Fatalf("drained when empty: %v", out)
	}
	checkInvariants(t, d.f)
	if _, live := d.f.liveNodes()["n1"]; live || !d.f.drained("n1", 1) || d.f.drained("n1", 2) || d.f.drained("n2", 1) {
		t.Fatalf("after drained: live %v, drained %v", d.f.liveNodes(), d.f.drained("n1", 1))
	}
	if slices.ContainsFunc(d.f.segmentViews(), func(v segmentView) bool { return v.node == "n1" }) {
		t.Fatal("a drained node kept its segments")
	}
	if got := replicaSegments(d.f, "k"); !slices.Equal(got, []string{"n2/a@1"}) {
		t.Fatalf("k on %v", got)
	}
	wantErr(d.drainCmd(t0+8, "n1", false), ErrUnknownNode, "drain of a drained node")
	wantErr(d.nodeDrained(t0+8, "n1", 1), ErrUnknownNode, "drained twice")

	// A restart brings it back, neither draining nor drained.
	if r := d.register(t0+9, "n1", "ep1", dram("a", 4096)); r.Epoch != 2 {
		t.Fatalf("re-register: epoch %d", r.Epoch)
	}
	if isDraining(d.f, "n1/a@2") || d.f.drained("n1", 2) || d.f.drained("n1", 1) {
		t.Fatal("a restarted node is still draining or drained")
	}

	// A canceled drain leaves the node as it was.
	d.drainCmd(t0+10, "n2", false)
	if out := d.drainCmd(t0+11, "n2", true); out != nil || isDraining(d.f, "n2/a@1") {
		t.Fatalf("cancel = %v, draining %v", out, isDraining(d.f, "n2/a@1"))
	}
	wantErr(d.nodeDrained(t0+12, "n2", 1), ErrDraining, "drained after a cancel")
	// A plain NodeDown of a draining node is a death, not a drain.
	d.drainCmd(t0+13, "n3", false)
	if out := d.nodeDown(t0+14, "n3", 1); out != nil || d.f.drained("n3", 1) {
		t.Fatalf("node down of a draining node = %v, drained %v", out, d.f.drained("n3", 1))
	}
	checkInvariants(t, d.f)
}

// drainStream runs Admin.Drain and collects its messages until it ends.
type drainStream struct {
	msgs chan *pb.DrainProgress
	done chan error
}

func startDrain(t *testing.T, admin pb.AdminClient, req *pb.DrainRequest) *drainStream {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := admin.Drain(ctx, req)
	if err != nil {
		cancel()
		t.Fatalf("drain %v: %v", req, err)
	}
	ds := &drainStream{msgs: make(chan *pb.DrainProgress, 1000), done: make(chan error, 1)}
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		for {
			p, err := stream.Recv()
			if err != nil {
				if err == io.EOF {
					err = nil
				}
				ds.done <- err
				return
			}
			ds.msgs <- p
		}
	}()
	t.Cleanup(func() { cancel(); <-exited })
	return ds
}

// wait returns the stream's error and every message it sent.
func (ds *drainStream) wait(t *testing.T, timeout time.Duration) ([]*pb.DrainProgress, error) {
	t.Helper()
	select {
	case err := <-ds.done:
		var out []*pb.DrainProgress
		for {
			select {
			case p := <-ds.msgs:
				out = append(out, p)
			default:
				return out, err
			}
		}
	case <-time.After(timeout):
		t.Fatalf("drain stream still open after %v", timeout)
		return nil, nil
	}
}

// drainOnce runs a drain RPC that ends at once.
func drainOnce(t *testing.T, admin pb.AdminClient, req *pb.DrainRequest) ([]*pb.DrainProgress, error) {
	t.Helper()
	return startDrain(t, admin, req).wait(t, 10*time.Second)
}

// TestDrain: Admin.Drain moves a node's replicas to other nodes (dropping
// those that have another replica already), streams its progress, and
// takes the node out; its heartbeats are then refused.
func TestDrain(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, nil)
	m, admin := e.m, e.admin()
	fa := startFakeStore(t, m, "a", holdCopies, dram("a", segCap))
	single := keyNames("d", 6)
	putBatch(t, m, sized(64*kib, nil, single...)...)
	startFakeStore(t, m, "b", reportOK, dram("a", segCap))
	pairs := keyNames("r", 3)
	for _, r := range putBatch(t, m, sized(64*kib, &pb.PutStartRequest{Replicas: 2}, pairs...)...) {
		if len(r.Replicas) != 2 {
			t.Fatalf("pair placed on %v", r.Replicas)
		}
	}
	all := append(slices.Clone(single), pairs...)

	t.Run("bad requests", func(t *testing.T) {
		_, err := drainOnce(t, admin, &pb.DrainRequest{})
		wantCode(t, err, codes.InvalidArgument, "drain without a node")
		_, err = drainOnce(t, admin, &pb.DrainRequest{Node: "nope"})
		wantCode(t, err, codes.NotFound, "drain of an unknown node")
	})

	ds := startDrain(t, admin, &pb.DrainRequest{Node: "a"})
	// While a drains, placement skips it: new objects go to b.
	waitFor(t, 5*time.Second, "a marked draining", func() error {
		if !isDraining(m.srv.fsm, "a/a@1") {
			return errors.New("not yet")
		}
		return nil
	})
	if got := m.srv.candidates(64*kib, pb.Tier_TIER_DRAM, ""); !slices.Equal(got, []string{"b/a@1"}) {
		t.Fatalf("placement candidates while a drains: %v", got)
	}
	fresh := keyNames("new", 3)
	for i, r := range putBatch(t, m, sized(64*kib, nil, fresh...)...) {
		if r.Replicas[0].Node != "b" {
			t.Fatalf("%s placed on %v while a drains", fresh[i], r.Replicas)
		}
	}
	// The pairs lose their replica on a; the rest are copied to b, and
	// the copies wait in a's store.
	waitFor(t, 10*time.Second, "the drain under way", func() error {
		got := placement(t, m, pairs...)
		for _, k := range pairs {
			if !slices.Equal(got[k], []string{"b/a@1"}) {
				return fmt.Errorf("%s on %v", k, got[k])
			}
		}
		if n := fa.held(); n != len(single) {
			return fmt.Errorf("a's store holds %d copies", n)
		}
		return nil
	})
	for _, task := range fa.tasks() {
		if task.Target.Node != "b" {
			t.Fatalf("drain copy to %v", task.Target)
		}
	}
	select {
	case err := <-ds.done:
		t.Fatalf("the drain stream ended before the drain: %v", err)
	default:
	}
	fa.mode.Store(int32(reportOK))
	msgs, err := ds.wait(t, 10*time.Second)
	if err != nil {
		t.Fatalf("drain stream: %v", err)
	}
	if len(msgs) < 2 || msgs[0].Done || msgs[0].ObjectsLeft == 0 || msgs[0].BytesLeft != msgs[0].ObjectsLeft*64*kib {
		t.Fatalf("drain progress %v: want a first message with what is left", msgs)
	}
	last := msgs[len(msgs)-1]
	if !last.Done || last.ObjectsLeft != 0 || last.BytesLeft != 0 || last.Moved != uint64(len(single)) || last.Dropped != uint64(len(pairs)) {
		t.Fatalf("last drain progress %v: want done, nothing left, %d moved, %d dropped", last, len(single), len(pairs))
	}
	for i := 1; i < len(msgs); i++ {
		if msgs[i].ObjectsLeft > msgs[i-1].ObjectsLeft {
			t.Fatalf("objects left grew: %v", msgs)
		}
	}

	// Everything is on b; a is out of the pool and stays out.
	got := placement(t, m, append(all, fresh...)...)
	for _, k := range append(all, fresh...) {
		if !slices.Equal(got[k], []string{"b/a@1"}) {
			t.Fatalf("%s on %v after the drain, want b only", k, got[k])
		}
	}
	st, err := m.master().Status(rpcCtx(t), &pb.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range st.Segments {
		if s.Node == "a" {
			t.Fatalf("segment %v of the drained node in status", s)
		}
	}
	_, err = m.registry().Heartbeat(rpcCtx(t), &pb.HeartbeatRequest{Node: "a", Epoch: fa.epoch})
	wantCode(t, err, codes.FailedPrecondition, "heartbeat of a drained node")
	waitFor(t, 5*time.Second, "a's store told it was drained", func() error {
		if c := status.Code(fa.lastErr()); c != codes.FailedPrecondition {
			return fmt.Errorf("last heartbeat: %v", fa.lastErr())
		}
		return nil
	})
	if n := e.count(t, "tidepool_master_copies_total", "reason", "drain", "result", "ok"); n != float64(len(single)) {
		t.Fatalf("drain copies %v", n)
	}
	if n := e.count(t, "tidepool_master_replica_drops_total", "reason", "drain"); n != float64(len(pairs)) {
		t.Fatalf("drain drops %v", n)
	}
	if n := e.count(t, "tidepool_master_evictions_total"); n != 0 {
		t.Fatalf("%v evictions", n)
	}
	// Draining it again says it is done.
	if msgs, err := drainOnce(t, admin, &pb.DrainRequest{Node: "a"}); err != nil || len(msgs) != 1 || !msgs[0].Done {
		t.Fatalf("drain of a drained node = %v, %v", msgs, err)
	}
	if m.srv.alive("a") {
		t.Fatal("the leader still counts the drained node as alive")
	}
	// A restarted a registers anew and takes objects again.
	if resp := register(t, m, "a", "ep-a", dram("a", segCap)); resp.Epoch != fa.epoch+1 {
		t.Fatalf("re-register: epoch %d", resp.Epoch)
	}
	if got := m.srv.candidates(64*kib, pb.Tier_TIER_DRAM, ""); !slices.Contains(got, "a/a@2") {
		t.Fatalf("candidates after the restart: %v", got)
	}
	// Drained again, empty: done at once, counting from zero.
	msgs, err = startDrain(t, admin, &pb.DrainRequest{Node: "a"}).wait(t, 10*time.Second)
	if err != nil || len(msgs) == 0 {
		t.Fatalf("second drain = %v, %v", msgs, err)
	}
	// Re-replication may have given the new epoch replicas of objects the
	// first drain left below their count; those are dropped again, not
	// moved (their other replicas stay).
	if last := msgs[len(msgs)-1]; !last.Done || last.Moved != 0 {
		t.Fatalf("second drain ended with %v: want done, with nothing moved this time", last)
	}
}

// TestDrainCancel: a drain waits for room elsewhere, and a cancel stops it:
// the node takes objects again and its stream ends.
func TestDrainCancel(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, nil)
	m, admin := e.m, e.admin()
	fa := startFakeStore(t, m, "a", holdCopies, dram("a", segCap))
	keys := keyNames("k", 3)
	putBatch(t, m, sized(64*kib, nil, keys...)...)
	startFakeStore(t, m, "b", reportOK, dram("a", 64*kib)) // room for one

	ds := startDrain(t, admin, &pb.DrainRequest{Node: "a"})
	waitFor(t, 10*time.Second, "one copy under way, two waiting", func() error {
		if n := fa.held(); n != 1 {
			return fmt.Errorf("a's store holds %d copies", n)
		}
		m.srv.mu.Lock()
		p := m.srv.drainProgress("a").Waiting
		m.srv.mu.Unlock()
		if p != 2 {
			return fmt.Errorf("%d waiting", p)
		}
		return nil
	})
	msgs, err := drainOnce(t, admin, &pb.DrainRequest{Node: "a", Cancel: true})
	if err != nil || len(msgs) != 1 || msgs[0].Done || msgs[0].ObjectsLeft != 3 {
		t.Fatalf("cancel = %v, %v", msgs, err)
	}
	if _, err := ds.wait(t, 10*time.Second); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("the canceled drain's stream ended with %v, want FailedPrecondition", err)
	}
	if isDraining(m.srv.fsm, "a/a@1") {
		t.Fatal("a still draining after the cancel")
	}
	if got := m.srv.candidates(64*kib, pb.Tier_TIER_DRAM, ""); !slices.Contains(got, "a/a@1") {
		t.Fatalf("candidates after the cancel: %v", got)
	}
	// The copy under way fails; nothing starts again.
	fa.mode.Store(int32(reportFailed))
	waitFor(t, 10*time.Second, "the copy ended", func() error {
		if n := copiesInFlight(m.srv.fsm); n != 0 {
			return fmt.Errorf("%d in flight", n)
		}
		return nil
	})
	beats := fa.beats()
	waitFor(t, 10*time.Second, "ten more heartbeats", func() error {
		if fa.beats() < beats+10 {
			return errors.New("not yet")
		}
		return nil
	})
	if n := len(fa.tasks()); n != 1 {
		t.Fatalf("%d copies handed out after the cancel, want the one before", n)
	}
	for k, segs := range placement(t, m, keys...) {
		if !slices.Equal(segs, []string{"a/a@1"}) {
			t.Fatalf("%s on %v", k, segs)
		}
	}
}
