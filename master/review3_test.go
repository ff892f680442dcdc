package master

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// reviewSegment is the Status of the only segment.
func reviewSegment(t *testing.T, m *member) *pb.SegmentInfo {
	t.Helper()
	st, err := m.master().Status(rpcCtx(t), &pb.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Segments) != 1 {
		t.Fatalf("%d segments", len(st.Segments))
	}
	return st.Segments[0]
}

// TestReview3LatePublishIntoReReservedSpace: a put whose reservation was
// released (no write can land any more) and whose space was reserved
// again for another put must not publish: publish carves its extent out
// of whatever reservation now covers it, so the late put becomes COMPLETE
// on bytes a live put of the current leader is writing.
func TestReview3LatePublishIntoReReservedSpace(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1, func(cfg *Config) {
		cfg.PutTimeout = 200 * time.Millisecond
		cfg.ReserveWindow = 50 * time.Millisecond
	})
	m := c.leader()
	mc := m.master()
	register(t, m, "s", "ep", dram("a", 1<<20))
	old, err := mc.PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "old", Size: 4096})
	if err != nil {
		t.Fatal(err)
	}
	// The put is abandoned: past its deadline, window and late-write grace
	// its reservation is released.
	waitFor(t, 20*time.Second, "the abandoned put's reservation released", func() error {
		if s := reviewSegment(t, m); s.Reserved != 0 || s.Used != 0 {
			return fmt.Errorf("used %d, reserved %d", s.Used, s.Reserved)
		}
		return nil
	})
	// A new put: the leader reserves again, first fit by offset.
	fresh, err := mc.PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "new", Size: 4096})
	if err != nil {
		t.Fatal(err)
	}
	if !overlaps(fresh.Replicas[0], old.Replicas[0]) {
		t.Fatalf("precondition: new put at %v does not reuse the old put's space %v", fresh.Replicas[0], old.Replicas[0])
	}
	// The abandoned put's late PutEnd, with its placement, as a client
	// sends it after a leader change or when its put is no longer known.
	resp, err := mc.BatchPutEnd(rpcCtx(t), &pb.BatchPutEndRequest{Items: []*pb.PutEndItem{{
		Key: "old", PutId: old.PutId, Size: 4096, Replicas: old.Replicas, Reservations: old.Reservations,
	}}})
	if err != nil {
		t.Fatal(err)
	}
	if codes.Code(resp.Results[0].Code) != codes.FailedPrecondition {
		// Show the damage: the live put "new" now writes into "old".
		end, _ := mc.PutEnd(rpcCtx(t), &pb.KeysRequest{Keys: []string{"new"}, PutIds: []uint64{fresh.PutId}})
		t.Fatalf("late PutEnd of %q (space released, then reserved again and placed for %q at %v): code %v, want FailedPrecondition; "+
			"%q is now COMPLETE at %v while %q is in flight there, and the PutEnd of %q answers %v",
			"old", "new", fresh.Replicas[0], codes.Code(resp.Results[0].Code), "old", old.Replicas[0], "new", "new", end)
	}
}

// TestReview3GrantRunRace: grants are placed (placeRun) while other puts
// reserve and release space. Run with -race: placeRun reads the put
// table (t.low) without holding its lock.
func TestReview3GrantRunRace(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1, func(cfg *Config) {
		cfg.ReserveWindow = 20 * time.Millisecond
		cfg.PutTimeout = time.Second
	})
	m := c.leader()
	register(t, m, "s", "ep", dram("a", 4<<20)) // reservations of 64 KiB
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			mc := m.master()
			for i := range 60 {
				key := fmt.Sprintf("w%d/%d", w, i)
				size := uint64(8192 + 64*w) // shapes of their own: reservations come and go
				r, err := mc.PutStart(rpcCtx(t), &pb.PutStartRequest{Key: key, Size: size})
				if err != nil {
					t.Error(err)
					return
				}
				shape := &pb.PutStartRequest{Size: size}
				resp, err := mc.BatchPutEnd(rpcCtx(t), &pb.BatchPutEndRequest{
					Items:  []*pb.PutEndItem{{Key: key, PutId: r.PutId, Size: size}},
					Grants: []*pb.PutStartRequest{shape, shape, shape, shape, shape, shape, shape, shape},
				})
				if err != nil {
					t.Error(err)
					return
				}
				var ids []uint64
				for _, run := range resp.Grants {
					for j := range uint64(run.Count) {
						ids = append(ids, run.FirstPutId+j)
					}
				}
				if len(ids) > 0 {
					_, err = mc.PutRevoke(rpcCtx(t), &pb.KeysRequest{Keys: make([]string, len(ids)), PutIds: ids})
					if err != nil {
						t.Error(err)
						return
					}
				}
			}
		})
	}
	wg.Wait()
}
