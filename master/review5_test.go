package master

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestReview5RestoreMarksObjectsGone: a Lookup or GetReplicas holds the
// objects it read across its lease and rereads them, trusting gone to say
// an object left the table. Restore replaces the whole table (a deposed
// leader installing the new leader's snapshot while its lookups are in
// flight), so it must mark every object it drops gone, or the reread
// answers with the old record, on bytes the restored state has given to
// another object.
func TestReview5RestoreMarksObjectsGone(t *testing.T) {
	d := newDriver(t)
	seg := d.register(t0, "n1", "ep1", dram("a", 4096)).SegmentIDs[0]
	k := d.put(t0, "k", 100, seg)

	// The rest of the cluster went on: k was removed, and "other" took its
	// bytes.
	e := &fsmDriver{t: t, f: restored(t, snapshotBytes(t, d.f)), index: d.index}
	if err := e.remove(t0+1, "k", 0); err != nil {
		t.Fatal(err)
	}
	other := e.put(t0+2, "other", 100, seg)
	if other.Segment != k.Segment || other.Offset != k.Offset {
		t.Fatalf("setup: other at %v, k was at %v", other, k)
	}

	// A lookup of k reads its object, then this FSM restores e's snapshot,
	// then the lookup leases and rereads what it read.
	objs := d.f.prefix([]string{"k"})
	if len(objs) != 1 {
		t.Fatalf("setup: prefix %d", len(objs))
	}
	if err := d.f.Restore(io.NopCloser(bytes.NewReader(snapshotBytes(t, e.f)))); err != nil {
		t.Fatal(err)
	}
	if resp := d.f.lookup(objs, t0+3, t0+3); resp.Matched != 0 {
		t.Errorf("lookup after the restore matched %d: k at %s+%d, where the restored table keeps %q",
			resp.Matched, resp.Segments[resp.ReplicaSegments[0]].Segment, resp.ReplicaOffsets[0], "other")
	}
	if r := d.f.replicas([]string{"k"}, objs, t0+3, access{})[0]; r.Status.GetCode() == 0 {
		t.Errorf("GetReplicas after the restore found k at %v, where the restored table keeps %q", r.Replicas, "other")
	}
}

// TestReview5RestoreLegacyCompleteDeadline: since the compact record, a
// legacy put's deadline is dropped at PutEnd, so a complete object carries
// no rare part. A snapshot written before that change (same log) kept the
// deadline of complete objects; Restore must drop it, or a replica that
// restored it holds a rare part per legacy object and snapshots
// differently from one that replayed the same entries.
func TestReview5RestoreLegacyCompleteDeadline(t *testing.T) {
	d := newDriver(t)
	seg := d.register(t0, "n1", "ep1", dram("a", 1<<20)).SegmentIDs[0]
	d.put(t0, "k", 100, seg) // PutStartCmd with a deadline, then PutEndCmd
	data := snapshotBytes(t, d.f)

	// The same state as the code before 0e95927 snapshot it: the complete
	// object kept its put's deadline.
	var snap pb.Snapshot
	if err := proto.Unmarshal(data, &snap); err != nil {
		t.Fatal(err)
	}
	if len(snap.Objects) != 1 || snap.Objects[0].State != pb.ObjectState_OBJECT_STATE_COMPLETE || snap.Objects[0].DeadlineUnixNano != 0 {
		t.Fatalf("setup: %v", snap.Objects)
	}
	snap.Objects[0].DeadlineUnixNano = t0 + 1e9
	old, err := proto.MarshalOptions{Deterministic: true}.Marshal(&snap)
	if err != nil {
		t.Fatal(err)
	}
	g := restored(t, old)
	g.mu.RLock()
	o := g.objects.get("k")
	rare, deadline := o.hasRare(), g.deadline(o)
	g.mu.RUnlock()
	if rare || deadline != 0 {
		t.Errorf("restored complete legacy object: rare part %v, deadline %d; the replica that replayed the log has none", rare, deadline)
	}
	if !bytes.Equal(snapshotBytes(t, g), data) {
		t.Error("a replica restored from the pre-compaction snapshot snapshots differently from one that replayed the same log")
	}
}

// TestReview5LeaseInterleavings: the lock-free lease of Lookup and
// GetReplicas (read the objects, lease them, reread them) against a
// removal at each point: one that ended before the lease shows in the
// reread, one in flight refuses the lease, one that starts after it keeps
// the space until the lease ends.
func TestReview5LeaseInterleavings(t *testing.T) {
	t.Parallel()
	e, _ := frozenTierEnv(t)
	m := e.m
	s := m.srv
	register(t, m, "s", "ep-s", dram("a", segCap))
	putBatch(t, m, sized(4*kib, nil, "lookup/a", "lookup/b", "lookup/c", "get/a", "get/b", "get/c")...)
	now := s.cfg.Now().UnixNano()
	type reader struct {
		name string
		read func(keys []string) []*object
		// answer rereads objs as the RPC does and counts what it answers.
		answer func(keys []string, objs []*object) int
	}
	for _, r := range []reader{
		{"lookup", s.fsm.prefix, func(_ []string, objs []*object) int { return int(s.fsm.lookup(objs, now, now).Matched) }},
		{"get", s.fsm.complete, func(keys []string, objs []*object) int {
			n := 0
			for _, x := range s.fsm.replicas(keys, objs, now, access{}) {
				if x.Status.GetCode() == 0 {
					n++
				}
			}
			return n
		}},
	} {
		a, b, c := []string{r.name + "/a"}, []string{r.name + "/b"}, []string{r.name + "/c"}

		// Removed between the read and the lease: the reread finds it gone.
		objs := r.read(a)
		items(t, m, "remove", m.master().Remove, a...)
		if refused := s.lease(a, objs, s.cfg.Now().UnixNano(), s.cfg.Now().Add(s.cfg.LeaseTTL).UnixNano(), true); len(refused) != 0 {
			t.Errorf("%s: refused %v with no removal in flight", r.name, refused)
		}
		if n := r.answer(a, objs); n != 0 {
			t.Errorf("%s: answered %s, removed before its lease", r.name, a[0])
		}

		// A removal in flight: the lease is refused.
		objs = r.read(b)
		_, done := s.startRemove(b)
		refused := s.lease(b, objs, s.cfg.Now().UnixNano(), s.cfg.Now().Add(s.cfg.LeaseTTL).UnixNano(), true)
		done()
		if !refused[b[0]] {
			t.Errorf("%s: leased %s while its removal was in flight", r.name, b[0])
		}

		// Leased, then removed: the space waits for the lease.
		objs = r.read(c)
		if refused := s.lease(c, objs, s.cfg.Now().UnixNano(), s.cfg.Now().Add(s.cfg.LeaseTTL).UnixNano(), true); len(refused) != 0 || r.answer(c, objs) != 1 {
			t.Fatalf("%s: %s not answered (refused %v)", r.name, c[0], refused)
		}
		at := s.fsm.replicasOf(c)[0].Replicas[0]
		end := s.fsm.leaseEnd(c)
		items(t, m, "remove", m.master().Remove, c...)
		s.fsm.mu.RLock()
		held := false
		for _, p := range s.fsm.pending {
			held = held || (p.Extent.Segment == at.Segment && p.Extent.Offset == at.Offset && p.AfterUnixNano >= end)
		}
		s.fsm.mu.RUnlock()
		if end <= now || !held {
			t.Errorf("%s: %s removed under a lease until %d; its space at %s+%d is not held that long", r.name, c[0], end, at.Segment, at.Offset)
		}
	}
}

// TestReview5LeasedSpaceNeverReused: readers look up and get objects while
// a writer puts new ones and removes old ones, on a frozen clock (no lease
// ends). No extent a reader was answered may be placed again for a later
// put, whatever the interleaving; run with -race as well.
func TestReview5LeasedSpaceNeverReused(t *testing.T) {
	t.Parallel()
	e, _ := frozenTierEnv(t)
	m := e.m
	register(t, m, "s", "ep-s", dram("a", 4<<20))
	const rounds = 150
	type ext struct {
		key         string
		seg         string
		off, length uint64
	}
	var mu sync.Mutex
	placed := map[string]ext{} // by key
	var order []string         // keys in the order they were placed
	var answered []ext         // extents readers were answered
	latest := func() (string, bool) {
		mu.Lock()
		defer mu.Unlock()
		if len(order) == 0 {
			return "", false
		}
		return order[max(0, len(order)-1-rand.IntN(3))], true
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	stopReaders := sync.OnceFunc(func() { close(stop); wg.Wait() })
	t.Cleanup(stopReaders) // before the master stops, should a put fail the test
	for w := range 2 {
		wg.Go(func() {
			mc := m.master()
			for {
				select {
				case <-stop:
					return
				default:
				}
				k, ok := latest()
				if !ok {
					time.Sleep(time.Millisecond)
					continue
				}
				var got []ext
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				if w == 0 {
					resp, err := mc.Lookup(ctx, &pb.LookupRequest{Keys: []string{k}})
					if err != nil {
						cancel()
						t.Error(err)
						return
					}
					for j := range int(resp.Matched) {
						got = append(got, ext{k, resp.Segments[resp.ReplicaSegments[j]].Segment, resp.ReplicaOffsets[j], resp.Sizes[j]})
					}
				} else {
					resp, err := mc.GetReplicas(ctx, &pb.KeysRequest{Keys: []string{k}})
					if err != nil {
						cancel()
						t.Error(err)
						return
					}
					for _, r := range resp.Results[0].Replicas {
						got = append(got, ext{k, r.Segment, r.Offset, r.Length})
					}
				}
				cancel()
				mu.Lock()
				answered = append(answered, got...)
				mu.Unlock()
			}
		})
	}
	mc := m.master()
	for i := range rounds {
		k := fmt.Sprintf("k%03d", i)
		r := putBatch(t, m, sized(4*kib, nil, k)...)[0]
		mu.Lock()
		placed[k] = ext{k, r.Replicas[0].Segment, r.Replicas[0].Offset, r.Replicas[0].Length}
		order = append(order, k)
		mu.Unlock()
		if i >= 2 {
			items(t, m, "remove", mc.Remove, fmt.Sprintf("k%03d", i-2))
		}
	}
	stopReaders()
	mu.Lock()
	defer mu.Unlock()
	if len(answered) < rounds/2 {
		t.Fatalf("readers were answered %d extents: too little interleaving", len(answered))
	}
	pos := map[string]int{}
	for i, k := range order {
		pos[k] = i
	}
	for _, a := range answered {
		if p := placed[a.key]; p != a {
			t.Fatalf("%s answered at %+v, placed at %+v", a.key, a, p)
		}
		for _, k := range order[pos[a.key]+1:] {
			if p := placed[k]; p.seg == a.seg && p.off < a.off+a.length && a.off < p.off+p.length {
				t.Fatalf("%s was answered at %s+%d under a lease that never ends; %s was placed there later", a.key, a.seg, a.off, k)
			}
		}
	}
}
