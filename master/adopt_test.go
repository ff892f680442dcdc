package master

import (
	"testing"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestFSMAdopt: a node that registers again with the objects its SSD kept
// gets them back, COMPLETE, at the same offsets of the new epoch's segment.
func TestFSMAdopt(t *testing.T) {
	d := newDriver(t)
	seg1 := d.register(t0, "n1", "ep", ssd("ssd0", 1<<20)).SegmentIDs[0]
	ext := d.put(t0, "kept", 5000, seg1)
	d.put(t0, "lost", 100, seg1) // not offered back: gone with the epoch

	register := func(adopt ...*pb.AdoptedObject) RegisterResult {
		out := d.apply(t0+1, &pb.Command{Op: &pb.Command_Register{Register: &pb.RegisterCmd{
			Node: "n1", Endpoint: "ep", Segments: []*pb.SegmentSpec{ssd("ssd0", 1<<20)}, Adopt: adopt,
		}}})
		return out.(RegisterResult)
	}
	r := register(
		&pb.AdoptedObject{Key: "kept", Segment: "ssd0", Offset: ext.Offset, Size: 5000, Checksum: 5000},
		&pb.AdoptedObject{Key: "overlap", Segment: "ssd0", Offset: ext.Offset + 4096, Size: 10},
		&pb.AdoptedObject{Key: "nosuchsegment", Segment: "ssd9", Offset: 0, Size: 10},
	)
	if r.Epoch != 2 || r.Adopted != 1 {
		t.Fatalf("register = %+v, want epoch 2 and 1 adopted", r)
	}
	got := d.f.replicas([]string{"kept", "lost"})
	if got[0].Status.Code != 0 || len(got[0].Replicas) != 1 || got[0].Replicas[0].Segment != "n1/ssd0@2" || got[0].Replicas[0].Offset != ext.Offset {
		t.Fatalf("kept object after adoption: %v", got[0])
	}
	if got[1].Status.Code == 0 {
		t.Fatal("an object not offered back survived the new epoch")
	}
	if v := d.segment("n1/ssd0@2"); v.used != 8192 || v.objects != 1 {
		t.Fatalf("segment after adoption: %+v", v)
	}

	// A key put elsewhere meanwhile with other bytes keeps its value.
	seg2 := d.register(t0+2, "n2", "ep2", ssd("ssd0", 1<<20)).SegmentIDs[0]
	d.put(t0+2, "k2", 300, seg2)
	r = register(&pb.AdoptedObject{Key: "k2", Segment: "ssd0", Offset: 0, Size: 300, Checksum: 999})
	if r.Adopted != 0 {
		t.Fatalf("a conflicting copy was adopted: %+v", r)
	}
	// The same bytes become a second replica.
	r = register(&pb.AdoptedObject{Key: "k2", Segment: "ssd0", Offset: 0, Size: 300, Checksum: 300})
	if r.Adopted != 1 || len(d.f.replicas([]string{"k2"})[0].Replicas) != 2 {
		t.Fatalf("a matching copy did not become a replica: %+v", r)
	}
}
