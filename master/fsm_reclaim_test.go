package master

import (
	"errors"
	"fmt"
	"testing"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestFSMReclaimOnlyForNewPuts: a PutStart item whose key already exists
// (the put answers Exists and allocates nothing) drops no written-back
// replica: engines re-put the blocks they have all the time.
func TestFSMReclaimOnlyForNewPuts(t *testing.T) {
	d := newCopyDriver(t) // "k" (100 bytes) on n1's DRAM
	c := d.startCopy(t0, "k", n1dram, pb.CopyReason_COPY_REASON_WRITEBACK, t0+1e9, n1ssd)
	if r := d.copyEnd(t0, 0, &pb.CopyEndItem{Key: "k", CopyId: c.Id}); !r[0].Done {
		t.Fatalf("write-back: %+v", r[0])
	}
	d.put(t0, "fill", 4096-128, n1dram) // DRAM is full now
	out := d.apply(t0, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{
		Items:   []*pb.PutStartItem{{Key: "fill", Size: 100, Candidates: []string{n1dram}, DeadlineUnixNano: t0 + 1e9}},
		Reclaim: []*pb.Reclaimable{{Key: "k", Segment: n1dram}},
	}}})
	r := out.([]PutStartResult)[0]
	if !r.Exists {
		t.Fatalf("put of an existing key: %+v", r)
	}
	if r.Reclaimed != 0 {
		t.Errorf("a put that allocated nothing (Exists) reclaimed %d written-back replica(s); %q is now on %v",
			r.Reclaimed, "k", replicaSegments(d.f, "k"))
	}
}

// TestFSMCommandItemsBounded: item ids are index<<16|item, unique only
// below 1<<16 items, so Apply refuses larger PutStart and CopyStart
// commands (the leader sends at most a few thousand).
func TestFSMCommandItemsBounded(t *testing.T) {
	d := newCopyDriver(t)
	items := make([]*pb.CopyStartItem, maxCommandItems+1)
	for i := range items {
		items[i] = &pb.CopyStartItem{Key: "k", Source: n1dram, Candidates: []string{n1ssd}, DeadlineUnixNano: t0 + 1e9}
	}
	if err, ok := d.apply(t0, &pb.Command{Op: &pb.Command_CopyStart{CopyStart: &pb.CopyStartCmd{Items: items}}}).(error); !ok || !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("a CopyStart of %d items: %v, want ErrInvalidRequest", len(items), err)
	}
	puts := make([]*pb.PutStartItem, maxCommandItems+1)
	for i := range puts {
		puts[i] = &pb.PutStartItem{Key: fmt.Sprint(i), Size: 1, Candidates: []string{n1dram}, DeadlineUnixNano: t0 + 1e9}
	}
	if err, ok := d.apply(t0, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: puts}}}).(error); !ok || !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("a PutStart of %d items: %v, want ErrInvalidRequest", len(puts), err)
	}
}
