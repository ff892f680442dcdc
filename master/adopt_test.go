package master

import (
	"errors"
	"fmt"
	"maps"
	"strings"
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
	got := d.f.replicasOf([]string{"kept", "lost"})
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
	if r.Adopted != 1 || len(d.f.replicasOf([]string{"k2"})[0].Replicas) != 2 {
		t.Fatalf("a matching copy did not become a replica: %+v", r)
	}
}

// meta is the part of an object that adoption must carry over.
type meta struct {
	hard           bool
	softPin        int64
	parent, tenant string
}

func objectMeta(t testing.TB, f *FSM, key string) meta {
	t.Helper()
	f.mu.RLock()
	defer f.mu.RUnlock()
	o := f.objects.get(key)
	if o == nil {
		t.Fatalf("no object %q", key)
	}
	return meta{o.hard(), f.softPin(o), o.parent(), f.tenantOf(o)}
}

// putWith runs a whole put of a parented, tenanted object on one segment.
func (d *fsmDriver) putWith(now int64, key string, size uint64, parent, tenant, segment string) *pb.Extent {
	d.t.Helper()
	out := d.apply(now, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{{
		Key: key, Size: size, Checksum: uint32(size), Candidates: []string{segment}, DeadlineUnixNano: now + 1e9,
		Parent: parent, Tenant: tenant,
	}}}}})
	res, ok := out.([]PutStartResult)
	if !ok || len(res) != 1 || res[0].Err != nil || len(res[0].Replicas) != 1 {
		d.t.Fatalf("put start %q: Apply returned %T %v", key, out, out)
	}
	if err := d.putEnd(now, key); err != nil {
		d.t.Fatalf("put end %q: %v", key, err)
	}
	return res[0].Replicas[0]
}

func (d *fsmDriver) reregister(now int64, node string, spec *pb.SegmentSpec, adopt []*pb.AdoptedObject) RegisterResult {
	d.t.Helper()
	out := d.apply(now, &pb.Command{Op: &pb.Command_Register{Register: &pb.RegisterCmd{
		Node: node, Endpoint: "ep-" + node, Segments: []*pb.SegmentSpec{spec}, Adopt: adopt,
	}}})
	r, ok := out.(RegisterResult)
	if !ok {
		d.t.Fatalf("register %s: Apply returned %T %v", node, out, out)
	}
	return r
}

// TestFSMAdoptKeepsPins: a restarted node that offers back what the master
// listed for its SSD segment (as the store's index keeps it) gets its
// objects back with their hard and soft pins, parent keys and tenants, and
// the parents' child counts are rebuilt; the pins still refuse eviction.
func TestFSMAdoptKeepsPins(t *testing.T) {
	d := newDriver(t)
	seg := d.register(t0, "n1", "ep-n1", ssd("ssd0", 1<<20)).SegmentIDs[0]
	d.put(t0, "root", 100, seg)
	d.putWith(t0, "hard", 200, "root", "acme", seg)
	d.putWith(t0, "soft", 300, "root", "acme", seg)
	d.putWith(t0, "leaf", 400, "hard", "", seg)
	if err := d.pin(t0, &pb.PinCmd{Key: "hard", Hard: true}); err != nil {
		t.Fatal(err)
	}
	soft := t0 + 3600e9
	if err := d.pin(t0, &pb.PinCmd{Key: "soft", SoftUntilUnixNano: soft}); err != nil {
		t.Fatal(err)
	}
	keys := []string{"hard", "leaf", "root", "soft"}
	want := map[string]meta{}
	for _, k := range keys {
		want[k] = objectMeta(t, d.f, k)
	}
	if want["hard"] != (meta{true, 0, "root", "acme"}) || want["soft"] != (meta{false, soft, "root", "acme"}) {
		t.Fatalf("setup: %v", want)
	}
	wantChildren := maps.Clone(d.f.children)
	if !maps.Equal(wantChildren, map[string]int{"root": 2, "hard": 1}) {
		t.Fatalf("setup: children %v", wantChildren)
	}

	kept, _ := d.f.segmentObjects(seg, "ssd0", "", 1000)
	if len(kept) != len(keys) {
		t.Fatalf("segmentObjects = %v", kept)
	}
	for i, a := range kept {
		m := want[a.Key]
		if a.Key != keys[i] || a.HardPinned != m.hard || a.SoftPinUntilUnixNano != m.softPin || a.Parent != m.parent || a.Tenant != m.tenant {
			t.Errorf("segmentObjects[%d] = %v, want %q with %+v", i, a, keys[i], m)
		}
	}

	r := d.reregister(t0+10, "n1", ssd("ssd0", 1<<20), kept)
	if r.Epoch != 2 || r.Adopted != len(keys) {
		t.Fatalf("register = %+v, want epoch 2 and %d adopted", r, len(keys))
	}
	for _, k := range keys {
		if got := objectMeta(t, d.f, k); got != want[k] {
			t.Errorf("%q after adoption: %+v, want %+v", k, got, want[k])
		}
	}
	if !maps.Equal(d.f.children, wantChildren) {
		t.Errorf("children after adoption %v, want %v", d.f.children, wantChildren)
	}
	checkInvariants(t, d.f)
	if err := d.evict(t0+11, "hard", 0, true); !errors.Is(err, ErrPinned) {
		t.Errorf("evict of the re-adopted hard pinned object: %v, want ErrPinned", err)
	}
	if err := d.evict(t0+11, "soft", 0, false); !errors.Is(err, ErrPinned) {
		t.Errorf("evict of the re-adopted soft pinned object: %v, want ErrPinned", err)
	}

	// The same through a snapshot: a follower restored from it agrees.
	g := restored(t, snapshotBytes(t, d.f))
	for _, k := range keys {
		if got := objectMeta(t, g, k); got != want[k] {
			t.Errorf("%q after snapshot and restore: %+v, want %+v", k, got, want[k])
		}
	}
	if !maps.Equal(g.children, wantChildren) {
		t.Errorf("children after snapshot and restore %v, want %v", g.children, wantChildren)
	}
}

// TestFSMAdoptLongMetadata: a parent key or tenant longer than any valid
// one is left out, and the object is adopted without it.
func TestFSMAdoptLongMetadata(t *testing.T) {
	d := newDriver(t)
	d.register(t0, "n1", "ep-n1", ssd("ssd0", 1<<20))
	edge, long := strings.Repeat("e", MaxKeyLen), strings.Repeat("l", MaxKeyLen+1)
	r := d.reregister(t0+1, "n1", ssd("ssd0", 1<<20), []*pb.AdoptedObject{
		{Key: "a", Segment: "ssd0", Offset: 0, Size: 10, Checksum: 1, HardPinned: true, Parent: long, Tenant: edge},
		{Key: "b", Segment: "ssd0", Offset: 4096, Size: 10, Checksum: 2, SoftPinUntilUnixNano: t0 + 5, Parent: edge, Tenant: long},
		{Key: "c", Segment: "ssd0", Offset: 8192, Size: 10, Checksum: 3, Parent: "a", Tenant: "t"},
	})
	if r.Adopted != 3 {
		t.Fatalf("register = %+v, want 3 adopted", r)
	}
	for k, want := range map[string]meta{
		"a": {hard: true, tenant: edge},
		"b": {softPin: t0 + 5, parent: edge},
		"c": {parent: "a", tenant: "t"},
	} {
		if got := objectMeta(t, d.f, k); got != want {
			t.Errorf("%q: %.60v, want %.60v", k, got, want)
		}
	}
	if !maps.Equal(d.f.children, map[string]int{"a": 1, edge: 1}) {
		t.Errorf("children %d entries, want 2", len(d.f.children))
	}
	checkInvariants(t, d.f)
}

// TestFSMAdoptMergesPins: bytes adopted as a second replica of an object
// that lives elsewhere leave its parent key and tenant as they are, but
// the object takes the stronger of the two hard pins and the later soft pin.
func TestFSMAdoptMergesPins(t *testing.T) {
	tests := []struct {
		name        string
		have, offer meta
		want        meta
	}{
		{"no pins", meta{parent: "p", tenant: "t"}, meta{parent: "q", tenant: "u"}, meta{parent: "p", tenant: "t"}},
		{"offered hard pin", meta{}, meta{hard: true}, meta{hard: true}},
		{"kept hard pin", meta{hard: true}, meta{}, meta{hard: true}},
		{"later offered soft pin", meta{softPin: t0 + 5}, meta{softPin: t0 + 9}, meta{softPin: t0 + 9}},
		{"earlier offered soft pin", meta{softPin: t0 + 9}, meta{softPin: t0 + 5, hard: true}, meta{hard: true, softPin: t0 + 9}},
		{"metadata offered, none kept", meta{}, meta{parent: "q", tenant: "u"}, meta{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := newDriver(t)
			d.register(t0, "n1", "ep-n1", ssd("ssd0", 1<<20))
			seg2 := d.register(t0, "n2", "ep-n2", ssd("ssd0", 1<<20)).SegmentIDs[0]
			d.putWith(t0, "k", 300, tc.have.parent, tc.have.tenant, seg2)
			if tc.have.hard {
				if err := d.pin(t0, &pb.PinCmd{Key: "k", Hard: true}); err != nil {
					t.Fatal(err)
				}
			}
			if tc.have.softPin != 0 {
				if err := d.pin(t0, &pb.PinCmd{Key: "k", SoftUntilUnixNano: tc.have.softPin}); err != nil {
					t.Fatal(err)
				}
			}
			r := d.reregister(t0+1, "n1", ssd("ssd0", 1<<20), []*pb.AdoptedObject{{
				Key: "k", Segment: "ssd0", Offset: 0, Size: 300, Checksum: 300,
				HardPinned: tc.offer.hard, SoftPinUntilUnixNano: tc.offer.softPin, Parent: tc.offer.parent, Tenant: tc.offer.tenant,
			}})
			if r.Adopted != 1 || len(d.f.replicasOf([]string{"k"})[0].Replicas) != 2 {
				t.Fatalf("a matching copy did not become a replica: %+v", r)
			}
			if got := objectMeta(t, d.f, "k"); got != tc.want {
				t.Errorf("after adoption: %+v, want %+v", got, tc.want)
			}
			checkInvariants(t, d.f)
		})
	}
}

// TestFSMAdoptPages: a node registering with more kept objects than one
// command carries is closed to placement until its last page; pages adopt
// in its epoch only, and a page applied twice adopts nothing again.
func TestFSMAdoptPages(t *testing.T) {
	d := newDriver(t)
	d.register(t0, "n1", "ep", ssd("ssd0", 1<<20))
	kept := func(i int) *pb.AdoptedObject {
		return &pb.AdoptedObject{Key: fmt.Sprintf("k%d", i), Segment: "ssd0", Offset: uint64(i) * 4096, Size: 100, Checksum: uint32(i)}
	}
	r := d.apply(t0+1, &pb.Command{Op: &pb.Command_Register{Register: &pb.RegisterCmd{
		Node: "n1", Endpoint: "ep", Segments: []*pb.SegmentSpec{ssd("ssd0", 1<<20)},
		Adopt: []*pb.AdoptedObject{kept(0), kept(1)}, AdoptMore: true,
	}}}).(RegisterResult)
	if r.Adopted != 2 || r.Epoch != 2 {
		t.Fatalf("register = %+v", r)
	}
	if v := d.segment("n1/ssd0@2"); !v.adopting || !v.closed() {
		t.Fatalf("segment while adopting: %+v, want closed to placement", v)
	}
	page := func(epoch uint64, done bool, objs ...*pb.AdoptedObject) any {
		return d.apply(t0+2, &pb.Command{Op: &pb.Command_Adopt{Adopt: &pb.AdoptCmd{Node: "n1", Epoch: epoch, Objects: objs, Done: done}}})
	}
	if out := page(1, false, kept(2)); !errors.Is(out.(error), ErrUnknownNode) {
		t.Fatalf("a page for an old epoch: %v, want ErrUnknownNode", out)
	}
	if out := page(2, false, kept(2), kept(3)); out != 2 {
		t.Fatalf("second page adopted %v, want 2", out)
	}
	if out := page(2, false, kept(2), kept(3)); out != 0 {
		t.Fatalf("the same page again adopted %v, want 0", out)
	}
	if out := page(2, true, kept(4)); out != 1 {
		t.Fatalf("last page adopted %v, want 1", out)
	}
	if v := d.segment("n1/ssd0@2"); v.adopting || v.objects != 5 {
		t.Fatalf("segment after the last page: %+v, want open with 5 objects", v)
	}
	sameState(t, d.f, restored(t, snapshotBytes(t, d.f)))
}

// TestFSMSegmentObjectsPages: the objects of a segment come in key order,
// page by page.
func TestFSMSegmentObjectsPages(t *testing.T) {
	d := newDriver(t)
	seg := d.register(t0, "n1", "ep", ssd("ssd0", 1<<20)).SegmentIDs[0]
	for i := range 25 {
		d.put(t0, fmt.Sprintf("k%02d", i), 100, seg)
	}
	var got []string
	after := ""
	for pages := 0; ; pages++ {
		objs, more := d.f.segmentObjects(seg, "ssd0", after, 10)
		for _, o := range objs {
			got = append(got, o.Key)
		}
		if !more {
			if pages != 2 {
				t.Fatalf("%d pages of 10 for 25 objects", pages+1)
			}
			break
		}
		after = objs[len(objs)-1].Key
	}
	if len(got) != 25 || got[0] != "k00" || got[24] != "k24" {
		t.Fatalf("paged objects %v", got)
	}
}
