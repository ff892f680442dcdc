package master

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestReview22BatchPutEndMismatchedReservations: a put another leader
// placed is published with the replicas and reservations its client
// sends. The item form refused one replica sent with two reservations;
// columns cannot carry the mismatch (columnsOf pads or drops), so
// BatchPutEnd must refuse it before it proposes them (the review found it
// published).
func TestReview22BatchPutEndMismatchedReservations(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1, nil)
	m := c.leader()
	mc := m.master()
	register(t, m, "s", "ep", dram("a", 1<<20))
	r, err := mc.PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "placed", Size: 1000})
	if err != nil || len(r.Replicas) != 1 || len(r.Reservations) != 1 {
		t.Fatalf("put start: %v, %v", r, err)
	}
	// A put id this leader does not know: as after a failover.
	resp, err := mc.BatchPutEnd(rpcCtx(t), &pb.BatchPutEndRequest{Items: []*pb.PutEndItem{{
		Key: "mismatch", PutId: 12345, Size: 1000, Replicas: r.Replicas,
		Reservations: []uint64{r.Reservations[0], r.Reservations[0]},
	}}})
	if err != nil {
		t.Fatal(err)
	}
	if got := codes.Code(resp.Results[0].Code); got != codes.InvalidArgument {
		t.Fatalf("PutEnd of 1 replica with 2 reservations: %v (%s); want InvalidArgument as the item form answered", got, resp.Results[0].Message)
	}
}

// TestReview22LeaderAndFollowersAgreeOnColumns pins that the leader's
// FSM, which takes the publish it proposed as it is (FSM.proposed), ends
// in the state of the followers, which decode it: grants used with
// parents and tenants, and a put placed by PutStart, in one batch.
// Passes.
func TestReview22LeaderAndFollowersAgreeOnColumns(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 3, nil)
	leader := c.leader()
	mc := leader.master()
	register(t, leader, "s1", "ep1", dram("a", 1<<20))
	register(t, leader, "s2", "ep2", dram("a", 1<<20))
	r, err := mc.PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "k0", Size: 1000, Replicas: 2})
	if err != nil {
		t.Fatal(err)
	}
	shape := &pb.PutStartRequest{Size: 1000, Replicas: 2, Tenant: ""}
	resp, err := mc.BatchPutEnd(rpcCtx(t), &pb.BatchPutEndRequest{
		Items:  []*pb.PutEndItem{{Key: "k0", PutId: r.PutId, Size: 1000, Checksum: 1}},
		Grants: []*pb.PutStartRequest{shape, shape, shape, shape},
	})
	if err != nil || resp.Results[0].Code != 0 {
		t.Fatalf("put end: %v, %v", resp, err)
	}
	var ends []*pb.PutEndItem
	parent := "k0"
	for _, run := range resp.Grants {
		for i := range uint64(run.Count) {
			key := fmt.Sprintf("g%d", len(ends))
			ends = append(ends, &pb.PutEndItem{Key: key, PutId: run.FirstPutId + i, Size: 1000, Checksum: uint32(len(ends)), Parent: parent, Tenant: "t"})
			parent = key
		}
	}
	if len(ends) == 0 {
		t.Fatal("no grants")
	}
	resp, err = mc.BatchPutEnd(rpcCtx(t), &pb.BatchPutEndRequest{Items: ends, SparseResults: true})
	if err != nil || len(resp.Failed) != 0 {
		t.Fatalf("put end of grants: %v, %v", resp, err)
	}
	n := 0
	leader.srv.fsm.proposed.Range(func(any, any) bool { n++; return true })
	if n != 0 {
		t.Errorf("%d proposals still held", n)
	}
	waitFor(t, 10*time.Second, "followers in the leader's state", func() error {
		want := snapshotBytes(t, leader.srv.fsm)
		for _, f := range c.followers() {
			if !bytes.Equal(snapshotBytes(t, f.srv.fsm), want) {
				return fmt.Errorf("%s differs from the leader", f.srv.cfg.ID)
			}
		}
		return nil
	})
}
