package master

import (
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Reclaim frees a written-back DRAM replica at once (a put needs the room
// now), so it must never take one a reader holds a lease on.

// frozenTierEnv is a tierEnv whose clock moves only when the test says,
// so the 100 ms reuse of a reclaim list is not a race against the machine.
func frozenTierEnv(t *testing.T) (*tierEnv, *atomic.Int64) {
	t.Helper()
	base := time.Now()
	var skew atomic.Int64
	e := newTierEnv(t, func(cfg *Config) {
		cfg.Now = func() time.Time { return base.Add(time.Duration(skew.Load())) }
		// The write-back mark stays at 0.80, but no sweep demotes (a full
		// segment is not above 1.0): only puts move replicas, so the
		// test does not race the 20 ms sweep.
		cfg.HighWatermark, cfg.EvictRatio = 1, 0.1
	})
	skew.Add(int64(time.Second)) // past leaderSince + LeaseTTL
	e.waitEvictable(t)
	return e, &skew
}

// writtenBackFull puts 14 objects in s's DRAM, waits until the two coldest
// have an SSD copy, and fills DRAM with two more.
func writtenBackFull(t *testing.T, e *tierEnv) []string {
	t.Helper()
	m := e.m
	startFakeStore(t, m, "s", reportOK, dram("a", segCap), ssd("b", 8*segCap))
	keys := keyNames("k", 14)
	putBatch(t, m, sized(64*kib, nil, keys...)...)
	waitFor(t, 10*time.Second, "the two coldest written back", func() error {
		got := placement(t, m, keys[:2]...)
		for _, k := range keys[:2] {
			if !slices.Equal(got[k], []string{sDRAM, sSSD}) {
				return fmt.Errorf("%s on %v", k, got[k])
			}
		}
		if n := copiesInFlight(m.srv.FSM()); n != 0 {
			return fmt.Errorf("%d copies in flight", n)
		}
		return nil
	})
	putBatch(t, m, sized(64*kib, nil, keyNames("m", 2)...)...)
	if u := segmentUsed(t, m, sDRAM); u != segCap {
		t.Fatalf("DRAM used %d, want full", u)
	}
	return keys
}

// leasedDRAM leases key with GetReplicas and returns its DRAM replica.
func leasedDRAM(t *testing.T, m *member, key string) *pb.Replica {
	t.Helper()
	resp, err := m.master().GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{key}})
	if err != nil {
		t.Fatal(err)
	}
	r := resp.Results[0]
	if r.Status.GetCode() != 0 || len(r.Replicas) == 0 || r.Replicas[0].Segment != sDRAM {
		t.Fatalf("get %s: %v", key, r)
	}
	return r.Replicas[0]
}

func overlaps(a *pb.Replica, b *pb.Replica) bool {
	return a.Segment == b.Segment && a.Offset < b.Offset+b.Length && b.Offset < a.Offset+a.Length
}

// TestReclaimKeepsLeases: a reclaim list is built when a put finds DRAM
// full and reused for reclaimTTL; a key leased after it was built (a get,
// or a Lookup) is left out when the list is used, so no put is placed on
// bytes a reader was promised.
func TestReclaimKeepsLeases(t *testing.T) {
	t.Parallel()
	e, _ := frozenTierEnv(t)
	m := e.m
	keys := writtenBackFull(t, e)

	// The first put builds the list (keys[0], keys[1]) and reclaims keys[0].
	putBatch(t, m, sized(64*kib, nil, "x0")...)
	// A reader leases keys[1] and is told to read its DRAM replica.
	leased := leasedDRAM(t, m, keys[1])
	leaseEnd := m.srv.cfg.Now().Add(m.srv.cfg.LeaseTTL)
	// The next put, within reclaimTTL of the first, reuses the list.
	r := putBatch(t, m, sized(64*kib, nil, "x1")...)[0]
	if m.srv.cfg.Now().Before(leaseEnd) && overlaps(r.Replicas[0], leased) {
		t.Fatalf("put x1 placed on %v, the DRAM replica of %s leased until %v (now %v)",
			r.Replicas[0], keys[1], leaseEnd, m.srv.cfg.Now())
	}
}

// TestReclaimAfterElection: a new leader does not know the leases its
// predecessor granted, so it reclaims nothing for one lease TTL, as it
// evicts nothing (evictableFrom).
func TestReclaimAfterElection(t *testing.T) {
	t.Parallel()
	e, _ := frozenTierEnv(t)
	m := e.m
	keys := writtenBackFull(t, e)
	leased := leasedDRAM(t, m, keys[0]) // granted by "the old leader"

	// What a new leader starts from (leaderLoop calls this on election):
	// no leases, no recency, leaderSince now.
	m.srv.setLeader(true)
	if !m.srv.cfg.Now().Before(m.srv.evictableFrom()) {
		t.Fatal("setup: the leader may evict already")
	}
	r := putBatch(t, m, sized(64*kib, nil, "x0")...)[0]
	if overlaps(r.Replicas[0], leased) {
		t.Fatalf("put x0 placed on %v, the DRAM replica of %s an earlier leader leased; evictable only from %v, now %v",
			r.Replicas[0], keys[0], m.srv.evictableFrom(), m.srv.cfg.Now())
	}
}
