package master

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// t0 is an arbitrary wall-clock origin for FSM commands, in unix nanos.
const t0 int64 = 1_700_000_000_000_000_000

// fsmDriver applies commands to an FSM the way raft would: encoded, with an
// increasing log index and the proposer's clock inside the command.
type fsmDriver struct {
	t     testing.TB
	f     *FSM
	index uint64
}

func newDriver(t testing.TB) *fsmDriver { return &fsmDriver{t: t, f: NewFSM()} }

func (d *fsmDriver) apply(now int64, cmd *pb.Command) any {
	d.t.Helper()
	return d.applyEncoded(d.encode(now, cmd))
}

// encode is cmd as a log entry's data, at now.
func (d *fsmDriver) encode(now int64, cmd *pb.Command) []byte {
	d.t.Helper()
	cmd.NowUnixNano = now
	data, err := proto.Marshal(cmd)
	if err != nil {
		d.t.Fatalf("encode command: %v", err)
	}
	return data
}

// applyEncoded applies the next log entry, of data.
func (d *fsmDriver) applyEncoded(data []byte) any {
	d.index++
	return d.f.Apply(&raft.Log{Index: d.index, Term: 1, Type: raft.LogCommand, Data: data})
}

func (d *fsmDriver) register(now int64, nodeID, endpoint string, specs ...*pb.SegmentSpec) RegisterResult {
	d.t.Helper()
	out := d.apply(now, &pb.Command{Op: &pb.Command_Register{Register: &pb.RegisterCmd{Node: nodeID, Endpoint: endpoint, Segments: specs}}})
	res, ok := out.(RegisterResult)
	if !ok {
		d.t.Fatalf("register %s: Apply returned %T %v", nodeID, out, out)
	}
	return res
}

// putStart starts one put and returns its result.
func (d *fsmDriver) putStart(now int64, key string, size uint64, deadline int64, candidates ...string) PutStartResult {
	d.t.Helper()
	out := d.apply(now, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{{
		Key: key, Size: size, Checksum: uint32(size), Candidates: candidates, DeadlineUnixNano: deadline,
	}}}}})
	res, ok := out.([]PutStartResult)
	if !ok || len(res) != 1 {
		d.t.Fatalf("put start %q: Apply returned %T %v", key, out, out)
	}
	return res[0]
}

func (d *fsmDriver) keys(now int64, cmd *pb.Command) error {
	d.t.Helper()
	out := d.apply(now, cmd)
	errs, ok := out.([]error)
	if !ok || len(errs) != 1 {
		d.t.Fatalf("Apply returned %T %v, want one error slot", out, out)
	}
	return errs[0]
}

func (d *fsmDriver) putEnd(now int64, key string) error {
	return d.keys(now, &pb.Command{Op: &pb.Command_PutEnd{PutEnd: &pb.KeysCmd{Keys: []string{key}}}})
}

func (d *fsmDriver) revoke(now int64, key string) error {
	return d.keys(now, &pb.Command{Op: &pb.Command_PutRevoke{PutRevoke: &pb.KeysCmd{Keys: []string{key}}}})
}

func (d *fsmDriver) remove(now int64, key string, freeAfter int64) error {
	return d.keys(now, &pb.Command{Op: &pb.Command_Remove{Remove: &pb.RemoveCmd{Keys: []string{key}, FreeAfterUnixNano: freeAfter}}})
}

func (d *fsmDriver) nodeDown(now int64, nodeID string, epoch uint64) any {
	return d.apply(now, &pb.Command{Op: &pb.Command_NodeDown{NodeDown: &pb.NodeDownCmd{Node: nodeID, Epoch: epoch}}})
}

// tick applies a command that changes nothing but the FSM's notion of now.
func (d *fsmDriver) tick(now int64) {
	d.t.Helper()
	if out := d.apply(now, &pb.Command{Op: &pb.Command_Member{Member: &pb.MemberCmd{Id: "tick", Address: "-"}}}); out != nil {
		d.t.Fatalf("member command: %v", out)
	}
}

// put runs a whole put and fails the test unless it succeeds.
func (d *fsmDriver) put(now int64, key string, size uint64, candidates ...string) *pb.Extent {
	d.t.Helper()
	r := d.putStart(now, key, size, now+1e9, candidates...)
	if r.Err != nil || r.Exists || len(r.Replicas) != 1 {
		d.t.Fatalf("put start %q: %+v", key, r)
	}
	if err := d.putEnd(now, key); err != nil {
		d.t.Fatalf("put end %q: %v", key, err)
	}
	return r.Replicas[0]
}

func (d *fsmDriver) segment(id string) segmentView {
	d.t.Helper()
	for _, v := range d.f.segmentViews() {
		if v.id == id {
			return v
		}
	}
	d.t.Fatalf("segment %s not in %v", id, d.f.segmentViews())
	return segmentView{}
}

func dram(name string, capacity uint64) *pb.SegmentSpec {
	return &pb.SegmentSpec{Name: name, Tier: pb.Tier_TIER_DRAM, Capacity: capacity}
}

func ssd(name string, capacity uint64) *pb.SegmentSpec {
	return &pb.SegmentSpec{Name: name, Tier: pb.Tier_TIER_SSD, Capacity: capacity}
}

func listKeys(f *FSM) []string {
	objs, _ := f.list("", "", math.MaxInt32)
	keys := make([]string, len(objs))
	for i, o := range objs {
		keys[i] = o.Key
	}
	return keys
}

// visible reports whether readers see key, checking that replicas and
// exists agree on it.
func visible(t testing.TB, f *FSM, key string) bool {
	t.Helper()
	r := f.replicasOf([]string{key})[0]
	ok := r.Status.Code == int32(codes.OK)
	if ok != f.exists([]string{key})[0] {
		t.Fatalf("replicas (code %d) and exists disagree on %q", r.Status.Code, key)
	}
	return ok
}

func TestFSMRegister(t *testing.T) {
	d := newDriver(t)
	res := d.register(t0, "n1", "10.0.0.1:7000", dram("dram0", 1000), ssd("ssd0", 10000))
	want := RegisterResult{Epoch: 1, SegmentIDs: []string{"n1/dram0@1", "n1/ssd0@1"}}
	if res.Epoch != want.Epoch || !slices.Equal(res.SegmentIDs, want.SegmentIDs) {
		t.Fatalf("register = %+v, want %+v", res, want)
	}
	// Capacities are rounded down to the tier's alignment.
	wantViews := []segmentView{
		{id: "n1/dram0@1", node: "n1", endpoint: "10.0.0.1:7000", tier: pb.Tier_TIER_DRAM, epoch: 1, capacity: 960, largestFree: 960},
		{id: "n1/ssd0@1", node: "n1", endpoint: "10.0.0.1:7000", tier: pb.Tier_TIER_SSD, epoch: 1, capacity: 8192, largestFree: 8192},
	}
	if got := d.f.segmentViews(); !slices.Equal(got, wantViews) {
		t.Fatalf("segment views\n got %+v\nwant %+v", got, wantViews)
	}
	if got := d.f.liveNodes(); len(got) != 1 || got["n1"] != 1 {
		t.Fatalf("live nodes = %v", got)
	}
	// An SSD allocation takes a whole 4 KiB block.
	d.put(t0, "k", 1, "n1/ssd0@1")
	if v := d.segment("n1/ssd0@1"); v.used != 4096 || v.objects != 1 {
		t.Fatalf("ssd segment after a 1-byte put: %+v", v)
	}
}

func TestFSMTwoPhasePut(t *testing.T) {
	d := newDriver(t)
	seg := d.register(t0, "n1", "ep1", dram("dram0", 4096)).SegmentIDs[0]

	r := d.putStart(t0+1, "k", 100, t0+1e9, "missing/seg@1", seg)
	if r.Err != nil || r.Exists {
		t.Fatalf("put start = %+v", r)
	}
	wantExt := &pb.Extent{Segment: seg, Offset: 0, Length: 100}
	if len(r.Replicas) != 1 || !proto.Equal(r.Replicas[0], wantExt) {
		t.Fatalf("replicas = %v, want [%v]", r.Replicas, wantExt)
	}
	if visible(t, d.f, "k") {
		t.Fatal("a PROCESSING object is visible")
	}
	if got := d.f.replicasOf([]string{"k"})[0].Status.Code; got != int32(codes.NotFound) {
		t.Fatalf("replicas of a PROCESSING object: code %d, want NotFound", got)
	}
	objs, _ := d.f.list("", "", 10)
	if len(objs) != 1 || objs[0].State != pb.ObjectState_OBJECT_STATE_PROCESSING || objs[0].CreatedUnixMs != (t0+1)/1e6 {
		t.Fatalf("list = %v", objs)
	}
	if v := d.segment(seg); v.used != 128 || v.objects != 1 {
		t.Fatalf("segment after put start: %+v", v)
	}
	if p, c, _ := d.f.objectStats(); p != 1 || c != 0 {
		t.Fatalf("stats: %d processing, %d complete", p, c)
	}

	if err := d.putEnd(t0+2, "k"); err != nil {
		t.Fatalf("put end: %v", err)
	}
	if !visible(t, d.f, "k") {
		t.Fatal("a COMPLETE object is invisible")
	}
	got := d.f.replicasOf([]string{"k"})[0]
	want := &pb.ObjectReplicas{Status: &pb.ItemStatus{}, Size: 100, Checksum: 100, Replicas: []*pb.Replica{
		{Segment: seg, Node: "n1", Endpoint: "ep1", Offset: 0, Length: 100, Tier: pb.Tier_TIER_DRAM},
	}}
	if !proto.Equal(got, want) {
		t.Fatalf("replicas = %v, want %v", got, want)
	}
	if _, c, b := d.f.objectStats(); c != 1 || b != 100 {
		t.Fatalf("stats: %d complete, %d bytes", c, b)
	}

	// Ending twice is harmless; ending an unknown key is not.
	if err := d.putEnd(t0+3, "k"); err != nil {
		t.Fatalf("second put end: %v", err)
	}
	if err := d.putEnd(t0+3, "other"); !errors.Is(err, ErrNotInProgress) {
		t.Fatalf("put end of an unknown key: %v, want ErrNotInProgress", err)
	}
	// A complete object cannot be revoked.
	if err := d.revoke(t0+3, "k"); !errors.Is(err, ErrNotInProgress) {
		t.Fatalf("revoke of a complete object: %v, want ErrNotInProgress", err)
	}

	// A put of a complete key succeeds and allocates nothing.
	r = d.putStart(t0+4, "k", 200, t0+1e9, seg)
	if r.Err != nil || !r.Exists || len(r.Replicas) != 0 {
		t.Fatalf("put of an existing key = %+v, want Exists", r)
	}
	if v := d.segment(seg); v.used != 128 || v.objects != 1 {
		t.Fatalf("segment after a put of an existing key: %+v", v)
	}
}

func TestFSMPutInProgress(t *testing.T) {
	d := newDriver(t)
	seg := d.register(t0, "n1", "ep1", dram("dram0", 4096)).SegmentIDs[0]
	deadline := t0 + 100
	if r := d.putStart(t0, "k", 100, deadline, seg); r.Err != nil {
		t.Fatal(r.Err)
	}
	for _, now := range []int64{t0 + 1, deadline} {
		if r := d.putStart(now, "k", 100, now+100, seg); !errors.Is(r.Err, ErrPutInProgress) {
			t.Fatalf("second put at deadline%+d: %+v, want ErrPutInProgress", now-deadline, r)
		}
	}
	// Remove refuses a PROCESSING object.
	if err := d.remove(deadline, "k", 0); !errors.Is(err, ErrPutInProgress) {
		t.Fatalf("remove of a PROCESSING object: %v", err)
	}
	if got := d.f.expiredPuts(deadline); len(got) != 0 {
		t.Fatalf("expired puts at the deadline: %v", got)
	}
	if got := d.f.expiredPuts(deadline + 1); !slices.Equal(got, []string{"k"}) {
		t.Fatalf("expired puts after the deadline: %v", got)
	}

	// Past the deadline the abandoned put is replaced. Its space stays
	// reserved for lateWriteGrace: its writer's last bytes may still land.
	r := d.putStart(deadline+1, "k", 300, deadline+1000, seg)
	if r.Err != nil || r.Exists || len(r.Replicas) != 1 || r.Replicas[0].Offset == 0 || r.Replicas[0].Length != 300 {
		t.Fatalf("put after the deadline = %+v", r)
	}
	if v := d.segment(seg); v.objects != 1 {
		t.Fatalf("segment after the replacing put: %+v", v)
	}
	if got := d.f.expiredPuts(deadline + 1); len(got) != 0 {
		t.Fatalf("the new put already counts as expired: %v", got)
	}
	objs, _ := d.f.list("", "", 10)
	if len(objs) != 1 || objs[0].Size != 300 {
		t.Fatalf("list = %v", objs)
	}
}

func TestFSMRevokeFreesSpace(t *testing.T) {
	d := newDriver(t)
	seg := d.register(t0, "n1", "ep1", dram("dram0", 4096)).SegmentIDs[0]
	d.put(t0, "keep", 64, seg)
	if r := d.putStart(t0, "k", 4000, t0+1e9, seg); r.Err != nil {
		t.Fatal(r.Err)
	}
	if v := d.segment(seg); v.used != 4096 {
		t.Fatalf("used = %d, want a full segment", v.used)
	}
	if err := d.revoke(t0+1, "k"); err != nil {
		t.Fatalf("revoke: %v", err)
	}
	if v := d.segment(seg); v.used != 64 || v.objects != 1 || v.largestFree != 4032 {
		t.Fatalf("segment after revoke: %+v", v)
	}
	if keys := listKeys(d.f); !slices.Equal(keys, []string{"keep"}) {
		t.Fatalf("objects after revoke: %v", keys)
	}
	if err := d.revoke(t0+2, "k"); !errors.Is(err, ErrNotInProgress) {
		t.Fatalf("second revoke: %v, want ErrNotInProgress", err)
	}
	if err := d.putEnd(t0+2, "k"); !errors.Is(err, ErrNotInProgress) {
		t.Fatalf("put end after revoke: %v, want ErrNotInProgress", err)
	}
}

func TestFSMPutStartErrors(t *testing.T) {
	tests := []struct {
		name  string
		specs []*pb.SegmentSpec // nil: no node registered
		fill  uint64            // bytes put first, into the first segment
		size  uint64
		cands func(ids []string) []string
		want  error
	}{
		{name: "no segments", size: 1, want: ErrNoSegments},
		{name: "larger than any segment", specs: []*pb.SegmentSpec{dram("a", 4096), dram("b", 8192)}, size: 8193, want: ErrTooLarge},
		{name: "larger than any segment, offered anyway", specs: []*pb.SegmentSpec{dram("a", 4096)}, size: 4097, cands: allIDs, want: ErrTooLarge},
		{name: "size overflows alignment", specs: []*pb.SegmentSpec{dram("a", 4096)}, size: math.MaxUint64, cands: allIDs, want: ErrTooLarge},
		{name: "full", specs: []*pb.SegmentSpec{dram("a", 4096)}, fill: 4096, size: 64, cands: allIDs, want: ErrNoSpace},
		{name: "fragment too small", specs: []*pb.SegmentSpec{dram("a", 4096)}, fill: 4000, size: 128, cands: allIDs, want: ErrNoSpace},
		{name: "no candidates", specs: []*pb.SegmentSpec{dram("a", 4096)}, size: 64, want: ErrNoSpace},
		{name: "only unknown candidates", specs: []*pb.SegmentSpec{dram("a", 4096)}, size: 64,
			cands: func([]string) []string { return []string{"n1/a@2", "other/a@1"} }, want: ErrNoSpace},
		{name: "zero size", specs: []*pb.SegmentSpec{dram("a", 4096)}, size: 0, cands: allIDs, want: ErrInvalidRequest},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := newDriver(t)
			var ids []string
			if tc.specs != nil {
				ids = d.register(t0, "n1", "ep", tc.specs...).SegmentIDs
			}
			if tc.fill > 0 {
				d.put(t0, "fill", tc.fill, ids[0])
			}
			var cands []string
			if tc.cands != nil {
				cands = tc.cands(ids)
			}
			before := d.f.segmentViews()
			r := d.putStart(t0+1, "k", tc.size, t0+1e9, cands...)
			if !errors.Is(r.Err, tc.want) || r.Exists || len(r.Replicas) != 0 {
				t.Fatalf("put start = %+v, want error %v", r, tc.want)
			}
			if after := d.f.segmentViews(); !slices.Equal(before, after) {
				t.Fatalf("a failed put changed the segments:\n%+v\n%+v", before, after)
			}
			if visible(t, d.f, "k") || slices.Contains(listKeys(d.f), "k") {
				t.Fatal("a failed put left an object behind")
			}
		})
	}
}

func allIDs(ids []string) []string { return ids }

func TestFSMPutStartBatch(t *testing.T) {
	d := newDriver(t)
	seg := d.register(t0, "n1", "ep", dram("a", 256)).SegmentIDs[0]
	out := d.apply(t0, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{
		{Key: "a", Size: 100, Candidates: []string{seg}, DeadlineUnixNano: t0 + 10},
		{Key: "a", Size: 100, Candidates: []string{seg}, DeadlineUnixNano: t0 + 10}, // same key again
		{Key: "b", Size: 100, Candidates: []string{seg}, DeadlineUnixNano: t0 + 10},
		{Key: "c", Size: 100, Candidates: []string{seg}, DeadlineUnixNano: t0 + 10}, // no room left
	}}}})
	res := out.([]PutStartResult)
	wantErrs := []error{nil, ErrPutInProgress, nil, ErrNoSpace}
	if len(res) != len(wantErrs) {
		t.Fatalf("%d results, want %d", len(res), len(wantErrs))
	}
	for i, want := range wantErrs {
		if (want == nil) != (res[i].Err == nil) || (want != nil && !errors.Is(res[i].Err, want)) {
			t.Errorf("item %d: %v, want %v", i, res[i].Err, want)
		}
	}
	if res[0].Replicas[0].Offset != 0 || res[2].Replicas[0].Offset != 128 {
		t.Fatalf("offsets %d and %d, want 0 and 128", res[0].Replicas[0].Offset, res[2].Replicas[0].Offset)
	}
}

func TestFSMRemoveDefersFree(t *testing.T) {
	d := newDriver(t)
	seg := d.register(t0, "n1", "ep", dram("a", 4096)).SegmentIDs[0]
	d.put(t0, "k", 100, seg)
	d.put(t0, "now", 100, seg)

	// Removed at once when nothing holds a lease.
	if err := d.remove(t0+10, "now", t0+10); err != nil {
		t.Fatal(err)
	}
	if v := d.segment(seg); v.used != 128 || v.objects != 1 {
		t.Fatalf("after an immediate remove: %+v", v)
	}

	freeAfter := t0 + 1000
	if err := d.remove(t0+10, "k", freeAfter); err != nil {
		t.Fatal(err)
	}
	if visible(t, d.f, "k") || len(listKeys(d.f)) != 0 {
		t.Fatal("a removed object is still listed")
	}
	if v := d.segment(seg); v.used != 128 || v.objects != 0 {
		t.Fatalf("space freed before the leases ended: %+v", v)
	}
	// A put in the meantime must not land on the leased range.
	ext := d.put(t0+20, "other", 64, seg)
	if ext.Offset < 128 {
		t.Fatalf("a new put reused leased space at offset %d", ext.Offset)
	}
	if err := d.remove(t0+20, "other", 0); err != nil {
		t.Fatal(err)
	}
	d.tick(freeAfter - 1)
	if v := d.segment(seg); v.used != 128 {
		t.Fatalf("used = %d before free_after, want 128", v.used)
	}
	d.tick(freeAfter + 1)
	if v := d.segment(seg); v.used != 0 || v.largestFree != 4096 {
		t.Fatalf("after free_after passed: %+v", v)
	}
	if err := d.remove(freeAfter+2, "k", 0); !errors.Is(err, ErrNotFound) {
		t.Fatalf("second remove: %v, want ErrNotFound", err)
	}
	// The key can be put again.
	d.put(freeAfter+3, "k", 100, seg)
}

func TestFSMReregisterDropsOldEpoch(t *testing.T) {
	d := newDriver(t)
	old := d.register(t0, "n1", "ep-old", dram("a", 4096)).SegmentIDs[0]
	other := d.register(t0, "n2", "ep2", dram("a", 4096)).SegmentIDs[0]
	d.put(t0, "k1", 100, old)
	d.put(t0, "k2", 100, other)
	d.put(t0, "gone", 100, old)
	if err := d.remove(t0, "gone", t0+1e12); err != nil { // leaves a pending free on old
		t.Fatal(err)
	}
	if r := d.putStart(t0, "p1", 100, t0+1e12, old); r.Err != nil {
		t.Fatal(r.Err)
	}

	res := d.register(t0+1, "n1", "ep-new", dram("a", 8192))
	if res.Epoch != 2 || !slices.Equal(res.SegmentIDs, []string{"n1/a@2"}) {
		t.Fatalf("re-register = %+v", res)
	}
	if keys := listKeys(d.f); !slices.Equal(keys, []string{"k2"}) {
		t.Fatalf("objects after re-register: %v, want only k2", keys)
	}
	if visible(t, d.f, "k1") || !visible(t, d.f, "k2") {
		t.Fatal("k1 survived its node's restart or k2 did not survive")
	}
	views := d.f.segmentViews()
	if len(views) != 2 || views[0].id != "n1/a@2" || views[0].used != 0 || views[0].endpoint != "ep-new" || views[1].id != other {
		t.Fatalf("segments after re-register: %+v", views)
	}
	if len(d.f.pending) != 0 {
		t.Fatalf("pending frees of a dropped segment remain: %v", d.f.pending)
	}
	// The old epoch's segment is no longer a valid candidate.
	if r := d.putStart(t0+2, "k3", 100, t0+1e9, old); !errors.Is(r.Err, ErrNoSpace) {
		t.Fatalf("put on an old-epoch segment: %+v", r)
	}
	if err := d.putEnd(t0+2, "p1"); !errors.Is(err, ErrNotInProgress) {
		t.Fatalf("put end of a put on the old epoch: %v", err)
	}
}

func TestFSMNodeDown(t *testing.T) {
	d := newDriver(t)
	s1 := d.register(t0, "n1", "ep1", dram("a", 4096)).SegmentIDs[0]
	s2 := d.register(t0, "n2", "ep2", dram("a", 4096)).SegmentIDs[0]
	d.put(t0, "k1", 100, s1)
	d.put(t0, "k2", 100, s2)

	for _, tc := range []struct {
		node  string
		epoch uint64
	}{{"n1", 2}, {"n1", 0}, {"nobody", 1}} {
		if err, _ := d.nodeDown(t0+1, tc.node, tc.epoch).(error); !errors.Is(err, ErrUnknownNode) {
			t.Fatalf("node down %s@%d: %v, want ErrUnknownNode", tc.node, tc.epoch, err)
		}
	}
	if keys := listKeys(d.f); len(keys) != 2 {
		t.Fatalf("a refused node down dropped objects: %v", keys)
	}

	if out := d.nodeDown(t0+1, "n1", 1); out != nil {
		t.Fatalf("node down: %v", out)
	}
	if keys := listKeys(d.f); !slices.Equal(keys, []string{"k2"}) {
		t.Fatalf("objects after node down: %v", keys)
	}
	if views := d.f.segmentViews(); len(views) != 1 || views[0].id != s2 {
		t.Fatalf("segments after node down: %+v", views)
	}
	if live := d.f.liveNodes(); len(live) != 1 || live["n2"] != 1 {
		t.Fatalf("live nodes: %v", live)
	}
	if err, _ := d.nodeDown(t0+2, "n1", 1).(error); !errors.Is(err, ErrUnknownNode) {
		t.Fatalf("second node down: %v, want ErrUnknownNode", err)
	}
	res := d.register(t0+3, "n1", "ep1", dram("a", 4096))
	if res.Epoch != 2 || !slices.Equal(res.SegmentIDs, []string{"n1/a@2"}) {
		t.Fatalf("register after node down = %+v, want epoch 2", res)
	}
	if live := d.f.liveNodes(); live["n1"] != 2 {
		t.Fatalf("live nodes: %v", live)
	}
}

func TestFSMBadCommands(t *testing.T) {
	tests := []struct {
		name string
		data []byte
	}{
		{"garbage", []byte{0xff, 0xff, 0xff}},
		{"truncated", func() []byte {
			b, _ := proto.Marshal(&pb.Command{NowUnixNano: t0, Op: &pb.Command_Register{Register: &pb.RegisterCmd{Node: "n1", Endpoint: "ep"}}})
			return b[:len(b)-2]
		}()},
		{"empty", nil},
		{"no op", func() []byte { b, _ := proto.Marshal(&pb.Command{NowUnixNano: t0}); return b }()},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := NewFSM()
			out := f.Apply(&raft.Log{Index: 7, Data: tc.data})
			err, ok := out.(error)
			if !ok || !errors.Is(err, ErrInvalidRequest) {
				t.Fatalf("Apply = %T %v, want ErrInvalidRequest", out, out)
			}
			if len(f.nodes)+f.objects.len()+len(f.segments)+len(f.members) != 0 {
				t.Fatal("a bad command changed the state")
			}
		})
	}
}

// memSink is a raft.SnapshotSink that keeps the snapshot in memory.
type memSink struct {
	bytes.Buffer
	closed, cancelled bool
}

func (s *memSink) ID() string    { return "mem" }
func (s *memSink) Close() error  { s.closed = true; return nil }
func (s *memSink) Cancel() error { s.cancelled = true; return nil }

func snapshotBytes(t testing.TB, f *FSM) []byte {
	t.Helper()
	snap, err := f.Snapshot()
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	defer snap.Release()
	var sink memSink
	if err := snap.Persist(&sink); err != nil {
		t.Fatalf("persist: %v", err)
	}
	if !sink.closed || sink.cancelled {
		t.Fatalf("persist left the sink closed=%v cancelled=%v", sink.closed, sink.cancelled)
	}
	return sink.Bytes()
}

func restored(t testing.TB, data []byte) *FSM {
	t.Helper()
	f := NewFSM()
	if err := f.Restore(io.NopCloser(bytes.NewReader(data))); err != nil {
		t.Fatalf("restore: %v", err)
	}
	return f
}

// sameState fails the test unless two FSMs answer every query alike.
func sameState(t testing.TB, a, b *FSM) {
	t.Helper()
	la, ta := a.list("", "", math.MaxInt32)
	lb, tb := b.list("", "", math.MaxInt32)
	if ta || tb || len(la) != len(lb) {
		t.Fatalf("list: %d vs %d objects", len(la), len(lb))
	}
	keys := make([]string, len(la))
	for i := range la {
		if !proto.Equal(la[i], lb[i]) {
			t.Fatalf("list item %d:\n%v\n%v", i, la[i], lb[i])
		}
		keys[i] = la[i].Key
	}
	if va, vb := a.segmentViews(), b.segmentViews(); !slices.Equal(va, vb) {
		t.Fatalf("segment views:\n%+v\n%+v", va, vb)
	}
	if len(keys) > 0 {
		ra, rb := a.replicasOf(keys), b.replicasOf(keys)
		for i := range ra {
			if !proto.Equal(ra[i], rb[i]) {
				t.Fatalf("replicas of %q:\n%v\n%v", keys[i], ra[i], rb[i])
			}
		}
	}
	if !maps.Equal(a.liveNodes(), b.liveNodes()) {
		t.Fatalf("live nodes %v vs %v", a.liveNodes(), b.liveNodes())
	}
	for _, v := range a.segmentViews() {
		sa, sb := a.segments[v.id].alloc, b.segments[v.id].alloc
		if !slices.Equal(sa.free, sb.free) {
			t.Fatalf("free lists of %s differ:\n%v\n%v", v.id, sa.free, sb.free)
		}
	}
	sameHidden(t, a, b)
}

// sameHidden compares what no query shows: nodes that are down, draining
// or drained, copies in flight, parent counts and pending frees.
func sameHidden(t testing.TB, a, b *FSM) {
	t.Helper()
	a.mu.RLock()
	defer a.mu.RUnlock()
	b.mu.RLock()
	defer b.mu.RUnlock()
	if ka, kb := sortedKeys(a.nodes), sortedKeys(b.nodes); !slices.Equal(ka, kb) {
		t.Fatalf("nodes %v vs %v", ka, kb)
	}
	for id, na := range a.nodes {
		nb := b.nodes[id]
		if na.epoch != nb.epoch || na.endpoint != nb.endpoint || na.down != nb.down || na.draining != nb.draining ||
			na.drained != nb.drained || !slices.Equal(na.segments, nb.segments) {
			t.Fatalf("node %s:\n%+v\n%+v", id, *na, *nb)
		}
	}
	for k, oa := range a.objects.all() {
		ob := b.objects.get(k)
		if ob == nil {
			t.Fatalf("object %q only in one FSM", k)
		}
		ca, cb := a.copies(oa), b.copies(ob)
		if oa.parent() != ob.parent() || a.tenantOf(oa) != b.tenantOf(ob) || len(ca) != len(cb) || a.deadline(oa) != b.deadline(ob) ||
			a.softPin(oa) != b.softPin(ob) || !slices.EqualFunc(a.pbExtents(oa), b.pbExtents(ob), func(x, y *pb.Extent) bool { return proto.Equal(x, y) }) {
			t.Fatalf("object %q: parent %q/%q tenant %q/%q copies %v/%v", k, oa.parent(), ob.parent(), a.tenantOf(oa), b.tenantOf(ob), ca, cb)
		}
		for i := range ca {
			if !proto.Equal(ca[i], cb[i]) {
				t.Fatalf("copy %d of %q:\n%v\n%v", i, k, ca[i], cb[i])
			}
		}
	}
	if !maps.Equal(a.children, b.children) {
		t.Fatalf("children %v vs %v", a.children, b.children)
	}
	if len(a.pending) != len(b.pending) {
		t.Fatalf("%d vs %d pending frees", len(a.pending), len(b.pending))
	}
	for i := range a.pending {
		if !proto.Equal(a.pending[i], b.pending[i]) {
			t.Fatalf("pending free %d:\n%v\n%v", i, a.pending[i], b.pending[i])
		}
	}
}

func TestFSMSnapshotRestore(t *testing.T) {
	d := newDriver(t)
	s1 := d.register(t0, "n1", "ep1", dram("a", 8192), ssd("b", 1<<20)).SegmentIDs
	s2 := d.register(t0, "n2", "ep2", dram("a", 8192)).SegmentIDs
	d.register(t0, "n3", "ep3", dram("a", 8192))
	d.nodeDown(t0, "n3", 1)
	d.apply(t0, &pb.Command{Op: &pb.Command_Member{Member: &pb.MemberCmd{Id: "m1", Address: "127.0.0.1:1"}}})
	for i := range 20 {
		d.put(t0+int64(i), fmt.Sprintf("k%02d", i), uint64(100+i*37), s1[i%2], s2[0])
	}
	for i := 0; i < 20; i += 3 {
		if err := d.remove(t0+100, fmt.Sprintf("k%02d", i), t0+int64(i%2)*1e6); err != nil {
			t.Fatal(err)
		}
	}
	if r := d.putStart(t0+200, "processing", 500, t0+1e9, s2[0]); r.Err != nil {
		t.Fatal(r.Err)
	}
	if len(d.f.pending) == 0 {
		t.Fatal("setup left no pending frees")
	}

	data := snapshotBytes(t, d.f)
	g := restored(t, data)
	sameState(t, d.f, g)
	if got := g.member("m1"); got != "127.0.0.1:1" {
		t.Fatalf("member after restore: %q", got)
	}
	if again := snapshotBytes(t, g); !bytes.Equal(data, again) {
		t.Fatal("a restored FSM snapshots differently")
	}
	if got := g.expiredPuts(t0 + 1e9 + 1); !slices.Equal(got, []string{"processing"}) {
		t.Fatal("the PROCESSING put's deadline was not restored")
	}

	// Both continue identically: the allocators were rebuilt exactly.
	e := &fsmDriver{t: t, f: g, index: d.index}
	for i := range 10 {
		now := t0 + 2e6 + int64(i)
		key := fmt.Sprintf("after%d", i)
		ra := d.putStart(now, key, uint64(1000+i), now+10, s1[0], s2[0], s1[1])
		rb := e.putStart(now, key, uint64(1000+i), now+10, s1[0], s2[0], s1[1])
		if fmt.Sprint(ra) != fmt.Sprint(rb) {
			t.Fatalf("put %d diverged: %v vs %v", i, ra, rb)
		}
	}
	sameState(t, d.f, g)
	// A down node stays down, and its next registration is epoch 2.
	if d.register(t0+3e6, "n3", "ep3", dram("a", 8192)).Epoch != 2 || e.register(t0+3e6, "n3", "ep3", dram("a", 8192)).Epoch != 2 {
		t.Fatal("a down node's epoch was not restored")
	}

	// Restore replaces whatever state the FSM had.
	h := &fsmDriver{t: t, f: NewFSM()}
	h.register(t0, "stale", "ep", dram("x", 4096))
	h.put(t0, "stale-key", 10, "stale/x@1")
	if err := h.f.Restore(io.NopCloser(bytes.NewReader(data))); err != nil {
		t.Fatal(err)
	}
	if slices.Contains(listKeys(h.f), "stale-key") || h.f.liveNodes()["stale"] != 0 {
		t.Fatal("restore kept state from before")
	}
}

func TestFSMRestoreBadSnapshot(t *testing.T) {
	f := NewFSM()
	if err := f.Restore(io.NopCloser(bytes.NewReader([]byte{0xff, 0xff}))); err == nil {
		t.Fatal("restore of garbage succeeded")
	}
	// Two objects claiming the same range: the restore reports it.
	snap := &pb.Snapshot{
		Nodes: []*pb.Node{{Id: "n1", Endpoint: "ep", Epoch: 1, Segments: []*pb.SegmentSpec{dram("a", 4096)}}},
		Objects: []*pb.Object{
			{Key: "a", Size: 64, State: pb.ObjectState_OBJECT_STATE_COMPLETE, Replicas: []*pb.Extent{{Segment: "n1/a@1", Offset: 0, Length: 64}}},
			{Key: "b", Size: 64, State: pb.ObjectState_OBJECT_STATE_COMPLETE, Replicas: []*pb.Extent{{Segment: "n1/a@1", Offset: 0, Length: 64}}},
		},
	}
	data, err := proto.Marshal(snap)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Restore(io.NopCloser(bytes.NewReader(data))); err == nil {
		t.Fatal("restore of overlapping extents succeeded")
	}
}

// checkInvariants verifies the allocator accounting against the tables:
// every segment's used bytes are exactly its live and pending extents.
func checkInvariants(t testing.TB, f *FSM) {
	t.Helper()
	want := map[string]uint64{}
	count := map[string]int{}
	inFlight, copying := 0, 0
	for _, o := range f.objects.all() {
		if len(f.exts(o)) == 0 {
			t.Fatalf("object %q has no replica", o.key())
		}
		// The sweeps' sets hold exactly the objects of puts and copies in flight.
		_, in := f.inFlight[o]
		_, cp := f.copying[o]
		if in != (o.is(pb.ObjectState_OBJECT_STATE_PROCESSING)) || cp != (len(f.copies(o)) > 0) {
			t.Fatalf("object %q (%v, %d copies): in the in-flight set %v, in the copying set %v", o.key(), o.state, len(f.copies(o)), in, cp)
		}
		if in {
			inFlight++
		}
		if cp {
			copying++
		}
		for _, r := range f.exts(o) {
			s := f.seg(r)
			if s == nil || f.segments[s.id] != s {
				t.Fatalf("object %q on unknown segment %d", o.key(), r.seg)
			}
			want[s.id] += s.alloc.rounded(o.size)
			count[s.id]++
		}
		// A copy in flight holds its target's room, on a segment without a
		// replica of the object; there is at most one per object.
		if len(f.copies(o)) > 1 {
			t.Fatalf("object %q has %d copies in flight", o.key(), len(f.copies(o)))
		}
		for _, c := range f.copies(o) {
			s := f.segments[c.Target.Segment]
			if s == nil {
				t.Fatalf("copy %d of %q to unknown segment %s", c.Id, o.key(), c.Target.Segment)
			}
			if f.onSegment(o, c.Target.Segment) {
				t.Fatalf("copy %d of %q targets %s, which holds a replica of it", c.Id, o.key(), c.Target.Segment)
			}
			if !o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) {
				t.Fatalf("copy %d of %q, which is not complete", c.Id, o.key())
			}
			want[c.Target.Segment] += s.alloc.rounded(c.Target.Length)
		}
	}
	if inFlight != len(f.inFlight) || copying != len(f.copying) {
		t.Fatalf("the in-flight set holds %d objects and the copying set %d, of %d and %d in the table", len(f.inFlight), len(f.copying), inFlight, copying)
	}
	children := map[string]int{}
	for _, o := range f.objects.all() {
		if o.parent() != "" {
			children[o.parent()]++
		}
	}
	if !maps.Equal(children, f.children) {
		t.Fatalf("children %v, objects name parents %v", f.children, children)
	}
	for _, p := range f.pending {
		s := f.segments[p.Extent.Segment]
		if s == nil {
			t.Fatalf("pending free on unknown segment %s", p.Extent.Segment)
		}
		want[p.Extent.Segment] += s.alloc.rounded(p.Extent.Length)
	}
	for id, s := range f.segments {
		var free uint64
		for _, sp := range s.alloc.free {
			free += sp.len
		}
		if s.alloc.used != want[id] || s.alloc.used+free != s.alloc.capacity || s.objects != count[id] {
			t.Fatalf("segment %s: used %d free %d capacity %d objects %d; tables say used %d objects %d",
				id, s.alloc.used, free, s.alloc.capacity, s.objects, want[id], count[id])
		}
	}
}

// randomCommands builds a reproducible command stream over a few nodes and
// keys. It never looks at an FSM, so every FSM gets the same stream; it only
// models node epochs, so that most candidates name live segments.
func randomCommands(seed uint64, n int) []*pb.Command {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	nodes := []string{"n0", "n1", "n2", "n3"}
	names := []string{"a", "b"}
	epoch := map[string]uint64{}
	// someEpoch is usually the node's current epoch, sometimes a stale one.
	someEpoch := func(node string) uint64 {
		if rng.IntN(5) == 0 {
			return uint64(rng.IntN(int(epoch[node]) + 2))
		}
		return epoch[node]
	}
	now := t0
	keys := func(k int) []string {
		out := make([]string, k)
		for i := range out {
			out[i] = fmt.Sprintf("key%02d", rng.IntN(40))
		}
		return out
	}
	cmds := make([]*pb.Command, 0, n)
	for i := range n {
		now += rng.Int64N(50)
		c := &pb.Command{NowUnixNano: now}
		switch p := rng.IntN(100); {
		case i < len(nodes) || p < 3:
			var specs []*pb.SegmentSpec
			for _, name := range names[:1+rng.IntN(2)] {
				tier := pb.Tier_TIER_DRAM
				if rng.IntN(3) == 0 {
					tier = pb.Tier_TIER_SSD
				}
				specs = append(specs, &pb.SegmentSpec{Name: name, Tier: tier, Capacity: uint64(16384 + rng.IntN(65536))})
			}
			node := nodes[rng.IntN(len(nodes))]
			if i < len(nodes) {
				node = nodes[i]
			}
			epoch[node]++
			c.Op = &pb.Command_Register{Register: &pb.RegisterCmd{Node: node, Endpoint: node + ":7000", Segments: specs}}
		case p < 5:
			node := nodes[rng.IntN(len(nodes))]
			c.Op = &pb.Command_NodeDown{NodeDown: &pb.NodeDownCmd{Node: node, Epoch: someEpoch(node)}}
		case p < 50:
			cmd := &pb.PutStartCmd{}
			for _, k := range keys(1 + rng.IntN(3)) {
				var cands []string
				for range rng.IntN(4) {
					node := nodes[rng.IntN(len(nodes))]
					cands = append(cands, SegmentID(node, names[rng.IntN(2)], someEpoch(node)))
				}
				cmd.Items = append(cmd.Items, &pb.PutStartItem{
					Key: k, Size: uint64(rng.IntN(6000)), Checksum: rng.Uint32(),
					Candidates: cands, DeadlineUnixNano: now + rng.Int64N(200),
				})
			}
			c.Op = &pb.Command_PutStart{PutStart: cmd}
		case p < 80:
			c.Op = &pb.Command_PutEnd{PutEnd: &pb.KeysCmd{Keys: keys(1 + rng.IntN(3))}}
		case p < 86:
			c.Op = &pb.Command_PutRevoke{PutRevoke: &pb.KeysCmd{Keys: keys(1 + rng.IntN(2))}}
		case p < 97:
			c.Op = &pb.Command_Remove{Remove: &pb.RemoveCmd{Keys: keys(1), FreeAfterUnixNano: now - 100 + rng.Int64N(400)}}
		default:
			c.Op = &pb.Command_Member{Member: &pb.MemberCmd{Id: fmt.Sprintf("m%d", rng.IntN(3)), Address: fmt.Sprintf("127.0.0.1:%d", rng.IntN(100))}}
		}
		cmds = append(cmds, c)
	}
	return cmds
}

func applyRaw(t testing.TB, f *FSM, index uint64, c *pb.Command) string {
	t.Helper()
	data, err := proto.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprint(f.Apply(&raft.Log{Index: index, Term: 1, Data: data}))
}

func TestFSMDeterminism(t *testing.T) {
	for seed := range uint64(4) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			cmds := randomCommands(seed, 1500)
			a, b := NewFSM(), NewFSM()
			var c *FSM // restored from a's snapshot half way
			peak := 0  // most objects at once
			half := len(cmds) / 2
			for i, cmd := range cmds {
				if i == half {
					c = restored(t, snapshotBytes(t, a))
				}
				ra := applyRaw(t, a, uint64(i+1), cmd)
				if rb := applyRaw(t, b, uint64(i+1), cmd); ra != rb {
					t.Fatalf("command %d (%v) returned %s and %s", i, cmd, ra, rb)
				}
				if c != nil {
					if rc := applyRaw(t, c, uint64(i+1), cmd); ra != rc {
						t.Fatalf("command %d (%v) on the restored FSM returned %s, want %s", i, cmd, rc, ra)
					}
				}
				checkInvariants(t, a)
				peak = max(peak, a.objects.len())
			}
			sa, sb, sc := snapshotBytes(t, a), snapshotBytes(t, b), snapshotBytes(t, c)
			if !bytes.Equal(sa, sb) {
				t.Fatal("two FSMs fed the same commands snapshot differently")
			}
			if !bytes.Equal(sa, sc) {
				t.Fatal("an FSM restored half way snapshots differently at the end")
			}
			sameState(t, a, b)
			sameState(t, a, c)
			if peak < 10 {
				t.Fatalf("at most %d objects at once: the stream exercises too little", peak)
			}
		})
	}
}

// TestFSMResultNotAliased: the extents a put start returns are read after
// Apply, outside raft's FSM goroutine (BatchPutStart describes them under
// the read lock). A later command dropping the object must not rewrite them.
func TestFSMResultNotAliased(t *testing.T) {
	d := newDriver(t)
	seg := d.register(t0, "n1", "ep", dram("a", 4096)).SegmentIDs[0]
	r := d.putStart(t0, "k", 100, t0+10, seg)
	if r.Err != nil {
		t.Fatal(r.Err)
	}
	d.nodeDown(t0+1, "n1", 1)
	if len(r.Replicas) != 1 || r.Replicas[0] == nil || r.Replicas[0].Segment != seg {
		t.Fatalf("returned replicas changed after the node went down: %v", r.Replicas)
	}
	d.f.mu.RLock()
	defer d.f.mu.RUnlock()
	for _, rec := range []*putRecord{nil, {}} {
		if got := d.f.describePlaced(r.Replicas, access{}, rec); len(got) != 0 {
			t.Fatalf("describe of a dropped segment (record %v): %v", rec != nil, got)
		}
	}
}

// TestFSMPutIDs checks that PutEnd and PutRevoke act only on the put they
// name, so a late PutEnd of an expired put never publishes a newer put.
func TestFSMPutIDs(t *testing.T) {
	d := newDriver(t)
	seg := d.register(1, "n1", "e1", &pb.SegmentSpec{Name: "dram0", Tier: pb.Tier_TIER_DRAM, Capacity: 1 << 20}).SegmentIDs[0]
	old := d.putStart(10, "k", 100, 20, seg)
	if old.Err != nil || old.PutID == 0 {
		t.Fatalf("first put: %+v", old)
	}
	endWith := func(now int64, id uint64) error {
		return d.keys(now, &pb.Command{Op: &pb.Command_PutEnd{PutEnd: &pb.KeysCmd{Keys: []string{"k"}, PutIds: []uint64{id}}}})
	}
	if err := endWith(21, old.PutID); !errors.Is(err, ErrNotInProgress) {
		t.Fatalf("PutEnd after the deadline: %v, want ErrNotInProgress", err)
	}
	replacing := d.putStart(30, "k", 100, 100, seg)
	if replacing.Err != nil || replacing.PutID == old.PutID {
		t.Fatalf("replacing put: %+v", replacing)
	}
	if err := endWith(31, old.PutID); !errors.Is(err, ErrNotInProgress) {
		t.Fatalf("late PutEnd of the replaced put: %v, want ErrNotInProgress", err)
	}
	if got := d.f.exists([]string{"k"}); got[0] {
		t.Fatal("a late PutEnd published the newer put")
	}
	revokeOld := d.keys(32, &pb.Command{Op: &pb.Command_PutRevoke{PutRevoke: &pb.KeysCmd{Keys: []string{"k"}, PutIds: []uint64{old.PutID}}}})
	if !errors.Is(revokeOld, ErrNotInProgress) {
		t.Fatalf("revoke of the replaced put: %v", revokeOld)
	}
	if err := endWith(33, replacing.PutID); err != nil {
		t.Fatalf("PutEnd of the current put: %v", err)
	}
	if got := d.f.exists([]string{"k"}); !got[0] {
		t.Fatal("the current put did not complete")
	}
}

func (d *fsmDriver) pin(now int64, cmd *pb.PinCmd) error {
	d.t.Helper()
	return d.keys(now, &pb.Command{Op: &pb.Command_Pin{Pin: cmd}})
}

func (d *fsmDriver) evict(now int64, key string, freeAfter int64, allowSoft bool) error {
	d.t.Helper()
	return d.keys(now, &pb.Command{Op: &pb.Command_Evict{Evict: &pb.EvictCmd{Keys: []string{key}, FreeAfterUnixNano: freeAfter, AllowSoftPinned: allowSoft}}})
}

// pins returns an object's hard pin and soft pin deadline as the FSM holds them.
func pins(t testing.TB, f *FSM, key string) (hard bool, softUntil int64) {
	t.Helper()
	f.mu.RLock()
	defer f.mu.RUnlock()
	o := f.objects.get(key)
	if o == nil {
		t.Fatalf("no object %q", key)
	}
	return o.hard(), f.softPin(o)
}

func TestFSMPin(t *testing.T) {
	type step struct {
		cmd      *pb.PinCmd
		want     error // nil: success
		hard     bool  // pins of "k" afterwards (when it exists)
		softPin  int64
		describe string
	}
	soft := func(until int64) *pb.PinCmd { return &pb.PinCmd{Key: "k", SoftUntilUnixNano: until} }
	hard := &pb.PinCmd{Key: "k", Hard: true}
	unpin := &pb.PinCmd{Key: "k", Unpin: true}
	tests := []struct {
		name  string
		steps []step
	}{
		{"hard", []step{{cmd: hard, hard: true}}},
		{"soft", []step{{cmd: soft(t0 + 5e9), softPin: t0 + 5e9}}},
		{"unpin hard", []step{{cmd: hard, hard: true}, {cmd: unpin}}},
		{"unpin soft", []step{{cmd: soft(t0 + 5e9), softPin: t0 + 5e9}, {cmd: unpin}}},
		{"unpin unpinned", []step{{cmd: unpin}}},
		{"hard then soft keeps both", []step{{cmd: hard, hard: true}, {cmd: soft(t0 + 5e9), hard: true, softPin: t0 + 5e9}}},
		{"soft then hard keeps both", []step{{cmd: soft(t0 + 5e9), softPin: t0 + 5e9}, {cmd: hard, hard: true, softPin: t0 + 5e9}}},
		{"a shorter soft pin does not shorten", []step{{cmd: soft(t0 + 5e9), softPin: t0 + 5e9}, {cmd: soft(t0 + 1e9), softPin: t0 + 5e9}}},
		{"a longer soft pin extends", []step{{cmd: soft(t0 + 1e9), softPin: t0 + 1e9}, {cmd: soft(t0 + 5e9), softPin: t0 + 5e9}}},
		{"hard twice", []step{{cmd: hard, hard: true}, {cmd: hard, hard: true}}},
		{"missing key", []step{{cmd: &pb.PinCmd{Key: "missing", Hard: true}, want: ErrNotFound}}},
		{"unpin missing key", []step{{cmd: &pb.PinCmd{Key: "missing", Unpin: true}, want: ErrNotFound}}},
		{"processing", []step{{cmd: &pb.PinCmd{Key: "proc", Hard: true}, want: ErrNotFound}}},
		{"soft on processing", []step{{cmd: &pb.PinCmd{Key: "proc", SoftUntilUnixNano: t0 + 5e9}, want: ErrNotFound}}},
		{"unpin processing", []step{{cmd: &pb.PinCmd{Key: "proc", Unpin: true}, want: ErrNotFound}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := newDriver(t)
			seg := d.register(t0, "n1", "ep", dram("a", 1<<20)).SegmentIDs[0]
			d.put(t0, "k", 100, seg)
			if r := d.putStart(t0, "proc", 100, t0+1e12, seg); r.Err != nil {
				t.Fatal(r.Err)
			}
			for i, s := range tc.steps {
				err := d.pin(t0+int64(i+1), s.cmd)
				if (s.want == nil) != (err == nil) || (s.want != nil && !errors.Is(err, s.want)) {
					t.Fatalf("step %d (%v): %v, want %v", i, s.cmd, err, s.want)
				}
				if h, sp := pins(t, d.f, "k"); h != s.hard || sp != s.softPin {
					t.Fatalf("step %d (%v): k pinned hard=%v soft until %d, want hard=%v soft until %d", i, s.cmd, h, sp, s.hard, s.softPin)
				}
			}
			// A failed pin leaves the PROCESSING put unpinned and invisible.
			if h, sp := pins(t, d.f, "proc"); h || sp != 0 || visible(t, d.f, "proc") {
				t.Fatalf("proc: hard=%v soft=%d visible=%v", h, sp, visible(t, d.f, "proc"))
			}
			// Pins show in listings.
			h, sp := pins(t, d.f, "k")
			info := d.f.infos([]string{"k"})[0]
			if info.HardPinned != h || info.SoftPinUntilUnixMs != sp/1e6 {
				t.Fatalf("info of k = %v, want hard %v soft until %d ms", info, h, sp/1e6)
			}
			checkInvariants(t, d.f)
		})
	}
}

func TestFSMEvict(t *testing.T) {
	const now = t0 + 100
	tests := []struct {
		name      string
		pin       *pb.PinCmd // applied to "k" at t0+1; nil: none
		key       string     // evicted; default "k"
		allowSoft bool
		want      error
	}{
		{name: "unpinned", want: nil},
		{name: "unpinned, soft allowed", allowSoft: true},
		{name: "hard pinned", pin: &pb.PinCmd{Key: "k", Hard: true}, want: ErrPinned},
		{name: "hard pinned, soft allowed", pin: &pb.PinCmd{Key: "k", Hard: true}, allowSoft: true, want: ErrPinned},
		{name: "hard and soft pinned, soft allowed", pin: &pb.PinCmd{Key: "k", Hard: true, SoftUntilUnixNano: now + 1}, allowSoft: true, want: ErrPinned},
		{name: "active soft pin", pin: &pb.PinCmd{Key: "k", SoftUntilUnixNano: now + 1}, want: ErrPinned},
		{name: "active soft pin, soft allowed", pin: &pb.PinCmd{Key: "k", SoftUntilUnixNano: now + 1}, allowSoft: true},
		{name: "soft pin ending now", pin: &pb.PinCmd{Key: "k", SoftUntilUnixNano: now}},
		{name: "expired soft pin", pin: &pb.PinCmd{Key: "k", SoftUntilUnixNano: now - 50}},
		{name: "missing", key: "missing", want: ErrNotFound},
		{name: "missing, soft allowed", key: "missing", allowSoft: true, want: ErrNotFound},
		{name: "processing", key: "proc", want: ErrNotFound},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := newDriver(t)
			seg := d.register(t0, "n1", "ep", dram("a", 4096)).SegmentIDs[0]
			d.put(t0, "k", 100, seg)
			d.put(t0, "other", 100, seg)
			if r := d.putStart(t0, "proc", 100, t0+1e12, seg); r.Err != nil {
				t.Fatal(r.Err)
			}
			if tc.pin != nil {
				if err := d.pin(t0+1, tc.pin); err != nil {
					t.Fatal(err)
				}
			}
			key := cmp.Or(tc.key, "k")
			before := d.segment(seg)
			wasVisible := visible(t, d.f, key)
			err := d.evict(now, key, 0, tc.allowSoft)
			if (tc.want == nil) != (err == nil) || (tc.want != nil && !errors.Is(err, tc.want)) {
				t.Fatalf("evict %q: %v, want %v", key, err, tc.want)
			}
			after := d.segment(seg)
			if tc.want != nil {
				if visible(t, d.f, key) != wasVisible || after != before {
					t.Fatalf("a refused evict changed the state: visible %v -> %v, segment %+v -> %+v", wasVisible, visible(t, d.f, key), before, after)
				}
			} else {
				if visible(t, d.f, key) || slices.Contains(listKeys(d.f), key) {
					t.Fatalf("%q still listed after its eviction", key)
				}
				if after.used != before.used-128 || after.objects != before.objects-1 {
					t.Fatalf("segment %+v after evicting from %+v: want 128 bytes and one object freed at once", after, before)
				}
				// Evicting again finds nothing.
				if err := d.evict(now+1, key, 0, true); !errors.Is(err, ErrNotFound) {
					t.Fatalf("second evict: %v, want ErrNotFound", err)
				}
			}
			if !visible(t, d.f, "other") {
				t.Fatal("evict removed another object")
			}
			checkInvariants(t, d.f)
		})
	}
}

func TestFSMEvictBatch(t *testing.T) {
	d := newDriver(t)
	seg := d.register(t0, "n1", "ep", dram("a", 4096)).SegmentIDs[0]
	for _, k := range []string{"a", "hard", "soft", "b"} {
		d.put(t0, k, 64, seg)
	}
	if err := d.pin(t0, &pb.PinCmd{Key: "hard", Hard: true}); err != nil {
		t.Fatal(err)
	}
	if err := d.pin(t0, &pb.PinCmd{Key: "soft", SoftUntilUnixNano: t0 + 1e9}); err != nil {
		t.Fatal(err)
	}
	out := d.apply(t0+1, &pb.Command{Op: &pb.Command_Evict{Evict: &pb.EvictCmd{Keys: []string{"a", "hard", "soft", "b", "a", "nope"}}}})
	errs, ok := out.([]error)
	if !ok || len(errs) != 6 {
		t.Fatalf("Apply = %T %v, want 6 results", out, out)
	}
	want := []error{nil, ErrPinned, ErrPinned, nil, ErrNotFound, ErrNotFound}
	for i, w := range want {
		if (w == nil) != (errs[i] == nil) || (w != nil && !errors.Is(errs[i], w)) {
			t.Errorf("item %d: %v, want %v", i, errs[i], w)
		}
	}
	if keys := listKeys(d.f); !slices.Equal(keys, []string{"hard", "soft"}) {
		t.Fatalf("objects after the batch: %v", keys)
	}
	if v := d.segment(seg); v.used != 128 || v.objects != 2 {
		t.Fatalf("segment after the batch: %+v", v)
	}
	checkInvariants(t, d.f)
}

func TestFSMEvictDefersFree(t *testing.T) {
	d := newDriver(t)
	seg := d.register(t0, "n1", "ep", dram("a", 4096)).SegmentIDs[0]
	d.put(t0, "k", 1000, seg)
	d.put(t0, "keep", 100, seg)
	freeAfter := t0 + 1000
	if err := d.evict(t0+10, "k", freeAfter, false); err != nil {
		t.Fatal(err)
	}
	if visible(t, d.f, "k") || slices.Contains(listKeys(d.f), "k") {
		t.Fatal("an evicted object is still listed")
	}
	if v := d.segment(seg); v.used != 1024+128 || v.objects != 1 {
		t.Fatalf("space freed before free_after: %+v", v)
	}
	// A put in the meantime does not land on the reserved range.
	if ext := d.put(t0+20, "other", 64, seg); ext.Offset < 1024+128 {
		t.Fatalf("a put reused the evicted range at offset %d", ext.Offset)
	}
	d.tick(freeAfter - 1)
	if v := d.segment(seg); v.used != 1024+128+64 {
		t.Fatalf("used = %d just before free_after", v.used)
	}
	checkInvariants(t, d.f)
	// The key may be put again at once; its old range is still reserved.
	if ext := d.put(freeAfter-1, "k", 64, seg); ext.Offset < 1024 {
		t.Fatalf("the re-put key landed on its own reserved range at %d", ext.Offset)
	}
	// The first command at or past free_after releases the range.
	d.tick(freeAfter)
	if v := d.segment(seg); v.used != 128+64+64 || v.objects != 3 {
		t.Fatalf("after free_after: %+v", v)
	}
	if r := d.putStart(freeAfter+1, "big", 1024, freeAfter+1e9, seg); r.Err != nil || r.Replicas[0].Offset != 0 {
		t.Fatalf("put into the freed range = %+v, want offset 0", r)
	}
	checkInvariants(t, d.f)
}

func TestFSMPinsSnapshotRestore(t *testing.T) {
	d := newDriver(t)
	seg := d.register(t0, "n1", "ep", dram("a", 1<<20)).SegmentIDs[0]
	for _, k := range []string{"hard", "soft", "both", "plain", "evicted"} {
		d.put(t0, k, 1000, seg)
	}
	for _, c := range []*pb.PinCmd{
		{Key: "hard", Hard: true},
		{Key: "soft", SoftUntilUnixNano: t0 + 5e9},
		{Key: "both", Hard: true},
		{Key: "both", SoftUntilUnixNano: t0 + 7e9},
		{Key: "evicted", Hard: true},
		{Key: "evicted", Unpin: true},
	} {
		if err := d.pin(t0+1, c); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.evict(t0+2, "evicted", t0+5e9, false); err != nil {
		t.Fatal(err)
	}
	data := snapshotBytes(t, d.f)
	g := restored(t, data)
	sameState(t, d.f, g)
	if again := snapshotBytes(t, g); !bytes.Equal(again, data) {
		t.Fatal("a restored FSM snapshots differently")
	}
	want := map[string]struct {
		hard bool
		soft int64
	}{"hard": {true, 0}, "soft": {false, t0 + 5e9}, "both": {true, t0 + 7e9}, "plain": {false, 0}}
	for k, w := range want {
		if h, s := pins(t, g, k); h != w.hard || s != w.soft {
			t.Errorf("%s after restore: hard=%v soft=%d, want hard=%v soft=%d", k, h, s, w.hard, w.soft)
		}
	}
	// Both FSMs decide evictions alike from here on.
	e := &fsmDriver{t: t, f: g, index: d.index}
	for _, dr := range []*fsmDriver{d, e} {
		for _, c := range []struct {
			key       string
			allowSoft bool
			want      error
		}{
			{"hard", true, ErrPinned},
			{"both", true, ErrPinned},
			{"soft", false, ErrPinned},
			{"plain", false, nil},
		} {
			if err := dr.evict(t0+4e9, c.key, 0, c.allowSoft); (c.want == nil) != (err == nil) || (c.want != nil && !errors.Is(err, c.want)) {
				t.Fatalf("evict %s: %v, want %v", c.key, err, c.want)
			}
		}
		// The evicted object's range was still reserved when the snapshot
		// was taken; it is released at free_after on both.
		if v := dr.segment(seg); v.used != 4*1024 {
			t.Fatalf("used %d before free_after, want 4 KiB", v.used)
		}
		// Past the soft pin, it goes too.
		if err := dr.evict(t0+6e9, "soft", 0, false); err != nil {
			t.Fatalf("evict of an expired soft pin: %v", err)
		}
		if v := dr.segment(seg); v.used != 2*1024 {
			t.Fatalf("used %d after free_after, want 2 KiB", v.used)
		}
	}
	sameState(t, d.f, g)
}

// TestFSMDeterminismPinEvict interleaves pins and evictions with the random
// command stream: replicas and a restored copy must agree throughout. The
// pins and evictions mostly name complete objects of the first FSM, so
// they take effect; the others get exactly the same commands.
func TestFSMDeterminismPinEvict(t *testing.T) {
	for seed := range uint64(3) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 42))
			a, b := NewFSM(), NewFSM()
			var c *FSM
			index := uint64(0)
			evicted, pinned, refused := 0, 0, 0
			apply := func(cmd *pb.Command) string {
				index++
				ra := applyRaw(t, a, index, cmd)
				if rb := applyRaw(t, b, index, cmd); ra != rb {
					t.Fatalf("command %d (%v) returned %s and %s", index, cmd, ra, rb)
				}
				if c != nil {
					if rc := applyRaw(t, c, index, cmd); rc != ra {
						t.Fatalf("command %d (%v) on the restored FSM returned %s, want %s", index, cmd, rc, ra)
					}
				}
				checkInvariants(t, a)
				return ra
			}
			cmds := randomCommands(seed+100, 1200)
			for i, cmd := range cmds {
				if i == len(cmds)/2 {
					c = restored(t, snapshotBytes(t, a))
				}
				apply(cmd)
				key := fmt.Sprintf("key%02d", rng.IntN(40))
				if objs := a.completeObjects(func(string) bool { return true }); len(objs) > 0 && rng.IntN(4) > 0 {
					key = objs[rng.IntN(len(objs))].key
				}
				now := cmd.NowUnixNano
				switch rng.IntN(8) {
				case 0, 1:
					if apply(&pb.Command{NowUnixNano: now, Op: &pb.Command_Pin{Pin: &pb.PinCmd{
						Key: key, Hard: rng.IntN(3) == 0, SoftUntilUnixNano: now + rng.Int64N(300),
					}}}) == "[<nil>]" {
						pinned++
					}
				case 2:
					apply(&pb.Command{NowUnixNano: now, Op: &pb.Command_Pin{Pin: &pb.PinCmd{Key: key, Unpin: true}}})
				case 3, 4:
					out := apply(&pb.Command{NowUnixNano: now, Op: &pb.Command_Evict{Evict: &pb.EvictCmd{
						Keys: []string{key, key}, FreeAfterUnixNano: now - 100 + rng.Int64N(400), AllowSoftPinned: rng.IntN(2) == 0,
					}}})
					if strings.HasPrefix(out, "[<nil>") {
						evicted++
					}
					if strings.Contains(out, "pinned") {
						refused++
					}
				}
			}
			if !bytes.Equal(snapshotBytes(t, a), snapshotBytes(t, c)) {
				t.Fatal("an FSM restored half way snapshots differently at the end")
			}
			sameState(t, a, b)
			sameState(t, a, c)
			if evicted < 5 || pinned < 10 || refused < 3 {
				t.Fatalf("%d evictions, %d pins, %d refused evictions: the stream exercises too little", evicted, pinned, refused)
			}
			t.Logf("%d evictions, %d pins, %d refused evictions", evicted, pinned, refused)
		})
	}
}

// A leader's FSM takes a publish it proposed as it is; the same bytes
// elsewhere (a follower's copy, or once the proposal is done) are decoded.
func TestFSMTakesProposedCommands(t *testing.T) {
	f := NewFSM()
	cmd := &pb.Command{NowUnixNano: t0, Op: &pb.Command_Publish{Publish: &pb.PublishCmd{Items: []*pb.PublishItem{{Key: "k", Size: 1}}}}}
	data, err := proto.Marshal(cmd)
	if err != nil {
		t.Fatal(err)
	}
	key := unsafe.SliceData(data)
	f.proposed.Store(key, cmd)
	if got, err := f.command(&raft.Log{Index: 1, Data: data}); err != nil || got != cmd {
		t.Fatalf("command of the proposed bytes = %p, %v; want the proposed %p", got, err, cmd)
	}
	for name, d := range map[string][]byte{"a copy": slices.Clone(data), "done": data} {
		if name == "done" {
			f.proposed.Delete(key)
		}
		got, err := f.command(&raft.Log{Index: 1, Data: d})
		if err != nil || got == cmd || !proto.Equal(got, cmd) {
			t.Fatalf("command of %s = %p %v, %v; want a decoded copy of %v", name, got, got, err, cmd)
		}
	}
}

// A publish in columns, as leaders propose it, does to the FSM exactly
// what the same items do as a PublishCmd (the form older leaders' logs
// hold), whatever each item's fate; columns that do not line up are
// refused whole.
func TestPublishColumnsAsItems(t *testing.T) {
	now := t0 + 1000
	// Into the reservation fuzzFSM made, from where its space starts.
	reserved := func(d *fsmDriver) (id, at uint64) {
		r := d.f.segments["n2/a@1"].resv[0]
		return r.id, r.spans[0].off
	}
	items := func(resv, at uint64) []*pb.PublishItem {
		ext := func(seg string, off uint64) []*pb.Extent {
			return []*pb.Extent{{Segment: seg, Offset: at + off, Length: 64}}
		}
		return []*pb.PublishItem{
			{Key: "p0", Size: 64, Replicas: ext("n2/a@1", 0), Reservations: []uint64{resv}, PutId: 9 << 40, ReplicasWanted: 2},
			{Key: "p1", Size: 64, Replicas: ext("n2/a@1", 64), Reservations: []uint64{resv}, Parent: "p0", Tenant: "t"},
			{Key: "k0", Size: 64, Replicas: ext("n2/a@1", 128), Reservations: []uint64{resv}},     // already complete
			{Key: "p2", Size: 64, Replicas: ext("n2/a@1", 0), Reservations: []uint64{resv}},       // space p0 took
			{Key: "p3", Size: 64, Replicas: ext("n9/a@1", 0), Reservations: []uint64{resv}},       // no such segment
			{Key: "p4", Size: 64, Replicas: ext("n2/a@1", 192), Reservations: []uint64{resv + 1}}, // no such reservation
			{Key: "p5", Size: 0, Replicas: ext("n2/a@1", 256), Reservations: []uint64{resv}},      // empty
			{Key: "p6", Size: 64, Replicas: ext("n2/a@1", 320), Reservations: []uint64{resv}, Tenant: "u"},
		}
	}
	var outs []any
	var snaps [][]byte
	for _, columns := range []bool{false, true} {
		d := fuzzFSM(t)
		its := items(reserved(d))
		cmd := &pb.Command{Op: &pb.Command_Publish{Publish: &pb.PublishCmd{Items: its}}}
		if columns {
			cmd.Op = &pb.Command_PublishColumns{PublishColumns: columnsOf(its)}
		}
		outs = append(outs, d.apply(now, cmd))
		snaps = append(snaps, snapshotBytes(t, d.f))
		countsAgree(t, d.f)
	}
	a, b := outs[0].([]error), outs[1].([]error)
	if len(a) != len(b) || len(a) != 8 {
		t.Fatalf("results %v and %v", a, b)
	}
	for i := range a {
		if fmt.Sprint(a[i]) != fmt.Sprint(b[i]) {
			t.Errorf("item %d: %v as an item, %v in columns", i, a[i], b[i])
		}
	}
	if a[0] != nil || a[1] != nil || a[2] != nil || a[3] == nil || a[4] == nil || a[5] == nil || a[6] == nil || a[7] != nil {
		t.Errorf("results %v; want p0, p1, k0 and p6 published, the others refused", a)
	}
	if !bytes.Equal(snaps[0], snaps[1]) {
		t.Error("the FSM's state after the columns differs from after the items")
	}

	bad := []func(c *pb.PublishColumnsCmd){
		func(c *pb.PublishColumnsCmd) { c.Sizes = c.Sizes[1:] },
		func(c *pb.PublishColumnsCmd) { c.Parents = c.Parents[1:] },
		func(c *pb.PublishColumnsCmd) { c.ParentLengths = c.ParentLengths[1:] },
		func(c *pb.PublishColumnsCmd) { c.Keys = c.Keys[1:] },
		func(c *pb.PublishColumnsCmd) { c.KeyLengths[0]++ },
		func(c *pb.PublishColumnsCmd) { c.KeyLengths = c.KeyLengths[1:] },
		func(c *pb.PublishColumnsCmd) { c.KeyList = []string{"x"} },
		func(c *pb.PublishColumnsCmd) { c.ParentList = []string{"x"} },
		func(c *pb.PublishColumnsCmd) { c.KeyList, c.KeyLengths, c.Keys = []string{"x"}, nil, nil },
		func(c *pb.PublishColumnsCmd) { c.Tenants[1] = 7 },
		func(c *pb.PublishColumnsCmd) { c.Segments[0] = 3 },
		func(c *pb.PublishColumnsCmd) { c.ReplicaCounts[0] = 2 },
		func(c *pb.PublishColumnsCmd) { c.Reservations = c.Reservations[1:] },
	}
	for i, spoil := range bad {
		d := fuzzFSM(t)
		before := snapshotBytes(t, d.f)
		c := columnsOf(items(reserved(d)))
		spoil(c)
		out := d.apply(now, &pb.Command{Op: &pb.Command_PublishColumns{PublishColumns: c}})
		if err, ok := out.(error); !ok || !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("spoiled columns %d: Apply = %v; want ErrInvalidRequest", i, out)
		}
		if !bytes.Equal(before, snapshotBytes(t, d.f)) {
			t.Errorf("spoiled columns %d changed the FSM", i)
		}
	}
}
