package master

import (
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// r13Setup starts a one-master cluster with a lease TTL of ttl, past its
// first TTL (so only lookup leases make tombs), with key k put, looked up
// (a client may cache it until the lease ends) and returns the lookup's
// answer and when the lease was granted.
func r13Setup(t *testing.T, ttl time.Duration, k string) (*member, *pb.LookupResponse, time.Time) {
	t.Helper()
	c := newCluster(t, 1, func(cfg *Config) { cfg.LeaseTTL = ttl })
	m := c.leader()
	register(t, m, "s", "ep", dram("a", 8<<20))
	waitEvictable(t, m)
	if err := tryPut(rpcCtx(t), m, k, 64); err != nil {
		t.Fatal(err)
	}
	leased := m.srv.cfg.Now()
	resp, err := m.master().Lookup(rpcCtx(t), &pb.LookupRequest{Keys: []string{k}})
	if err != nil || resp.Matched != 1 {
		t.Fatalf("lookup: %v, %v", resp, err)
	}
	return m, resp, leased
}

// TestReview13ExistsBypassesTomb: after a remove of a key a lookup leased,
// one client's re-put of it is held until the lease ends; but a second
// put of the key meanwhile is answered Exists at once (the held put is
// published already), and client.BatchPutWith counts Exists as success
// (without even dropping its cached descriptor). A lookup that starts
// after that put returned may answer the removed incarnation from a
// client's cache.
func TestReview13ExistsBypassesTomb(t *testing.T) {
	t.Parallel()
	const ttl = 2 * time.Second
	m, _, _ := r13Setup(t, ttl, "k")
	items(t, m, "remove", m.master().Remove, "k")
	until := m.srv.fsm.tombUntil([]string{"k"})
	if until == 0 {
		t.Fatal("no tomb for a key removed while a lookup leased it")
	}
	held := make(chan error, 1)
	go func() { held <- tryPut(rpcCtx(t), m, "k", 64) }()
	waitFor(t, 5*time.Second, "the held re-put published", func() error {
		if o := m.srv.fsm.complete([]string{"k"})[0]; o == nil {
			return errors.New("not yet")
		}
		return nil
	})
	r, err := m.master().PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "k", Size: 64, Checksum: 7})
	answered := m.srv.cfg.Now().UnixNano()
	if err != nil {
		t.Fatal(err)
	}
	if released := answered + int64(r.HoldMs)*1e6; r.Exists && released < until {
		t.Errorf("a put of the key was answered Exists (success), held %d ms, %v before the removed incarnation's lookup lease ended; lookups after it may serve the removed incarnation",
			r.HoldMs, time.Duration(until-released).Round(time.Millisecond))
	}
	if err := <-held; err != nil {
		t.Fatal(err)
	}
}

// TestReview13HeldPutFailsItsBatch: the hold is per BatchPutEnd, not per
// key, and its end (ctx) fails the whole RPC: a put of a fresh key that
// rides in the same BatchPutEnd (the client coalesces the PutEnds of
// concurrent puts, client/ends.go) waits for another key's tomb, and is
// answered an error though it was published.
func TestReview13HeldPutFailsItsBatch(t *testing.T) {
	t.Parallel()
	const ttl = 3 * time.Second
	m, _, _ := r13Setup(t, ttl, "k")
	items(t, m, "remove", m.master().Remove, "k")
	if m.srv.fsm.tombUntil([]string{"k"}) == 0 {
		t.Fatal("no tomb")
	}
	start := &pb.BatchPutStartRequest{Items: []*pb.PutStartRequest{{Key: "k", Size: 64, Checksum: 1}, {Key: "fresh", Size: 64, Checksum: 1}}}
	sr, err := m.master().BatchPutStart(rpcCtx(t), start)
	if err != nil {
		t.Fatal(err)
	}
	end := &pb.BatchPutEndRequest{}
	for i, r := range sr.Results {
		if r.Status.Code != 0 || r.Exists {
			t.Fatalf("start %d: %v", i, r)
		}
		end.Items = append(end.Items, &pb.PutEndItem{Key: start.Items[i].Key, PutId: r.PutId, Size: 64, Checksum: 1})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	began := time.Now()
	_, err = m.master().BatchPutEnd(ctx, end)
	took := time.Since(began)
	published := m.srv.fsm.complete([]string{"fresh"})[0] != nil
	if err != nil && published {
		t.Errorf("BatchPutEnd failed after %v (%v), though %q (never removed, no tomb) was published: its put reports a failure for a tomb of another key",
			took.Round(time.Millisecond), status.Code(err), "fresh")
	}
}

// TestReview13CorruptDropLeavesNoTomb: ReportCorrupt of a key's last
// replica removes the key like a Remove (any client can send it), but
// records no tomb: a re-put is answered at once while a client may still
// answer the removed incarnation from its lookup cache.
func TestReview13CorruptDropLeavesNoTomb(t *testing.T) {
	t.Parallel()
	const ttl = 2 * time.Second
	m, resp, leased := r13Setup(t, ttl, "k")
	seg := resp.Segments[resp.ReplicaSegments[0]].Segment
	dr, err := m.master().ReportCorrupt(rpcCtx(t), &pb.CorruptReplica{Key: "k", Segment: seg, Checksum: resp.Checksums[0]})
	if err != nil || !dr.Dropped {
		t.Fatalf("report corrupt: %v, %v", dr, err)
	}
	if m.srv.fsm.objects.get("k") != nil {
		t.Fatal("k still in the table after its last replica was dropped")
	}
	if got, want := m.srv.fsm.tombUntil([]string{"k"}), leased.Add(ttl).UnixNano(); got < want {
		t.Errorf("a key removed by ReportCorrupt while a lookup leased it has a tomb until %d, want at least the lease end %d: its re-put is answered at once", got, want)
	}
	began := m.srv.cfg.Now()
	if err := tryPut(rpcCtx(t), m, "k", 64); err != nil {
		t.Fatal(err)
	}
	if end := leased.Add(ttl); m.srv.cfg.Now().Before(end) {
		t.Logf("re-put answered after %v, %v before the lookup lease on the removed incarnation ended", m.srv.cfg.Now().Sub(began).Round(time.Millisecond), end.Sub(m.srv.cfg.Now()).Round(time.Millisecond))
	}
}

// TestReview13RevokedWhilePlacedSaysExpired: a put whose pending entry is
// revoked by key (PutRevoke with no put id, which any client may send)
// while it is placed is answered "the put's deadline passed ... the master
// is overloaded" (DeadlineExceeded), though its deadline is a minute away.
func TestReview13RevokedWhilePlacedSaysExpired(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1, nil)
	m := c.leader()
	register(t, m, "s", "ep", dram("a", 8<<20))
	ms := &masterService{s: m.srv}
	now := m.srv.cfg.Now()
	it := &pb.PutStartRequest{Key: "k", Size: 64}
	rec := &putRecord{item: pb.PublishItem{Key: "k", Size: 64}}
	p := &rec.pending
	p.item, p.deadline = &rec.item, now.Add(m.srv.cfg.PutTimeout)
	m.srv.puts.mu.Lock()
	m.srv.puts.add(p)
	m.srv.puts.mu.Unlock()
	views := map[string]segmentView{}
	for _, v := range m.srv.fsm.segmentViews() {
		views[v.id] = v
	}
	place := func(size uint64, tier pb.Tier) []string {
		// Another client revokes the key meanwhile.
		if _, err := m.master().PutRevoke(rpcCtx(t), &pb.KeysRequest{Keys: []string{"k"}}); err != nil {
			t.Error(err)
		}
		return m.srv.candidates(size, tier, "")
	}
	r, err := ms.placePut(rpcCtx(t), rec, it, place, views, "")
	if err != nil {
		t.Fatal(err)
	}
	if codes.Code(r.Status.Code) == codes.DeadlineExceeded && m.srv.cfg.Now().Before(p.deadline) {
		t.Errorf("a put revoked while placed, %v before its deadline, is answered %v: %s", p.deadline.Sub(m.srv.cfg.Now()).Round(time.Second), codes.Code(r.Status.Code), r.Status.Message)
	}
}
