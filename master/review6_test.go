package master

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestReview6RefusedPutReclaimsNothing: Apply drops written-back replicas
// to make room for a PutStart item only when the item will allocate
// (allocates: "an existing or in-progress key does not, and must not cost
// any reclaimed replica"). Since records hold their key and parent in a
// uint16-sized tail, putStart refuses a key or parent longer than
// MaxKeyLen; allocates does not know that, so such an item, which
// allocates nothing, still costs the replicas it reclaims.
func TestReview6RefusedPutReclaimsNothing(t *testing.T) {
	long := strings.Repeat("k", MaxKeyLen+1)
	for _, tc := range []struct{ name, key, parent string }{
		{"long key", long, ""},
		{"long parent", "child", long},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newDriver(t)
			hot := d.register(t0, "n1", "ep1", dram("a", 4096)).SegmentIDs[0]
			cold := d.register(t0, "n2", "ep2", ssd("b", 1<<20)).SegmentIDs[0]
			// "wb" fills the DRAM segment and is written back to SSD.
			r := d.apply(t0, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{{
				Key: "wb", Size: 4096, Checksum: 1, Candidates: []string{hot, cold}, Replicas: 2, DeadlineUnixNano: t0 + 1e9,
			}}}}}).([]PutStartResult)[0]
			if r.Err != nil || len(r.Replicas) != 2 {
				t.Fatalf("setup: %+v", r)
			}
			if err := d.putEnd(t0, "wb"); err != nil {
				t.Fatal(err)
			}
			out := d.apply(t0+1, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{
				Items:   []*pb.PutStartItem{{Key: tc.key, Parent: tc.parent, Size: 100, Checksum: 1, Candidates: []string{hot}, DeadlineUnixNano: t0 + 1e9}},
				Reclaim: []*pb.Reclaimable{{Key: "wb", Segment: hot}},
			}}}).([]PutStartResult)[0]
			if !errors.Is(out.Err, ErrInvalidRequest) {
				t.Fatalf("put of an unrecordable item: %+v, want ErrInvalidRequest", out)
			}
			if got := replicaSegments(d.f, "wb"); out.Reclaimed != 0 || len(got) != 2 {
				t.Errorf("a refused put reclaimed %d replicas: wb is left on %v, was on [%s %s]", out.Reclaimed, got, hot, cold)
			}
			checkInvariants(t, d.f)
		})
	}
}

// TestReview6RecordLayout: the record is cast from a []uint64, which the
// collector never scans, so it must hold no Go pointer; its atomics must
// sit on 8-byte boundaries; and a key or parent of up to MaxKeyLen must
// fit its uint16 lengths. Keys and parents of boundary lengths read back
// exactly (under -race this also runs checkptr on the casts).
func TestReview6RecordLayout(t *testing.T) {
	var walk func(typ reflect.Type, path string)
	walk = func(typ reflect.Type, path string) {
		switch typ.Kind() {
		case reflect.Struct:
			for i := range typ.NumField() {
				walk(typ.Field(i).Type, path+"."+typ.Field(i).Name)
			}
		case reflect.Array:
			walk(typ.Elem(), path+"[]")
		case reflect.Pointer, reflect.UnsafePointer, reflect.Map, reflect.Slice, reflect.String, reflect.Interface, reflect.Func, reflect.Chan:
			t.Errorf("object field %s is a %s: the collector does not scan records", path, typ.Kind())
		}
	}
	walk(reflect.TypeFor[object](), "object")
	var o object
	if objectHeader%8 != 0 || unsafe.Offsetof(o.used)%8 != 0 || unsafe.Offsetof(o.lease)%8 != 0 || unsafe.Alignof(o) != 8 || objectHeader != 64 {
		t.Errorf("header %d bytes, used at %d, lease at %d, align %d", objectHeader, unsafe.Offsetof(o.used), unsafe.Offsetof(o.lease), unsafe.Alignof(o))
	}
	if MaxKeyLen > math.MaxUint16 {
		t.Errorf("MaxKeyLen %d does not fit the record's uint16 lengths", MaxKeyLen)
	}
	for _, n := range [][2]int{{1, 0}, {1, 1}, {7, 0}, {8, 0}, {8, 8}, {9, 7}, {16, 0}, {MaxKeyLen, 0}, {MaxKeyLen, MaxKeyLen}} {
		key, parent := strings.Repeat("k", n[0]-1)+"K", strings.Repeat("p", max(n[1]-1, 0))+strings.Repeat("P", min(n[1], 1))
		o := allocObject(key, parent)
		o.used.Store(-1)
		o.lease.Store(-1)
		o.flags = flagGone | flagHasRare | flagHard
		if o.key() != key || o.parent() != parent {
			t.Errorf("record of a %d-byte key and %d-byte parent reads back %d and %d bytes", n[0], n[1], len(o.key()), len(o.parent()))
		}
	}
}

// TestReview6LongKeysRefused: no command and no snapshot can make a record
// of a key or parent longer than MaxKeyLen (in particular none whose
// length wraps the uint16, which would truncate it silently); keys and
// parents of exactly MaxKeyLen survive a snapshot round trip.
func TestReview6LongKeysRefused(t *testing.T) {
	d := newDriver(t)
	seg := d.register(t0, "n1", "ep1", dram("a", 1<<20)).SegmentIDs[0]
	edge := strings.Repeat("e", MaxKeyLen)
	d.putWith(t0, edge, 64, strings.Repeat("p", MaxKeyLen), "t", seg)
	for _, n := range []int{MaxKeyLen + 1, 1<<16 + 3} {
		long := strings.Repeat("x", n)
		for _, it := range []*pb.PutStartItem{{Key: long}, {Key: "short", Parent: long}} {
			it.Size, it.Candidates, it.DeadlineUnixNano = 64, []string{seg}, t0+1e9
			r := d.apply(t0, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{it}}}}).([]PutStartResult)[0]
			if !errors.Is(r.Err, ErrInvalidRequest) {
				t.Errorf("put start of a %d-byte key and %d-byte parent: %+v", len(it.Key), len(it.Parent), r)
			}
		}
		res := d.r6Reserve(t0, seg, 4096)
		for _, it := range []*pb.PublishItem{{Key: long}, {Key: "short", Parent: long}} {
			it.Size, it.Replicas, it.Reservations = 64, []*pb.Extent{{Segment: seg, Offset: res.Spans[0].off}}, []uint64{res.ID}
			if err := d.apply(t0, &pb.Command{Op: &pb.Command_Publish{Publish: &pb.PublishCmd{Items: []*pb.PublishItem{it}}}}).([]error)[0]; !errors.Is(err, ErrInvalidRequest) {
				t.Errorf("publish of a %d-byte key and %d-byte parent: %v", len(it.Key), len(it.Parent), err)
			}
		}
	}
	// The same publish of a short key and parent is taken.
	res := d.r6Reserve(t0, seg, 4096)
	ok := &pb.PublishItem{Key: "short", Parent: "p", Size: 64, Replicas: []*pb.Extent{{Segment: seg, Offset: res.Spans[0].off}}, Reservations: []uint64{res.ID}}
	if err := d.apply(t0, &pb.Command{Op: &pb.Command_Publish{Publish: &pb.PublishCmd{Items: []*pb.PublishItem{ok}}}}).([]error)[0]; err != nil {
		t.Fatalf("publish of a short key: %v", err)
	}
	if keys := listKeys(d.f); len(keys) != 2 || keys[0] != edge || keys[1] != "short" {
		t.Fatalf("objects after the refused commands: %d", len(keys))
	}
	data := snapshotBytes(t, d.f)
	g := restored(t, data)
	sameState(t, d.f, g)
	if !bytes.Equal(snapshotBytes(t, g), data) {
		t.Error("a restored FSM snapshots differently")
	}
	// A snapshot naming a longer key or parent is refused, not truncated.
	var snap pb.Snapshot
	if err := proto.Unmarshal(data, &snap); err != nil {
		t.Fatal(err)
	}
	bad := proto.Clone(snap.Objects[0]).(*pb.Object)
	bad.Key, bad.Replicas[0].Offset = strings.Repeat("y", 1<<16+1), 4096
	snap.Objects = append(snap.Objects, bad)
	data, _ = proto.Marshal(&snap)
	h := NewFSM()
	if err := h.Restore(io.NopCloser(bytes.NewReader(data))); err == nil {
		t.Error("restore of a 65537-byte key succeeded")
	}
	if keys := listKeys(h); len(keys) != 2 {
		t.Errorf("restored objects: %d, want the 2 recordable ones", len(keys))
	}
}

func (d *fsmDriver) r6Reserve(now int64, seg string, n uint64) ReserveResult {
	d.t.Helper()
	r := d.apply(now, &pb.Command{Op: &pb.Command_Reserve{Reserve: &pb.ReserveCmd{Segment: seg, Bytes: n, MinSpan: n,
		AllocUntilUnixNano: now + 1e9, ReleaseAfterUnixNano: now + 2e9}}}).(ReserveResult)
	if r.Err != nil {
		d.t.Fatalf("reserve: %v", r.Err)
	}
	return r
}

// TestReview6KeyStringsOutliveRecords: the strings a record hands out (its
// key, its parent, the FSM's child counts keyed by them) point into it.
// Once the objects are gone from the table and their memory is reused,
// the strings still read what they did: they keep their records alive.
// And once nothing holds them, records are collected: nothing in the FSM
// (table slots, the rare map, the in-flight and copying sets) keeps a
// removed object's record.
func TestReview6KeyStringsOutliveRecords(t *testing.T) {
	d := newDriver(t)
	hot := d.register(t0, "n1", "ep1", dram("a", 1<<24)).SegmentIDs[0]
	cold := d.register(t0, "n2", "ep2", ssd("b", 1<<26)).SegmentIDs[0]
	const n = 600
	name := func(i int) string { return fmt.Sprintf("%0*d", 1+i%97, i) }
	var collected atomic.Int64
	wantParent := map[string]string{}
	for i := range n {
		parent := ""
		if i > 0 {
			parent = name(i - 1)
		}
		wantParent[name(i)] = parent
		cands := []string{hot, cold}
		r := d.apply(t0, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{{
			Key: name(i), Parent: parent, Tenant: fmt.Sprint("t", i%3), Size: 64, Checksum: 1, Candidates: cands,
			Replicas: uint32(1 + i%2), DeadlineUnixNano: t0 + 1e9,
		}}}}}).([]PutStartResult)[0]
		if r.Err != nil {
			t.Fatal(r.Err)
		}
		if i%3 != 0 {
			if err := d.putEnd(t0, name(i)); err != nil {
				t.Fatal(err)
			}
		}
		if i%5 == 1 {
			d.pin(t0, &pb.PinCmd{Key: name(i), SoftUntilUnixNano: t0 + 1e12})
		}
		if i%7 == 2 && i%3 != 0 && i%2 == 0 { // complete, on one replica
			d.startCopy(t0, name(i), hot, promote, t0+1e9, cold)
		}
	}
	var keys, parents, childKeys []string
	func() {
		d.f.mu.RLock()
		defer d.f.mu.RUnlock()
		for k, o := range d.f.objects.all() {
			keys, parents = append(keys, k), append(parents, o.parent())
			runtime.AddCleanup(o, func(int) { collected.Add(1) }, 0)
		}
		for k := range d.f.children {
			childKeys = append(childKeys, k)
		}
	}()
	for i := range n {
		d.apply(t0+1, &pb.Command{Op: &pb.Command_PutRevoke{PutRevoke: &pb.KeysCmd{Keys: []string{name(i)}}}})
		d.apply(t0+1, &pb.Command{Op: &pb.Command_Remove{Remove: &pb.RemoveCmd{Keys: []string{name(i)}}}})
	}
	if d.f.objects.len() != 0 || len(d.f.rares) != 0 || len(d.f.inFlight) != 0 || len(d.f.copying) != 0 || len(d.f.children) != 0 {
		t.Fatalf("after removing everything: %d objects, %d rare parts, %d in flight, %d copying, %d parents",
			d.f.objects.len(), len(d.f.rares), len(d.f.inFlight), len(d.f.copying), len(d.f.children))
	}
	// Churn memory of the records' size classes so freed ones are reused.
	for range 3 {
		var junk [][]uint64
		for i := range 4 * n {
			w := make([]uint64, (int(objectHeader)+2*(1+i%97)+7)/8)
			for j := range w {
				w[j] = math.MaxUint64
			}
			junk = append(junk, w)
		}
		runtime.GC()
		runtime.KeepAlive(junk)
	}
	if len(keys) != n {
		t.Fatalf("%d keys read from the table, want %d", len(keys), n)
	}
	seen := map[string]bool{}
	for i, k := range keys {
		want, ok := wantParent[k]
		if !ok || seen[k] || parents[i] != want {
			t.Fatalf("after its record left the table, key %q (%v) reads parent %q, want %q", k, ok, parents[i], want)
		}
		seen[k] = true
	}
	for _, k := range childKeys {
		if !seen[k] {
			t.Fatalf("a child count's key reads %q", k)
		}
	}
	runtime.KeepAlive(keys)
	runtime.KeepAlive(parents)
	runtime.KeepAlive(childKeys)
	keys, parents, childKeys = nil, nil, nil
	clear(seen)
	for i := 0; i < 1000 && collected.Load() < n; i++ {
		runtime.GC()
		runtime.Gosched()
	}
	if got := collected.Load(); got != n {
		t.Errorf("%d of %d removed objects' records were collected", got, n)
	}
	runtime.KeepAlive(d.f)
}

// r6Records checks what the compact records must keep true besides the
// accounting checkInvariants verifies: every object of the table has a
// rare part exactly when FSM.rares holds one for it, never an empty one,
// and FSM.rares holds nothing else (no entry left for an object retired,
// replaced or dropped by a Restore); several replicas live in the rare
// part with the inline one cleared, one lives inline; tenant indices are
// interned; every live segment is at its index and no stale one is.
func r6Records(t testing.TB, f *FSM) {
	t.Helper()
	f.mu.RLock()
	defer f.mu.RUnlock()
	withRare := 0
	for k, o := range f.objects.all() {
		if o.key() != k || o.gone() {
			t.Fatalf("object %q in the table: key %q, gone %v", k, o.key(), o.gone())
		}
		r, in := f.rares[o]
		if o.hasRare() != in || (in && (r == nil || r.empty())) {
			t.Fatalf("object %q: hasRare %v, rare part %v %+v", k, o.hasRare(), in, r)
		}
		if in {
			withRare++
		}
		if in && len(r.more) > 0 {
			if len(r.more) < 2 || o.one[0] != (extent{}) {
				t.Fatalf("object %q: rare replicas %v, inline %v", k, r.more, o.one)
			}
		} else if o.one[0].seg == 0 {
			t.Fatalf("object %q has no replica", k)
		}
		if int(o.tenant) >= len(f.tenantAt) || (o.tenant != 0 && in && r.tenant != "") {
			t.Fatalf("object %q: tenant index %d of %d, and a rare tenant", k, o.tenant, len(f.tenantAt))
		}
	}
	if withRare != len(f.rares) {
		t.Fatalf("FSM.rares holds %d entries; %d objects of the table have a rare part", len(f.rares), withRare)
	}
	live := 0
	for i, s := range f.segAt {
		if s == nil {
			continue
		}
		live++
		if s.idx != uint32(i) || f.segments[s.id] != s {
			t.Fatalf("segAt[%d] holds segment %s (index %d), not the live one", i, s.id, s.idx)
		}
	}
	if f.segAt[0] != nil || live != len(f.segments) {
		t.Fatalf("segAt holds %d segments, %d are live", live, len(f.segments))
	}
}

// r6Accounting is disjoint, then checkInvariants with the reserved spans
// (the random stream reserves, and checkInvariants does not count them)
// taken out of each segment's used bytes and capacity for the check.
func r6Accounting(t testing.TB, f *FSM) {
	t.Helper()
	if err := disjoint(f); err != nil {
		t.Fatal(err)
	}
	reserved := map[*segment]uint64{}
	for _, s := range f.segments {
		reserved[s] = s.reserved()
		s.alloc.used -= reserved[s]
		s.alloc.capacity -= reserved[s]
	}
	defer func() {
		for s, r := range reserved {
			s.alloc.used += r
			s.alloc.capacity += r
		}
	}()
	checkInvariants(t, f)
}

func r6Apply(t testing.TB, f *FSM, index uint64, c *pb.Command) string {
	t.Helper()
	data, err := proto.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprint(f.Apply(&raft.Log{Index: index, Term: 1, Data: data}))
}

func r6Parse(t testing.TB, f *FSM) *pb.Snapshot {
	t.Helper()
	var snap pb.Snapshot
	if err := proto.Unmarshal(snapshotBytes(t, f), &snap); err != nil {
		t.Fatal(err)
	}
	return &snap
}

// TestReview6RandomDeterminism: two FSMs fed the same log, and FSMs
// restored from the first's snapshot along the way, return the same
// results and reach the same state, queries and snapshot bytes, through
// every kind of command (several replicas gained and lost by copies,
// moves, drops, adoption and node restarts; segments registered twice in
// one command; pins, copies and deadlines coming and going in the rare
// part); and the records stay consistent with FSM.rares, the segment
// index and the accounting after every command.
func TestReview6RandomDeterminism(t *testing.T) {
	for seed := range uint64(8) {
		a, b := NewFSM(), NewFSM()
		var c *FSM
		next := r6Gen(seed, func() *pb.Snapshot { return r6Parse(t, a) })
		for i := range 1200 {
			cmd := next(i)
			if i%400 == 200 {
				c = restored(t, snapshotBytes(t, a))
				r6Records(t, c)
				sameState(t, a, c)
			}
			ra := r6Apply(t, a, uint64(i+1), cmd)
			if rb := r6Apply(t, b, uint64(i+1), cmd); ra != rb {
				t.Fatalf("seed %d command %d (%v): %s vs %s", seed, i, cmd, ra, rb)
			}
			if c != nil {
				if rc := r6Apply(t, c, uint64(i+1), cmd); rc != ra {
					t.Fatalf("seed %d command %d (%v): the restored FSM returned %s, want %s", seed, i, cmd, rc, ra)
				}
			}
			r6Records(t, a)
			r6Accounting(t, a)
			if c != nil {
				r6Records(t, c)
			}
		}
		sameState(t, a, b)
		sameState(t, a, c)
		if sa, sc := snapshotBytes(t, a), snapshotBytes(t, c); !bytes.Equal(sa, snapshotBytes(t, b)) || !bytes.Equal(sa, sc) {
			t.Fatalf("seed %d: the FSMs snapshot differently", seed)
		}
	}
}

// TestReview6ReplicaTransitions walks one object through every change of
// its replica count: a promotion copy (one to two), a corrupt replica
// dropped (two to one), adoption of a kept copy (one to two), the node of
// one replica restarting (two to one), a demotion move (still one), a
// reclaim of its written-back DRAM replica (two to one). Each step keeps
// the inline replica and the rare part consistent, and the state restores.
func TestReview6ReplicaTransitions(t *testing.T) {
	d := newDriver(t)
	d.register(t0, "n1", "ep1", dram("a", 8192), ssd("b", 1<<16))
	d.register(t0, "n2", "ep2", ssd("b", 1<<16))
	now := t0
	step := func(what string, want ...string) {
		t.Helper()
		now++
		r6Records(t, d.f)
		checkInvariants(t, d.f)
		if got := replicaSegments(d.f, "k"); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("%s: k on %v, want %v", what, got, want)
		}
		sameState(t, d.f, restored(t, snapshotBytes(t, d.f)))
	}
	d.put(now, "k", 100, "n2/b@1")
	d.pin(now, &pb.PinCmd{Key: "k", SoftUntilUnixNano: t0 + 1e12}) // a rare part that outlives the replicas'
	step("put", "n2/b@1")
	c := d.startCopy(now, "k", "n2/b@1", promote, now+1e9, "n1/a@1")
	if r := d.copyEnd(now, 0, &pb.CopyEndItem{Key: "k", CopyId: c.Id})[0]; !r.Done {
		t.Fatalf("promotion: %+v", r)
	}
	step("promoted", "n1/a@1", "n2/b@1")
	if !d.dropReplica(now, &pb.DropReplicaCmd{Key: "k", Segment: "n2/b@1", Checksum: 100, KeepLast: true}) {
		t.Fatal("drop refused")
	}
	step("dropped", "n1/a@1")
	// n2 restarts and offers back the bytes it kept.
	d.reregister(now, "n2", ssd("b", 1<<16), []*pb.AdoptedObject{{Key: "k", Segment: "b", Offset: 0, Size: 100, Checksum: 100}})
	step("adopted", "n1/a@1", "n2/b@2")
	d.register(now, "n1", "ep1", dram("a", 8192), ssd("b", 1<<16)) // n1 restarts: its DRAM replica is gone
	step("n1 restarted", "n2/b@2")
	c = d.startCopy(now, "k", "n2/b@2", demote, now+1e9, "n1/b@2")
	if r := d.copyEnd(now, 0, &pb.CopyEndItem{Key: "k", CopyId: c.Id})[0]; !r.Done {
		t.Fatalf("move: %+v", r)
	}
	step("moved", "n1/b@2")
	c = d.startCopy(now, "k", "n1/b@2", promote, now+1e9, "n1/a@2")
	d.copyEnd(now, 0, &pb.CopyEndItem{Key: "k", CopyId: c.Id})
	step("promoted again", "n1/a@2", "n1/b@2")
	// A put that needs all of n1's DRAM reclaims k's written-back copy there.
	r := d.apply(now, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{
		Items:   []*pb.PutStartItem{{Key: "big", Size: 8192, Checksum: 1, Candidates: []string{"n1/a@2"}, DeadlineUnixNano: now + 1e9}},
		Reclaim: []*pb.Reclaimable{{Key: "k", Segment: "n1/a@2"}},
	}}}).([]PutStartResult)[0]
	if r.Err != nil || r.Reclaimed != 1 {
		t.Fatalf("reclaiming put: %+v", r)
	}
	step("reclaimed", "n1/b@2")
	if err := d.remove(now, "k", 0); err != nil {
		t.Fatal(err)
	}
	if d.revoke(now, "big") != nil || len(d.f.rares) != 0 || d.f.objects.len() != 0 {
		t.Fatalf("after removing everything: %d rare parts, %d objects", len(d.f.rares), d.f.objects.len())
	}
}

// TestReview6TenantsBeyondInterned: tenants past the interned ones keep
// their name in the rare part; every object answers its own tenant, the
// state restores (where other names are interned) to the same answers,
// and removing the objects leaves no rare part behind.
func TestReview6TenantsBeyondInterned(t *testing.T) {
	d := newDriver(t)
	seg := d.register(t0, "n1", "ep1", dram("a", 1<<30)).SegmentIDs[0]
	const n = maxTenants + 40
	for i := n - 1; i >= 0; i-- { // interned from the last key; a restore interns from the first
		d.putWith(t0, fmt.Sprintf("k%05d", i), 64, "", fmt.Sprintf("tenant%05d", n-i), seg)
	}
	g := restored(t, snapshotBytes(t, d.f))
	if d.f.objects.get("k00000").hasRare() == g.objects.get("k00000").hasRare() {
		t.Fatal("setup: the restored FSM interned the same tenants")
	}
	for _, f := range []*FSM{d.f, g} {
		r6Records(t, f)
		for _, info := range f.infos([]string{"k00000", "k04095", "k04096", fmt.Sprintf("k%05d", n-1)}) {
			var i int
			fmt.Sscanf(info.Key, "k%d", &i)
			if want := fmt.Sprintf("tenant%05d", n-i); info.Tenant != want {
				t.Errorf("%s: tenant %q, want %q", info.Key, info.Tenant, want)
			}
		}
	}
	sameState(t, d.f, g)
	for i := range n {
		if err := d.remove(t0+1, fmt.Sprintf("k%05d", i), 0); err != nil {
			t.Fatal(err)
		}
	}
	if len(d.f.rares) != 0 {
		t.Errorf("%d rare parts left after every object was removed", len(d.f.rares))
	}
}

// TestReview6TableChurnWrap: keys crowded into one shard of a given size,
// with homes in its last two and first two slots, so probe runs wrap
// around the end and removals shift entries back across it (a key whose
// home lies before the hole must move, one whose home lies between the
// hole and it must not); after every operation the table answers every
// key as a map does, and its counts agree.
func TestReview6TableChurnWrap(t *testing.T) {
	for round := range 30 {
		size := 8 << (round % 3)
		tab := newObjectTable()
		var pool []string // fewer than three quarters of size: the shard never outgrows it
		for i := 0; len(pool) < size*3/4-1; i++ {
			k := fmt.Sprintf("r%d/%d", round, i)
			if s, _, h := tab.hash(k); s == &tab.shards[0] && (int(h)+2)&(size-1) < 4 {
				pool = append(pool, k)
			}
		}
		rng := rand.New(rand.NewPCG(uint64(round), 9))
		want := map[string]*object{}
		for step := range 3000 {
			k := pool[rng.IntN(len(pool))]
			if rng.IntN(2) == 0 {
				o := allocObject(k, "")
				tab.put(o)
				want[k] = o
			} else {
				tab.remove(k)
				delete(want, k)
			}
			for _, k := range pool {
				if tab.get(k) != want[k] {
					t.Fatalf("round %d step %d: get(%q) is not what was put", round, step, k)
				}
			}
			if tab.len() != len(want) || tab.shards[0].n != len(want) {
				t.Fatalf("round %d step %d: len %d, shard %d, want %d", round, step, tab.len(), tab.shards[0].n, len(want))
			}
		}
		if len(tab.shards[0].slots) != size {
			t.Fatalf("round %d: the shard grew to %d slots, meant to stay at %d", round, len(tab.shards[0].slots), size)
		}
	}
}

// TestReview6ReadersDuringApply: lookups, gets and the leader's scans
// read records (and lease them without the lock) while Apply changes
// them and Restore replaces the table; under -race this checks that no
// access to a record or to FSM.rares and the segment index escapes the
// lock, and checkptr checks the record casts.
func TestReview6ReadersDuringApply(t *testing.T) {
	a := NewFSM()
	next := r6Gen(1, func() *pb.Snapshot { return r6Parse(t, a) })
	stop := make(chan struct{})
	var wg sync.WaitGroup
	keys := []string{"key01", "key02", "key03", "key04", "key05", "key06"}
	for g := range 2 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				objs := a.prefix(keys)
				got := a.complete(keys)
				for _, o := range got {
					if o != nil {
						o.leaseUntil(t0, t0+1, true)
					}
				}
				a.lookup(objs, t0, t0)
				a.replicas(keys, got, t0, access{})
				if g == 0 {
					a.list("", "", 100)
					a.completeObjects(func(string) bool { return true })
					a.nodeStates(func(*node) bool { return true })
					for _, v := range a.segmentViews() {
						a.segmentObjects(v.id, "b", "", 10)
					}
					a.expiredCopies(t0 + 1e12)
					a.expiredPuts(t0 + 1e12)
					a.childrenOf("key01", 10)
				}
			}
		})
	}
	for i := range 800 {
		r6Apply(t, a, uint64(i+1), next(i))
		if i%200 == 199 {
			if err := a.Restore(io.NopCloser(bytes.NewReader(snapshotBytes(t, a)))); err != nil {
				t.Error(err)
			}
		}
	}
	close(stop)
	wg.Wait()
}

// r6Gen returns a reproducible stream of commands of every kind over five
// nodes (re-registrations with kept objects, drains, downs), thirty keys
// with parents and tenants, puts of up to three replicas, copies, drops,
// pins, evictions, reservations and publishes. look, when set, shows the stream the state of the FSM it
// feeds, so that copies and drops mostly name real replicas; every FSM fed
// the stream gets the same commands.
func r6Gen(seed uint64, look func() *pb.Snapshot) func(i int) *pb.Command {
	rng := rand.New(rand.NewPCG(seed, seed^0x1234567))
	nodes := []string{"n0", "n1", "n2", "n3", "n4"}
	names := []string{"a", "b", "c", "d"}
	tiers := map[string]pb.Tier{"a": pb.Tier_TIER_DRAM, "b": pb.Tier_TIER_SSD, "c": pb.Tier_TIER_DRAM, "d": pb.Tier_TIER_SSD}
	epoch := map[string]uint64{}
	someEpoch := func(node string) uint64 {
		if rng.IntN(6) == 0 {
			return uint64(rng.IntN(int(epoch[node]) + 2))
		}
		return epoch[node]
	}
	seg := func() string {
		node := nodes[rng.IntN(len(nodes))]
		return SegmentID(node, names[rng.IntN(len(names))], someEpoch(node))
	}
	key := func() string { return fmt.Sprintf("key%02d", rng.IntN(30)) }
	keys := func(k int) []string {
		out := make([]string, k)
		for i := range out {
			out[i] = key()
		}
		return out
	}
	parent := func() string {
		if rng.IntN(2) == 0 {
			return ""
		}
		return key()
	}
	tenant := func() string {
		if rng.IntN(3) == 0 {
			return ""
		}
		return fmt.Sprintf("t%d", rng.IntN(maxTenants+50))
	}
	var copyIDs []uint64
	var copyKeys []string
	var resv []uint64
	now := t0
	return func(i int) *pb.Command {
		index := uint64(i + 1)
		now += rng.Int64N(40)
		c := &pb.Command{NowUnixNano: now}
		switch p := rng.IntN(100); {
		case i < len(nodes) || p < 3:
			node := nodes[rng.IntN(len(nodes))]
			if i < len(nodes) {
				node = nodes[i]
			}
			epoch[node]++
			var specs []*pb.SegmentSpec
			ns := names[:1+rng.IntN(4)]
			if rng.IntN(8) == 0 {
				ns = append(ns, ns[0])
			}
			for _, name := range ns {
				specs = append(specs, &pb.SegmentSpec{Name: name, Tier: tiers[name], Capacity: uint64(16384 + rng.IntN(4)*8192)})
			}
			r := &pb.RegisterCmd{Node: node, Endpoint: node + ":1", Segments: specs, AdoptMore: rng.IntN(4) == 0}
			for range rng.IntN(5) {
				r.Adopt = append(r.Adopt, &pb.AdoptedObject{Key: key(), Segment: "b", Offset: uint64(rng.IntN(4)) * 4096, Size: uint64(1 + rng.IntN(5000)),
					Checksum: uint32(rng.IntN(3)), HardPinned: rng.IntN(4) == 0, SoftPinUntilUnixNano: now + rng.Int64N(300) - 100, Parent: parent(), Tenant: tenant()})
			}
			c.Op = &pb.Command_Register{Register: r}
		case p < 5:
			node := nodes[rng.IntN(len(nodes))]
			c.Op = &pb.Command_NodeDown{NodeDown: &pb.NodeDownCmd{Node: node, Epoch: someEpoch(node), Drained: rng.IntN(3) == 0}}
		case p < 6:
			node := nodes[rng.IntN(len(nodes))]
			a := &pb.AdoptCmd{Node: node, Epoch: someEpoch(node), Done: rng.IntN(2) == 0}
			for range rng.IntN(4) {
				a.Objects = append(a.Objects, &pb.AdoptedObject{Key: key(), Segment: "b", Offset: uint64(rng.IntN(4)) * 4096, Size: uint64(1 + rng.IntN(5000)),
					Checksum: uint32(rng.IntN(3)), Parent: parent(), Tenant: tenant()})
			}
			c.Op = &pb.Command_Adopt{Adopt: a}
		case p < 7:
			c.Op = &pb.Command_Drain{Drain: &pb.DrainCmd{Node: nodes[rng.IntN(len(nodes))], Cancel: rng.IntN(3) == 0}}
		case p < 30:
			cmd := &pb.PutStartCmd{}
			for range 1 + rng.IntN(3) {
				var cands []string
				for range rng.IntN(6) {
					cands = append(cands, seg())
				}
				cmd.Items = append(cmd.Items, &pb.PutStartItem{
					Key: key(), Size: uint64(rng.IntN(6000)), Checksum: uint32(rng.IntN(3)),
					Candidates: cands, DeadlineUnixNano: now + rng.Int64N(200), Replicas: uint32(rng.IntN(4)),
					Parent: parent(), Tenant: tenant(),
				})
			}
			for range rng.IntN(3) {
				cmd.Reclaim = append(cmd.Reclaim, &pb.Reclaimable{Key: key(), Segment: seg()})
			}
			c.Op = &pb.Command_PutStart{PutStart: cmd}
		case p < 45:
			c.Op = &pb.Command_PutEnd{PutEnd: &pb.KeysCmd{Keys: keys(1 + rng.IntN(3))}}
		case p < 48:
			c.Op = &pb.Command_PutRevoke{PutRevoke: &pb.KeysCmd{Keys: keys(1 + rng.IntN(2)), OnlyExpired: rng.IntN(2) == 0}}
		case p < 53:
			c.Op = &pb.Command_Remove{Remove: &pb.RemoveCmd{Keys: keys(1), FreeAfterUnixNano: now - 100 + rng.Int64N(400)}}
		case p < 57:
			c.Op = &pb.Command_Pin{Pin: &pb.PinCmd{Key: key(), Hard: rng.IntN(3) == 0, SoftUntilUnixNano: now + rng.Int64N(500), Unpin: rng.IntN(4) == 0}}
		case p < 60:
			c.Op = &pb.Command_Evict{Evict: &pb.EvictCmd{Keys: keys(1 + rng.IntN(2)), FreeAfterUnixNano: now - 100 + rng.Int64N(400), AllowSoftPinned: rng.IntN(2) == 0}}
		case p < 64 && look != nil && rng.IntN(2) == 0:
			snap := look()
			if len(snap.Objects) == 0 {
				c.Op = &pb.Command_Member{Member: &pb.MemberCmd{Id: "x", Address: "x"}}
				break
			}
			o := snap.Objects[rng.IntN(len(snap.Objects))]
			c.Op = &pb.Command_DropReplica{DropReplica: &pb.DropReplicaCmd{Key: o.Key, Segment: o.Replicas[rng.IntN(len(o.Replicas))].Segment, Checksum: o.Checksum,
				FreeAfterUnixNano: now - 50 + rng.Int64N(200), KeepLast: rng.IntN(3) != 0}}
		case p < 64:
			c.Op = &pb.Command_DropReplica{DropReplica: &pb.DropReplicaCmd{Key: key(), Segment: seg(), Checksum: uint32(rng.IntN(3)),
				FreeAfterUnixNano: now - 50 + rng.Int64N(200), KeepLast: rng.IntN(3) != 0}}
		case p < 66:
			d := &pb.DropReplicasCmd{}
			for range 1 + rng.IntN(3) {
				d.Items = append(d.Items, &pb.DropReplicaCmd{Key: key(), Segment: seg(), Checksum: uint32(rng.IntN(3)),
					FreeAfterUnixNano: now - 50 + rng.Int64N(200), KeepLast: rng.IntN(3) != 0})
			}
			c.Op = &pb.Command_DropReplicas{DropReplicas: d}
		case p < 78 && look != nil && rng.IntN(3) != 0:
			snap := look()
			var objs []*pb.Object
			for _, o := range snap.Objects {
				if o.State == pb.ObjectState_OBJECT_STATE_COMPLETE {
					objs = append(objs, o)
				}
			}
			if len(objs) == 0 {
				c.Op = &pb.Command_Member{Member: &pb.MemberCmd{Id: "x", Address: "x"}}
				break
			}
			cs := &pb.CopyStartCmd{}
			for j := range 1 + rng.IntN(2) {
				o := objs[rng.IntN(len(objs))]
				var cands []string
				for range 1 + rng.IntN(4) {
					cands = append(cands, seg())
				}
				copyKeys = append(copyKeys, o.Key)
				cs.Items = append(cs.Items, &pb.CopyStartItem{Key: o.Key, Source: o.Replicas[rng.IntN(len(o.Replicas))].Segment, Candidates: cands, PutId: o.PutId,
					DeadlineUnixNano: now + rng.Int64N(300), Reason: pb.CopyReason(1 + rng.IntN(4))})
				copyIDs = append(copyIDs, index<<16|uint64(j))
			}
			c.Op = &pb.Command_CopyStart{CopyStart: cs}
		case p < 78:
			cs := &pb.CopyStartCmd{}
			for j := range 1 + rng.IntN(3) {
				var cands []string
				for range 1 + rng.IntN(4) {
					cands = append(cands, seg())
				}
				ck := key()
				copyKeys = append(copyKeys, ck)
				cs.Items = append(cs.Items, &pb.CopyStartItem{Key: ck, Source: seg(), Candidates: cands,
					DeadlineUnixNano: now + rng.Int64N(300), Reason: pb.CopyReason(1 + rng.IntN(4))})
				copyIDs = append(copyIDs, index<<16|uint64(j))
			}
			c.Op = &pb.Command_CopyStart{CopyStart: cs}
		case p < 88 && len(copyIDs) > 0:
			ce := &pb.CopyEndCmd{FreeAfterUnixNano: now - 50 + rng.Int64N(200)}
			for range 1 + rng.IntN(3) {
				ci := len(copyIDs) - 1 - rng.IntN(min(len(copyIDs), 6))
				ce.Items = append(ce.Items, &pb.CopyEndItem{Key: copyKeys[ci], CopyId: copyIDs[ci], Failed: rng.IntN(5) == 0, OnlyExpired: rng.IntN(5) == 0})
			}
			c.Op = &pb.Command_CopyEnd{CopyEnd: ce}
		case p < 92:
			c.Op = &pb.Command_Reserve{Reserve: &pb.ReserveCmd{Segment: seg(), Bytes: uint64(1 + rng.IntN(20000)), MinSpan: uint64(1 + rng.IntN(5000)),
				AllocUntilUnixNano: now + 100, ReleaseAfterUnixNano: now + rng.Int64N(300)}}
			resv = append(resv, index)
		case p < 96 && len(resv) > 0:
			pc := &pb.PublishCmd{}
			for range 1 + rng.IntN(2) {
				it := &pb.PublishItem{Key: key(), Size: uint64(1 + rng.IntN(3000)), Checksum: uint32(rng.IntN(3)), Parent: parent(), Tenant: tenant(), PutId: uint64(rng.IntN(100))}
				for range 1 + rng.IntN(2) {
					it.Replicas = append(it.Replicas, &pb.Extent{Segment: seg(), Offset: uint64(rng.IntN(8)) * 4096})
					it.Reservations = append(it.Reservations, resv[rng.IntN(len(resv))])
				}
				pc.Items = append(pc.Items, it)
			}
			c.Op = &pb.Command_Publish{Publish: pc}
		case p < 98 && len(resv) > 0:
			c.Op = &pb.Command_Release{Release: &pb.ReleaseCmd{Segment: seg(), Ids: []uint64{resv[rng.IntN(len(resv))]}, OnlyExpired: rng.IntN(2) == 0}}
		default:
			c.Op = &pb.Command_Member{Member: &pb.MemberCmd{Id: fmt.Sprintf("m%d", rng.IntN(3)), Address: "x"}}
		}
		return c
	}
}
