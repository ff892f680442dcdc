package master

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// FSM-level tests of copies: CopyStart allocates a target, CopyEnd
// publishes or abandons it, and whatever ends an object ends its copy.

const (
	demote  = pb.CopyReason_COPY_REASON_DEMOTE
	promote = pb.CopyReason_COPY_REASON_PROMOTE
	drain   = pb.CopyReason_COPY_REASON_DRAIN
)

func (d *fsmDriver) copyStart(now int64, items ...*pb.CopyStartItem) []CopyStartResult {
	d.t.Helper()
	out := d.apply(now, &pb.Command{Op: &pb.Command_CopyStart{CopyStart: &pb.CopyStartCmd{Items: items}}})
	res, ok := out.([]CopyStartResult)
	if !ok || len(res) != len(items) {
		d.t.Fatalf("copy start: Apply returned %T %v", out, out)
	}
	return res
}

// startCopy starts one copy and fails the test unless it starts.
func (d *fsmDriver) startCopy(now int64, key, source string, reason pb.CopyReason, deadline int64, candidates ...string) *pb.PendingCopy {
	d.t.Helper()
	r := d.copyStart(now, &pb.CopyStartItem{Key: key, Source: source, Candidates: candidates, DeadlineUnixNano: deadline, Reason: reason})[0]
	if r.Err != nil || r.Copy == nil {
		d.t.Fatalf("copy start %q from %s: %+v", key, source, r)
	}
	return r.Copy
}

func (d *fsmDriver) copyEnd(now, freeAfter int64, items ...*pb.CopyEndItem) []CopyEndResult {
	d.t.Helper()
	out := d.apply(now, &pb.Command{Op: &pb.Command_CopyEnd{CopyEnd: &pb.CopyEndCmd{Items: items, FreeAfterUnixNano: freeAfter}}})
	res, ok := out.([]CopyEndResult)
	if !ok || len(res) != len(items) {
		d.t.Fatalf("copy end: Apply returned %T %v", out, out)
	}
	return res
}

func (d *fsmDriver) dropReplica(now int64, c *pb.DropReplicaCmd) bool {
	d.t.Helper()
	out := d.apply(now, &pb.Command{Op: &pb.Command_DropReplica{DropReplica: c}})
	dropped, ok := out.(bool)
	if !ok {
		d.t.Fatalf("drop replica: Apply returned %T %v", out, out)
	}
	return dropped
}

// copiesOf lists the copies of key in flight.
func copiesOf(f *FSM, key string) []*pb.PendingCopy {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if o := f.objects.get(key); o != nil {
		return slices.Clone(f.copies(o))
	}
	return nil
}

// replicaSegments lists the segments of key's readable replicas, fastest
// tier first (as readers get them); nil if it is not readable.
func replicaSegments(f *FSM, key string) []string {
	var out []string
	for _, r := range f.replicasOf([]string{key})[0].Replicas {
		out = append(out, r.Segment)
	}
	return out
}

// The copy tests run on node n1 (a DRAM and an SSD segment) and n2 (an SSD
// segment), with "k" (100 bytes) on n1's DRAM and n2 full.
const (
	n1dram = "n1/a@1"
	n1ssd  = "n1/b@1"
	n2ssd  = "n2/b@1"
)

func newCopyDriver(t *testing.T) *fsmDriver {
	t.Helper()
	d := newDriver(t)
	d.register(t0, "n1", "ep1", dram("a", 4096), ssd("b", 8192))
	d.register(t0, "n2", "ep2", ssd("b", 4096))
	d.put(t0, "k", 100, n1dram)
	d.put(t0, "full", 4096, n2ssd)
	return d
}

func TestFSMCopyStart(t *testing.T) {
	const deadline = t0 + 1e9
	item := func(mod func(*pb.CopyStartItem)) *pb.CopyStartItem {
		it := &pb.CopyStartItem{Key: "k", Source: n1dram, Candidates: []string{n1dram, "gone/x@1", n2ssd, n1ssd}, DeadlineUnixNano: deadline, Reason: demote}
		if mod != nil {
			mod(it)
		}
		return it
	}
	for _, tc := range []struct {
		name  string
		setup func(d *fsmDriver)
		item  func(d *fsmDriver) *pb.CopyStartItem
		// wantErr is the error; else the copy lands at wantTarget.
		wantErr    error
		wantTarget *pb.Extent
	}{
		{
			// The source's own segment holds a replica, gone/x@1 does not
			// exist, n2 is full: the first with room is n1's SSD.
			name:       "first candidate with room and no replica",
			item:       func(*fsmDriver) *pb.CopyStartItem { return item(nil) },
			wantTarget: &pb.Extent{Segment: n1ssd, Offset: 0, Length: 100},
		},
		{
			name: "the put id of the object",
			item: func(d *fsmDriver) *pb.CopyStartItem {
				return item(func(it *pb.CopyStartItem) { it.PutId = d.f.objects.get("k").putID })
			},
			wantTarget: &pb.Extent{Segment: n1ssd, Offset: 0, Length: 100},
		},
		{
			name: "a stale put id",
			item: func(d *fsmDriver) *pb.CopyStartItem {
				return item(func(it *pb.CopyStartItem) { it.PutId = d.f.objects.get("k").putID + 1 })
			},
			wantErr: ErrNotFound,
		},
		{
			name:    "an unknown key",
			item:    func(*fsmDriver) *pb.CopyStartItem { return item(func(it *pb.CopyStartItem) { it.Key = "nope" }) },
			wantErr: ErrNotFound,
		},
		{
			name: "an object still being put",
			setup: func(d *fsmDriver) {
				if r := d.putStart(t0, "p", 100, deadline, n1dram); r.Err != nil {
					d.t.Fatal(r.Err)
				}
			},
			item:    func(*fsmDriver) *pb.CopyStartItem { return item(func(it *pb.CopyStartItem) { it.Key = "p" }) },
			wantErr: ErrNotFound,
		},
		{
			name:    "a source that is not a replica",
			item:    func(*fsmDriver) *pb.CopyStartItem { return item(func(it *pb.CopyStartItem) { it.Source = n1ssd }) },
			wantErr: ErrNotFound,
		},
		{
			name: "no candidate with room",
			item: func(*fsmDriver) *pb.CopyStartItem {
				return item(func(it *pb.CopyStartItem) { it.Candidates = []string{n1dram, n2ssd, "gone/x@1"} })
			},
			wantErr: ErrNoSpace,
		},
		{
			name:    "no candidates",
			item:    func(*fsmDriver) *pb.CopyStartItem { return item(func(it *pb.CopyStartItem) { it.Candidates = nil }) },
			wantErr: ErrNoSpace,
		},
		{
			name:    "a second copy of the object",
			setup:   func(d *fsmDriver) { d.startCopy(t0, "k", n1dram, promote, deadline, n1ssd) },
			item:    func(*fsmDriver) *pb.CopyStartItem { return item(nil) },
			wantErr: ErrCopyInProgress,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newCopyDriver(t)
			if tc.setup != nil {
				tc.setup(d)
			}
			before := copiesOf(d.f, "k")
			usedBefore := d.segment(n1ssd).used
			it := tc.item(d)
			r := d.copyStart(t0+1, it)[0]
			checkInvariants(t, d.f)
			if tc.wantErr != nil {
				if !errors.Is(r.Err, tc.wantErr) || r.Copy != nil {
					t.Fatalf("copy start = %+v, want %v", r, tc.wantErr)
				}
				if got := copiesOf(d.f, "k"); len(got) != len(before) || d.segment(n1ssd).used != usedBefore {
					t.Fatalf("a refused copy start changed the state: copies %v, used %d", got, d.segment(n1ssd).used)
				}
				return
			}
			want := &pb.PendingCopy{Id: d.index << 16, Target: tc.wantTarget, Source: it.Source, DeadlineUnixNano: deadline, Reason: it.Reason}
			if r.Err != nil || !proto.Equal(r.Copy, want) {
				t.Fatalf("copy start = %+v, want copy %v", r, want)
			}
			if got := copiesOf(d.f, "k"); len(got) != 1 || !proto.Equal(got[0], want) {
				t.Fatalf("copies of k = %v", got)
			}
			// The target holds room but is no replica yet.
			if v := d.segment(n1ssd); v.used != 4096 || v.objects != 0 {
				t.Fatalf("target segment %+v", v)
			}
			if got := replicaSegments(d.f, "k"); !slices.Equal(got, []string{n1dram}) {
				t.Fatalf("replicas of k = %v: a copy in flight is readable", got)
			}
		})
	}

	t.Run("batch", func(t *testing.T) {
		d := newCopyDriver(t)
		d.put(t0, "j", 200, n1dram)
		res := d.copyStart(t0+1,
			&pb.CopyStartItem{Key: "j", Source: n1dram, Candidates: []string{n1ssd}, DeadlineUnixNano: deadline, Reason: demote},
			&pb.CopyStartItem{Key: "k", Source: n1dram, Candidates: []string{n1ssd}, DeadlineUnixNano: deadline, Reason: demote},
			&pb.CopyStartItem{Key: "k", Source: n1dram, Candidates: []string{n1ssd}, DeadlineUnixNano: deadline, Reason: demote},
		)
		if res[0].Err != nil || res[1].Err != nil || !errors.Is(res[2].Err, ErrCopyInProgress) {
			t.Fatalf("batch = %+v", res)
		}
		if res[0].Copy.Id != d.index<<16 || res[1].Copy.Id != d.index<<16|1 {
			t.Fatalf("copy ids %d, %d at index %d", res[0].Copy.Id, res[1].Copy.Id, d.index)
		}
		if res[0].Copy.Target.Offset != 0 || res[1].Copy.Target.Offset != 4096 {
			t.Fatalf("targets %v and %v overlap or are misaligned", res[0].Copy.Target, res[1].Copy.Target)
		}
		checkInvariants(t, d.f)
	})
}

func TestFSMCopyEnd(t *testing.T) {
	const (
		start     = t0 + 10
		deadline  = t0 + 1e9
		freeAfter = t0 + 500 // the last read lease of the key
	)
	type ending struct {
		now       int64
		failed    bool
		expired   bool // the sweep's OnlyExpired
		freeAfter int64
	}
	for _, tc := range []struct {
		name   string
		reason pb.CopyReason
		end    ending
		// What the end returns, and the replicas after it.
		wantErr  error
		wantDone bool
		wantReps []string
		// When the source's and the target's room is free: 0 never, -1 at once.
		srcFree, dstFree int64
	}{
		{name: "demote", reason: demote, end: ending{now: start + 1, freeAfter: freeAfter},
			wantDone: true, wantReps: []string{n1ssd}, srcFree: freeAfter, dstFree: 0},
		{name: "demote, no lease", reason: demote, end: ending{now: start + 1},
			wantDone: true, wantReps: []string{n1ssd}, srcFree: -1, dstFree: 0},
		{name: "drain", reason: drain, end: ending{now: start + 1, freeAfter: freeAfter},
			wantDone: true, wantReps: []string{n1ssd}, srcFree: freeAfter, dstFree: 0},
		{name: "promote keeps the source", reason: promote, end: ending{now: start + 1, freeAfter: freeAfter},
			wantDone: true, wantReps: []string{n1dram, n1ssd}, srcFree: 0, dstFree: 0},
		{name: "at the deadline", reason: demote, end: ending{now: deadline},
			wantDone: true, wantReps: []string{n1ssd}, srcFree: -1, dstFree: 0},
		{name: "failed", reason: demote, end: ending{now: start + 1, failed: true},
			wantReps: []string{n1dram}, srcFree: 0, dstFree: -1},
		{name: "failed promote", reason: promote, end: ending{now: start + 1, failed: true},
			wantReps: []string{n1ssd}, srcFree: 0, dstFree: -1},
		{name: "expired, before the deadline", reason: demote, end: ending{now: deadline, expired: true},
			wantErr: ErrNotInProgress, wantReps: []string{n1dram}, srcFree: 0, dstFree: 0},
		{name: "expired", reason: demote, end: ending{now: deadline + 1, expired: true},
			wantErr: ErrNotInProgress, wantReps: []string{n1dram}, srcFree: 0, dstFree: deadline + 1 + lateWriteGrace},
		{name: "reported after the deadline", reason: demote, end: ending{now: deadline + 1, freeAfter: freeAfter},
			wantErr: ErrNotInProgress, wantReps: []string{n1dram}, srcFree: 0, dstFree: deadline + 1 + lateWriteGrace},
		{name: "failed after the deadline", reason: drain, end: ending{now: deadline + 7, failed: true},
			wantErr: ErrNotInProgress, wantReps: []string{n1dram}, srcFree: 0, dstFree: deadline + 7 + lateWriteGrace},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newCopyDriver(t)
			src, dst := n1dram, n1ssd
			if tc.reason == promote {
				d.remove(t0, "k", 0)
				d.put(t0, "k", 100, n1ssd)
				src, dst = n1ssd, n1dram
			}
			c := d.startCopy(start, "k", src, tc.reason, deadline, dst)
			srcUsed, dstUsed := d.segment(src).used, d.segment(dst).used
			item := &pb.CopyEndItem{Key: "k", CopyId: c.Id, Failed: tc.end.failed, OnlyExpired: tc.end.expired}
			r := d.copyEnd(tc.end.now, tc.end.freeAfter, item)[0]
			checkInvariants(t, d.f)
			if !errors.Is(r.Err, tc.wantErr) || (tc.wantErr == nil && r.Err != nil) || r.Done != tc.wantDone {
				t.Fatalf("copy end = %+v, want err %v, done %v", r, tc.wantErr, tc.wantDone)
			}
			if tc.wantErr == nil || len(copiesOf(d.f, "k")) == 0 {
				if r.Reason != tc.reason || r.Size != 100 || r.Node != "n1" {
					t.Fatalf("copy end = %+v, want reason %v, size 100, node n1", r, tc.reason)
				}
			}
			if got := replicaSegments(d.f, "k"); !slices.Equal(got, tc.wantReps) {
				t.Fatalf("replicas %v, want %v", got, tc.wantReps)
			}
			// The room of each side is held until its time, then free.
			check := func(now int64) {
				t.Helper()
				for _, side := range []struct {
					seg        string
					used, free int64
				}{{src, int64(srcUsed), tc.srcFree}, {dst, int64(dstUsed), tc.dstFree}} {
					gone := side.free == -1 || (side.free > 0 && now >= side.free)
					want := side.used
					if gone {
						want = 0
					}
					if got := d.segment(side.seg).used; int64(got) != want {
						t.Fatalf("at %+d ns: %s used %d, want %d", now-t0, side.seg, got, want)
					}
				}
			}
			check(tc.end.now)
			for _, at := range []int64{tc.srcFree, tc.dstFree} {
				if at > 0 {
					d.tick(at - 1)
					check(at - 1)
					d.tick(at)
					check(at)
				}
			}
			checkInvariants(t, d.f)
			if tc.wantErr != nil && tc.end.expired && tc.end.now <= deadline {
				// Refused before the deadline: the copy is still there and
				// ends well when its store reports it.
				if r := d.copyEnd(deadline, 0, &pb.CopyEndItem{Key: "k", CopyId: c.Id})[0]; r.Err != nil || !r.Done {
					t.Fatalf("copy end after a refused expiry = %+v", r)
				}
				checkInvariants(t, d.f)
				return
			}
			// Ended: a second end (a store reporting twice) changes nothing.
			before := snapshotBytes(t, d.f)
			if r := d.copyEnd(tc.end.now, 0, item)[0]; !errors.Is(r.Err, ErrNotInProgress) || r.Done || r.Reason != pb.CopyReason_COPY_REASON_UNSPECIFIED {
				t.Fatalf("second copy end = %+v", r)
			}
			if !bytes.Equal(before, snapshotBytes(t, d.f)) {
				t.Fatal("a second copy end changed the state")
			}
			// The object may be copied again.
			if len(tc.wantReps) == 1 {
				if r := d.copyStart(tc.end.now, &pb.CopyStartItem{Key: "k", Source: tc.wantReps[0], Candidates: []string{n1dram, n1ssd}, DeadlineUnixNano: deadline * 2, Reason: demote})[0]; r.Err != nil {
					t.Fatalf("copy after the end: %v", r.Err)
				}
			}
		})
	}

	t.Run("unknown copy", func(t *testing.T) {
		d := newCopyDriver(t)
		c := d.startCopy(start, "k", n1dram, demote, deadline, n1ssd)
		res := d.copyEnd(start, 0, &pb.CopyEndItem{Key: "k", CopyId: c.Id + 1}, &pb.CopyEndItem{Key: "nope", CopyId: c.Id})
		for _, r := range res {
			if !errors.Is(r.Err, ErrNotInProgress) || r.Done {
				t.Fatalf("end of an unknown copy = %+v", r)
			}
		}
		if len(copiesOf(d.f, "k")) != 1 {
			t.Fatal("the end of an unknown copy ended another")
		}
	})
}

// TestFSMCopyTask: the task for a started copy names both replicas, and
// there is none once its source or target is gone.
func TestFSMCopyTask(t *testing.T) {
	d := newDriver(t)
	d.register(t0, "n1", "ep1", dram("a", 4096), ssd("b", 8192))
	d.register(t0, "n2", "ep2", dram("a", 4096))
	d.apply(t0, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{{
		Key: "k", Size: 100, Checksum: 9, Replicas: 2, Candidates: []string{n1dram, "n2/a@1"}, DeadlineUnixNano: t0 + 10,
	}}}}})
	if err := d.putEnd(t0, "k"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Unix(0, t0+1e9)
	// A promotion from SSD would list the target first by tier; the task
	// still names the source as the source.
	c := d.startCopy(t0+1, "k", n1dram, demote, deadline.UnixNano(), n1ssd)
	task, node, ok := d.f.copyTask("k", c, deadline)
	if !ok || node != "n1" || task.Id != c.Id || task.Key != "k" || task.Size != 100 || task.Checksum != 9 ||
		task.Source.Segment != n1dram || task.Source.Tier != pb.Tier_TIER_DRAM || task.Target.Segment != n1ssd || task.Target.Offset != c.Target.Offset {
		t.Fatalf("copy task = %v on %q, %v", task, node, ok)
	}
	// The source replica is found corrupt and dropped before the task is
	// queued: no task (and no panic).
	if !d.dropReplica(t0+2, &pb.DropReplicaCmd{Key: "k", Segment: n1dram, Checksum: 9}) {
		t.Fatal("not dropped")
	}
	if task, _, ok := d.f.copyTask("k", c, deadline); ok {
		t.Fatalf("copy task from a dropped source: %v", task)
	}
	d.nodeDown(t0+3, "n1", 1)
	if task, _, ok := d.f.copyTask("k", c, deadline); ok {
		t.Fatalf("copy task on a node that went: %v", task)
	}
}

// TestFSMCopyOutlivedByObject: an object removed, evicted or lost while a
// copy of it runs frees the copy's target only once its copier must have
// stopped: at the deadline plus the late-write grace.
func TestFSMCopyOutlivedByObject(t *testing.T) {
	const deadline = t0 + 1e9
	for _, tc := range []struct {
		name string
		end  func(d *fsmDriver, now int64)
	}{
		{"remove", func(d *fsmDriver, now int64) {
			if err := d.remove(now, "k", 0); err != nil {
				d.t.Fatal(err)
			}
		}},
		{"evict", func(d *fsmDriver, now int64) {
			if err := d.evict(now, "k", now+100, false); err != nil {
				d.t.Fatal(err)
			}
		}},
		{"corrupt last replica", func(d *fsmDriver, now int64) {
			if !d.dropReplica(now, &pb.DropReplicaCmd{Key: "k", Segment: n1dram, Checksum: 100}) {
				d.t.Fatal("not dropped")
			}
		}},
		{"source node down", func(d *fsmDriver, now int64) {
			if out := d.nodeDown(now, "n1", 1); out != nil {
				d.t.Fatal(out)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newDriver(t)
			d.register(t0, "n1", "ep1", dram("a", 4096))
			d.register(t0, "n2", "ep2", ssd("b", 8192))
			d.put(t0, "k", 100, n1dram)
			d.startCopy(t0+1, "k", n1dram, demote, deadline, n2ssd)
			tc.end(d, t0+2)
			checkInvariants(t, d.f)
			if visible(t, d.f, "k") {
				t.Fatal("k is still there")
			}
			for _, at := range []int64{t0 + 3, deadline, deadline + lateWriteGrace - 1} {
				d.tick(at)
				if u := d.segment(n2ssd).used; u != 4096 {
					t.Fatalf("at %+d ns the target's room is freed (used %d): its copier may still write", at-t0, u)
				}
			}
			d.tick(deadline + lateWriteGrace)
			if u := d.segment(n2ssd).used; u != 0 {
				t.Fatalf("target's room still used (%d) after the grace", u)
			}
			checkInvariants(t, d.f)
		})
		// The copier's report says its writes have ended: the room is
		// free at once, not at the deadline.
		t.Run(tc.name+", reported", func(t *testing.T) {
			d := newDriver(t)
			d.register(t0, "n1", "ep1", dram("a", 4096))
			d.register(t0, "n2", "ep2", ssd("b", 8192))
			d.put(t0, "k", 100, n1dram)
			c := d.startCopy(t0+1, "k", n1dram, demote, deadline, n2ssd)
			tc.end(d, t0+2)
			if r := d.copyEnd(t0+3, 0, &pb.CopyEndItem{Key: "k", CopyId: c.Id, Failed: true})[0]; !errors.Is(r.Err, ErrNotInProgress) || r.Done {
				t.Fatalf("copy end after the object went = %+v", r)
			}
			if u := d.segment(n2ssd).used; u != 0 {
				t.Fatalf("target's room still used (%d) after its copier reported", u)
			}
			checkInvariants(t, d.f)
		})
	}

	t.Run("target node down", func(t *testing.T) {
		d := newDriver(t)
		d.register(t0, "n1", "ep1", dram("a", 4096))
		d.register(t0, "n2", "ep2", ssd("b", 8192))
		d.put(t0, "k", 100, n1dram)
		c := d.startCopy(t0+1, "k", n1dram, demote, deadline, n2ssd)
		d.nodeDown(t0+2, "n2", 1)
		checkInvariants(t, d.f)
		if len(copiesOf(d.f, "k")) != 0 || !visible(t, d.f, "k") {
			t.Fatalf("after the target's node went: copies %v, k visible %v", copiesOf(d.f, "k"), visible(t, d.f, "k"))
		}
		if r := d.copyEnd(t0+3, 0, &pb.CopyEndItem{Key: "k", CopyId: c.Id})[0]; !errors.Is(r.Err, ErrNotInProgress) {
			t.Fatalf("copy end to a segment that went = %+v", r)
		}
		if got := replicaSegments(d.f, "k"); !slices.Equal(got, []string{n1dram}) {
			t.Fatalf("replicas %v", got)
		}
		// Copied anew elsewhere.
		d.register(t0+4, "n3", "ep3", ssd("b", 8192))
		d.startCopy(t0+5, "k", n1dram, demote, deadline, "n3/b@1")
	})
}

// TestFSMDropReplicaKeepLast: a drop with keep_last (demotion, drain) never
// takes an object's last replica; one without (a corrupt replica) does.
func TestFSMDropReplicaKeepLast(t *testing.T) {
	d := newDriver(t)
	d.register(t0, "n1", "ep1", dram("a", 4096))
	d.register(t0, "n2", "ep2", dram("a", 4096))
	d.apply(t0, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{{
		Key: "pair", Size: 100, Checksum: 7, Replicas: 2, Candidates: []string{"n1/a@1", "n2/a@1"}, DeadlineUnixNano: t0 + 10,
	}}}}})
	if err := d.putEnd(t0, "pair"); err != nil {
		t.Fatal(err)
	}
	d.put(t0, "one", 100, "n1/a@1")
	drop := func(key, seg string, sum uint32, keepLast bool) bool {
		t.Helper()
		ok := d.dropReplica(t0+1, &pb.DropReplicaCmd{Key: key, Segment: seg, Checksum: sum, KeepLast: keepLast})
		checkInvariants(t, d.f)
		return ok
	}
	if drop("pair", "n1/a@1", 8, true) {
		t.Fatal("dropped with a wrong checksum")
	}
	if drop("pair", "n3/a@1", 7, true) {
		t.Fatal("dropped a replica on a segment the object is not on")
	}
	if !drop("pair", "n1/a@1", 7, true) {
		t.Fatal("keep_last refused to drop one of two replicas")
	}
	if got := replicaSegments(d.f, "pair"); !slices.Equal(got, []string{"n2/a@1"}) {
		t.Fatalf("replicas %v", got)
	}
	if drop("pair", "n2/a@1", 7, true) || !visible(t, d.f, "pair") {
		t.Fatal("keep_last dropped the last replica")
	}
	if drop("one", "n1/a@1", 100, true) || !visible(t, d.f, "one") {
		t.Fatal("keep_last dropped the only replica")
	}
	if !drop("one", "n1/a@1", 100, false) || visible(t, d.f, "one") {
		t.Fatal("a corrupt last replica was kept")
	}
}

// TestFSMCopySnapshotRestore: copies, parents, tenants and the drain marks
// survive a snapshot, and both FSMs go on alike.
func TestFSMCopySnapshotRestore(t *testing.T) {
	const deadline = t0 + 1e9
	d := newDriver(t)
	d.register(t0, "n1", "ep1", dram("a", 1<<16), ssd("b", 1<<20))
	d.register(t0, "n2", "ep2", dram("a", 1<<16), ssd("b", 1<<20))
	d.register(t0, "n3", "ep3", dram("a", 1<<16))
	d.register(t0, "n4", "ep4", dram("a", 1<<16))
	d.apply(t0, &pb.Command{Op: &pb.Command_PutStart{PutStart: &pb.PutStartCmd{Items: []*pb.PutStartItem{
		{Key: "root", Size: 100, Checksum: 1, Tenant: "acme", Candidates: []string{"n1/a@1"}, DeadlineUnixNano: deadline},
		{Key: "mid", Size: 200, Checksum: 2, Tenant: "acme", Parent: "root", Candidates: []string{"n1/a@1"}, DeadlineUnixNano: deadline},
		{Key: "leaf", Size: 300, Checksum: 3, Tenant: "acme", Parent: "mid", Candidates: []string{"n2/a@1"}, DeadlineUnixNano: deadline},
		{Key: "other", Size: 400, Checksum: 4, Tenant: "zeta", Parent: "gone", Candidates: []string{"n2/b@1"}, DeadlineUnixNano: deadline},
		{Key: "plain", Size: 500, Checksum: 5, Candidates: []string{"n3/a@1"}, DeadlineUnixNano: deadline},
	}}}})
	if errs := d.apply(t0, &pb.Command{Op: &pb.Command_PutEnd{PutEnd: &pb.KeysCmd{Keys: []string{"root", "mid", "leaf", "other", "plain"}}}}).([]error); countNil(errs) != 5 {
		t.Fatalf("put end: %v", errs)
	}
	const early = t0 + 1e6 // the deadline of a copy that expires
	d.startCopy(t0+1, "root", "n1/a@1", demote, deadline, "n1/b@1")
	d.startCopy(t0+1, "other", "n2/b@1", promote, deadline, "n2/a@1")
	d.startCopy(t0+1, "plain", "n3/a@1", drain, early+1, "n4/a@1")
	mid := d.startCopy(t0+1, "mid", "n1/a@1", demote, early, "n2/b@1")
	// A copy ended late leaves its target pending; n3 drains, n4 is drained.
	d.copyEnd(early+1, 0, &pb.CopyEndItem{Key: "mid", CopyId: mid.Id, OnlyExpired: true})
	d.apply(early+1, &pb.Command{Op: &pb.Command_Drain{Drain: &pb.DrainCmd{Node: "n3"}}})
	d.apply(early+1, &pb.Command{Op: &pb.Command_Drain{Drain: &pb.DrainCmd{Node: "n4"}}})
	if len(d.f.pending) == 0 || len(d.f.children) != 3 {
		t.Fatalf("setup: %d pending, children %v", len(d.f.pending), d.f.children)
	}
	checkInvariants(t, d.f)

	data := snapshotBytes(t, d.f)
	g := restored(t, data)
	sameState(t, d.f, g)
	checkInvariants(t, g)
	if again := snapshotBytes(t, g); !bytes.Equal(data, again) {
		t.Fatal("a restored FSM snapshots differently")
	}
	if got := g.segmentViews(); !slices.ContainsFunc(got, func(v segmentView) bool { return v.id == "n3/a@1" && v.draining }) {
		t.Fatalf("n3 not draining after the restore: %+v", got)
	}
	infos := g.infos([]string{"leaf", "other"})
	if infos[0].Parent != "mid" || infos[0].Tenant != "acme" || infos[1].Parent != "gone" || infos[1].Tenant != "zeta" {
		t.Fatalf("parent and tenant after the restore: %v", infos)
	}

	// Both go on alike: copies end, the drained node goes, the drain-held
	// copy target is released.
	e := &fsmDriver{t: t, f: g, index: d.index}
	for _, x := range []*fsmDriver{d, e} {
		ends := x.copyEnd(early+2, early+3,
			&pb.CopyEndItem{Key: "root", CopyId: copiesOf(x.f, "root")[0].Id},
			&pb.CopyEndItem{Key: "other", CopyId: copiesOf(x.f, "other")[0].Id, Failed: true},
			&pb.CopyEndItem{Key: "plain", CopyId: copiesOf(x.f, "plain")[0].Id, OnlyExpired: true},
		)
		if ends[0].Err != nil || !ends[0].Done || ends[1].Err != nil || ends[1].Done || ends[2].Err == nil {
			t.Fatalf("copy ends = %+v", ends)
		}
		// n4 holds only the expired copy's target, whose room is still
		// reserved for late bytes: it goes once that room is free.
		drain := func(at int64) any {
			return x.apply(at, &pb.Command{Op: &pb.Command_NodeDown{NodeDown: &pb.NodeDownCmd{Node: "n4", Epoch: 1, Drained: true}}})
		}
		if out := drain(early + 4); !errors.Is(out.(error), ErrDraining) {
			t.Fatalf("n4 drained while its space was reserved: %v", out)
		}
		x.tick(early + 2*lateWriteGrace)
		if out := drain(early + 2*lateWriteGrace); out != nil {
			t.Fatalf("n4 drained: %v", out)
		}
		checkInvariants(t, x.f)
	}
	sameState(t, d.f, g)
	if !bytes.Equal(snapshotBytes(t, d.f), snapshotBytes(t, g)) {
		t.Fatal("the FSMs diverged")
	}
	if h := restored(t, snapshotBytes(t, d.f)); !h.drained("n4", 1) {
		t.Fatal("drained mark lost in a snapshot")
	}
}

// copyCommander mixes copies, drains, drops and evictions into the stream
// of randomCommands. Unlike it, it looks at one FSM (the first that gets
// each command) to pick sources and copy ids that exist, so copies start
// and end; every FSM still gets the same stream.
type copyCommander struct {
	rng *rand.Rand
}

func (g *copyCommander) pick(list []string) string { return list[g.rng.IntN(len(list))] }

// next returns a command for f's state at now, or nil.
func (g *copyCommander) next(f *FSM, now int64) *pb.Command {
	rng := g.rng
	var complete []string
	for _, k := range f.objects.sortedKeys() {
		if f.objects.get(k).is(pb.ObjectState_OBJECT_STATE_COMPLETE) {
			complete = append(complete, k)
		}
	}
	var processing []string
	for _, k := range f.objects.sortedKeys() {
		if o := f.objects.get(k); o.is(pb.ObjectState_OBJECT_STATE_PROCESSING) && f.deadline(o) >= now {
			processing = append(processing, k)
		}
	}
	segs := sortedKeys(f.segments)
	nodes := sortedKeys(f.nodes)
	var cmd *pb.Command
	switch p := rng.IntN(100); {
	case p < 15 && len(processing) > 0:
		// More complete objects than the base stream makes, to copy.
		cmd = &pb.Command{Op: &pb.Command_PutEnd{PutEnd: &pb.KeysCmd{Keys: []string{g.pick(processing)}}}}
	case p < 40 && len(complete) > 0 && len(segs) > 0:
		c := &pb.CopyStartCmd{}
		for range 1 + rng.IntN(2) {
			o := f.objects.get(g.pick(complete))
			src := f.segID(f.exts(o)[rng.IntN(len(f.exts(o)))])
			if rng.IntN(10) == 0 {
				src = g.pick(segs) // mostly not a replica
			}
			var cands []string
			for range rng.IntN(4) {
				cands = append(cands, g.pick(segs))
			}
			if rng.IntN(10) == 0 {
				cands = append(cands, "gone/x@9")
			}
			putID := uint64(0)
			if rng.IntN(3) == 0 {
				putID = o.putID + uint64(rng.IntN(2)) // sometimes stale
			}
			c.Items = append(c.Items, &pb.CopyStartItem{
				Key: o.key(), PutId: putID, Source: src, Candidates: cands,
				DeadlineUnixNano: now + rng.Int64N(300), Reason: pb.CopyReason(1 + rng.IntN(3)),
			})
		}
		cmd = &pb.Command{Op: &pb.Command_CopyStart{CopyStart: c}}
	case p < 60:
		var ids []*pb.CopyEndItem
		for _, k := range f.objects.sortedKeys() {
			for _, c := range f.copies(f.objects.get(k)) {
				ids = append(ids, &pb.CopyEndItem{Key: k, CopyId: c.Id})
			}
		}
		if len(ids) == 0 {
			return nil
		}
		c := &pb.CopyEndCmd{FreeAfterUnixNano: now - 50 + rng.Int64N(200)}
		for range 1 + rng.IntN(2) {
			it := proto.Clone(ids[rng.IntN(len(ids))]).(*pb.CopyEndItem)
			it.Failed, it.OnlyExpired = rng.IntN(4) == 0, rng.IntN(4) == 0
			if rng.IntN(10) == 0 {
				it.CopyId++ // unknown
			}
			c.Items = append(c.Items, it)
		}
		cmd = &pb.Command{Op: &pb.Command_CopyEnd{CopyEnd: c}}
	case p < 65 && len(nodes) > 0:
		cmd = &pb.Command{Op: &pb.Command_Drain{Drain: &pb.DrainCmd{Node: g.pick(nodes), Cancel: rng.IntN(3) == 0}}}
	case p < 69 && len(nodes) > 0:
		n := f.nodes[g.pick(nodes)]
		cmd = &pb.Command{Op: &pb.Command_NodeDown{NodeDown: &pb.NodeDownCmd{Node: n.id, Epoch: n.epoch, Drained: rng.IntN(4) != 0}}}
	case p < 76 && len(complete) > 0:
		o := f.objects.get(g.pick(complete))
		cmd = &pb.Command{Op: &pb.Command_DropReplica{DropReplica: &pb.DropReplicaCmd{
			Key: o.key(), Segment: f.segID(f.exts(o)[rng.IntN(len(f.exts(o)))]), Checksum: o.checksum,
			FreeAfterUnixNano: now - 50 + rng.Int64N(200), KeepLast: rng.IntN(4) != 0,
		}}}
	case p < 80 && len(complete) > 0:
		cmd = &pb.Command{Op: &pb.Command_Evict{Evict: &pb.EvictCmd{
			Keys: []string{g.pick(complete)}, FreeAfterUnixNano: now - 50 + rng.Int64N(200), AllowSoftPinned: true,
		}}}
	default:
		return nil
	}
	cmd.NowUnixNano = now
	return cmd
}

// applyOut applies an encoded command the way raft would.
func applyOut(t testing.TB, f *FSM, index uint64, c *pb.Command) any {
	t.Helper()
	data, err := proto.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	return f.Apply(&raft.Log{Index: index, Term: 1, Data: data})
}

// TestFSMDeterminismCopies feeds a random stream with copies to two FSMs
// and to one restored half way, checking the room accounting after every
// command.
func TestFSMDeterminismCopies(t *testing.T) {
	for seed := range uint64(4) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			g := &copyCommander{rng: rand.New(rand.NewPCG(seed, 0x5bd1e995))}
			base := randomCommands(seed+100, 1500)
			a, b := NewFSM(), NewFSM()
			var c *FSM
			var index uint64
			var started, published, drained int
			apply := func(cmd *pb.Command) {
				t.Helper()
				index++
				out := applyOut(t, a, index, cmd)
				ra := fmt.Sprint(out)
				if rb := fmt.Sprint(applyOut(t, b, index, cmd)); ra != rb {
					t.Fatalf("command %d (%v) returned %s and %s", index, cmd, ra, rb)
				}
				if c != nil {
					if rc := fmt.Sprint(applyOut(t, c, index, cmd)); ra != rc {
						t.Fatalf("command %d (%v) on the restored FSM returned %s, want %s", index, cmd, rc, ra)
					}
				}
				checkInvariants(t, a)
				switch res := out.(type) {
				case []CopyStartResult:
					for _, r := range res {
						if r.Err == nil {
							started++
						}
					}
				case []CopyEndResult:
					for _, r := range res {
						if r.Done {
							published++
						}
					}
				case nil:
					if d, ok := cmd.Op.(*pb.Command_NodeDown); ok && d.NodeDown.Drained {
						drained++
					}
				}
			}
			for i, cmd := range base {
				if i == len(base)/2 {
					c = restored(t, snapshotBytes(t, a))
					sameState(t, a, c)
				}
				apply(cmd)
				if extra := g.next(a, cmd.NowUnixNano); extra != nil {
					apply(extra)
				}
			}
			sameState(t, a, b)
			sameState(t, a, c)
			if !bytes.Equal(snapshotBytes(t, a), snapshotBytes(t, c)) {
				t.Fatal("an FSM restored half way snapshots differently at the end")
			}
			if started < 50 || published < 20 {
				t.Fatalf("%d copies started, %d published, %d nodes drained: the stream exercises too little", started, published, drained)
			}
			t.Logf("%d commands: %d copies started, %d published, %d nodes drained", index, started, published, drained)
		})
	}
}
