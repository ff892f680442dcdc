package master

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestReview15SkewedEarlierLeaderLeaseBroken: object.created is the
// proposing leader's clock, leaderSince the new leader's. A lease is a
// duration the client measures from the answer, so before this change a
// new leader's first TTL (its own clock, since+TTL) outlasted every lease
// an earlier one granted whatever the masters' clocks said. Now an earlier
// leader whose clock is ahead by more than the failover took (here 5 s of
// a 60 s TTL) stamps objects "made after" the new leader took over: the new
// leader evicts them at once, frees their space at once (leaseEnd sees no
// object older than since) and places a put in the space of an object the
// earlier leader leased seconds ago.
func TestReview15SkewedEarlierLeaderLeaseBroken(t *testing.T) {
	t.Parallel()
	const ttl = 60 * time.Second
	skew := map[string]*atomic.Int64{}
	for _, id := range []string{"m0", "m1", "m2"} {
		skew[id] = new(atomic.Int64)
	}
	c := newCluster(t, 3, func(cfg *Config) {
		d := skew[cfg.ID]
		cfg.Now = func() time.Time { return time.Now().Add(time.Duration(d.Load())) }
		cfg.LeaseTTL = ttl
		cfg.PutTimeout = 2 * time.Second // a put that cannot be placed fails rather than wait the TTL
		cfg.HighWatermark = 1            // no sweep eviction gets in the way
	})
	a := c.leader()
	skew[a.srv.cfg.ID].Store(int64(5 * time.Second)) // the earlier leader's clock is 5 s ahead
	register(t, a, "s", "ep", dram("a", segCap))
	keys := keyNames("k", 16)
	batchPut(t, a, 64*kib, keys...) // the segment is full
	gr, err := a.master().GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: keys})
	if err != nil {
		t.Fatal(err)
	}
	leasedAt := time.Now()
	leased := map[uint64]string{} // offset -> key, all on s/a@1
	for i, r := range gr.Results {
		if len(r.Replicas) != 1 {
			t.Fatalf("get %q: %v", keys[i], r)
		}
		leased[r.Replicas[0].Offset] = keys[i]
	}
	for i, m := range c.members {
		if m == a {
			c.kill(i)
		}
	}
	b := c.leader()
	since := b.srv.leadership().evictable.Add(-b.srv.cfg.LeaseTTL)
	t.Logf("new leader took over %v after the lease was granted", since.Sub(leasedAt))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	r, err := b.master().PutStart(ctx, &pb.PutStartRequest{Key: "new", Size: 64 * kib, Checksum: 1})
	if err != nil {
		if code := status.Code(err); code != codes.ResourceExhausted && code != codes.DeadlineExceeded {
			t.Fatalf("put on the new leader: %v", err)
		}
		return // refused: no lease broken
	}
	if len(r.Replicas) == 0 {
		t.Fatalf("put start = %v", r)
	}
	rep := r.Replicas[0]
	left := time.Duration(gr.LeaseTtlMs)*time.Millisecond - time.Since(leasedAt)
	if k, ok := leased[rep.Offset]; ok && left > 0 {
		t.Errorf("the new leader placed a put at %s+%d, the space of %q, which the earlier leader leased with %v of its lease left",
			rep.Segment, rep.Offset, k, left.Round(time.Millisecond))
	} else {
		t.Errorf("the new leader placed a put into a pool full of objects the earlier leader leased (%v left): %v", left, rep)
	}
}

// TestReview15DeposedLeadershipEvictsInterimLeadersObjects: setLeader(false)
// sets leaderSince to when this node lost leadership, and leadership() then
// names that as when it "took over". A put that slept in awaitEvictable
// through the loss (up to a lease TTL, so it easily spans a leader change)
// wakes and runs makeRoom; if raft has made this node leader again and the
// loop is still in catchUp (setLeader(true) not yet run), the put's Evict
// commits. roomIn then takes every object made since the loss (the interim
// leader's, which it may have leased) as "made by this leader", and
// leaseEnd frees their space at once.
func TestReview15DeposedLeadershipEvictsInterimLeadersObjects(t *testing.T) {
	t.Parallel()
	e := newEvictEnv(t, func(cfg *Config) {
		cfg.LeaseTTL = 10 * time.Second
		cfg.HighWatermark = 1
	})
	m := e.m
	lost := m.srv.cfg.Now()
	time.Sleep(time.Millisecond)
	// The objects the interim leader made (and leased) after this node lost
	// leadership; this node applied them as a follower, so it knows no lease
	// on them.
	batchPut(t, m, 64*kib, keyNames("b", 16)...)
	if u := e.used(t); u != segCap {
		t.Fatalf("used %d of %d", u, segCap)
	}
	// What setLeader(false) left when this node lost leadership at lost;
	// raft has made it leader again since, and setLeader(true) has not run
	// (the loop is in catchUp's barrier).
	m.srv.mu.Lock()
	m.srv.mu.leader = false
	m.srv.mu.leaderSince = lost
	m.srv.mu.Unlock()
	// The put that slept in awaitEvictable through the loss wakes, finds no
	// room and calls makeRoom (placePut's next attempt).
	made := m.srv.makeRoom(rpcCtx(t), 64*kib, pb.Tier_TIER_DRAM, "")
	u := e.used(t)
	if made || u < segCap {
		t.Errorf("a node that is not leader of its term (deposed at %v) made room (%v) from objects an interim leader made and may have leased: used %d of %d right after, their space reusable at once",
			lost.Format(time.StampMilli), made, u, segCap)
	}
}

// TestReview15WaitedPutLeftNoTimeToWrite: awaitEvictable waits whenever
// the first TTL ends by the put's deadline, however little of the put's
// time is left then. With a lease TTL close to the put timeout, the put is
// answered "placed" with almost none of its write window, and a write of
// ordinary length then expires: it did not fail at once, it failed later.
func TestReview15WaitedPutLeftNoTimeToWrite(t *testing.T) {
	t.Parallel()
	const putTimeout = 1200 * time.Millisecond
	e := newEvictEnv(t, func(cfg *Config) {
		cfg.LeaseTTL = time.Second
		cfg.PutTimeout = putTimeout
		cfg.HighWatermark = 1
	})
	m := e.m
	batchPut(t, m, 64*kib, keyNames("k", 16)...)
	// As if this leader took over now, from one that may have leased them.
	asIfNewLeader(m)
	asked := time.Now()
	r, err := m.master().PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "late", Size: 64 * kib, Checksum: 1})
	if status.Code(err) == codes.ResourceExhausted {
		return // refused at once: too little write time would be left after the wait
	}
	if err != nil {
		t.Fatalf("put start: %v", err)
	}
	answered := time.Now()
	left := asked.Add(time.Duration(r.WriteTimeoutMs) * time.Millisecond).Sub(answered)
	t.Logf("answered after %v, %v of the %v write window left", answered.Sub(asked).Round(time.Millisecond), left.Round(time.Millisecond), putTimeout)
	if left < putTimeout/2 {
		t.Errorf("the put waited for the lease TTL and was placed with %v of its %v write window left", left.Round(time.Millisecond), putTimeout)
	}
}
