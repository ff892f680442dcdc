package master

import (
	"testing"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

func TestTombs(t *testing.T) {
	tb := newTombs()
	tb.add("past", 5, 10) // ended already: not kept
	tb.add("a", 20, 10)
	tb.add("a", 15, 10) // an earlier end does not shorten it
	tb.add("b", 30, 10)
	tb.add("b", 40, 10) // a later removal extends it
	for _, tc := range []struct {
		now  int64
		keys []string
		want int64
	}{
		{10, []string{"past"}, 0},
		{10, []string{"a"}, 20},
		{10, []string{"x", "a", "b"}, 40},
		{20, []string{"a"}, 0}, // due at its end
		{30, []string{"b"}, 40},
		{40, []string{"a", "b"}, 0},
	} {
		tb.expire(tc.now)
		if got := tb.latest(tc.keys); got != tc.want {
			t.Errorf("at %d, latest(%v) = %d, want %d", tc.now, tc.keys, got, tc.want)
		}
	}
	if len(tb.until) != 0 || len(tb.queue) != 0 {
		t.Errorf("after every end: %d keys, %d queued", len(tb.until), len(tb.queue))
	}
}

// TestTombsInSnapshots: a follower restored from a snapshot, and so a new
// leader, holds re-puts as the old leader would have.
func TestTombsInSnapshots(t *testing.T) {
	d := newDriver(t)
	d.register(t0, "n1", "ep1", dram("a", 1<<20))
	for _, k := range []string{"k", "j"} {
		if r := d.putStart(t0, k, 64, t0+1e9, "n1/a@1"); r.Err != nil {
			t.Fatal(r.Err)
		}
		if err := d.putEnd(t0, k); err != nil {
			t.Fatal(err)
		}
	}
	for k, cached := range map[string]int64{"k": t0 + 5e9, "j": 0} {
		if err := d.keys(t0, &pb.Command{Op: &pb.Command_Remove{Remove: &pb.RemoveCmd{Keys: []string{k}, CachedUntilUnixNano: []int64{cached}}}}); err != nil {
			t.Fatal(err)
		}
	}
	f := restored(t, snapshotBytes(t, d.f))
	if got := f.tombUntil([]string{"k"}); got != t0+5e9 {
		t.Errorf("restored tomb of k ends at %d, want %d", got, t0+5e9)
	}
	if got := f.tombUntil([]string{"j"}); got != 0 {
		t.Errorf("j, never looked up, has a tomb until %d", got)
	}
}

// TestRePutWaitsForLookupLeases: a put of a key removed while a lookup
// leased it is answered only once that lease has ended, as no client then
// answers the key from its cache with the removed incarnation; a key only
// read with GetReplicas (never cached) is put again at once.
func TestRePutWaitsForLookupLeases(t *testing.T) {
	t.Parallel()
	const ttl = time.Second
	c := newCluster(t, 1, func(cfg *Config) { cfg.LeaseTTL = ttl })
	m := c.leader()
	register(t, m, "s", "ep", dram("a", 8<<20))
	waitEvictable(t, m)
	for _, k := range []string{"looked", "read"} {
		if err := tryPut(rpcCtx(t), m, k, 64); err != nil {
			t.Fatal(err)
		}
	}
	leased := m.srv.cfg.Now()
	if resp, err := m.master().Lookup(rpcCtx(t), &pb.LookupRequest{Keys: []string{"looked"}}); err != nil || resp.Matched != 1 {
		t.Fatalf("lookup: %v, %v", resp, err)
	}
	if _, err := m.master().GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{"read"}}); err != nil {
		t.Fatal(err)
	}
	items(t, m, "remove", m.master().Remove, "looked", "read")
	if got := m.srv.fsm.tombUntil([]string{"read"}); got != 0 {
		t.Errorf("a key only read with GetReplicas has a tomb until %v", time.Unix(0, got))
	}
	until := m.srv.fsm.tombUntil([]string{"looked"})
	if want := leased.Add(ttl); time.Unix(0, until).Before(want) {
		t.Fatalf("tomb of the looked-up key ends at %v, before its lease (%v)", time.Unix(0, until), want)
	}
	if err := tryPut(rpcCtx(t), m, "looked", 64); err != nil {
		t.Fatal(err)
	}
	if now := m.srv.cfg.Now().UnixNano(); now < until {
		t.Errorf("the re-put returned %v before the removed incarnation's lookup lease ended", time.Duration(until-now))
	}
	if m.srv.fsm.objects.get("looked") == nil {
		t.Error("the re-put object is not in the table")
	}
}

// TestNewLeaderTombsEveryRemoval: in its first lease TTL a leader does not
// know which keys an earlier one leased to lookups, so every removal of an
// object an earlier leader saw complete holds re-puts of the key until that
// TTL is over; one it made itself, which no lookup leased, holds none.
func TestNewLeaderTombsEveryRemoval(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1, func(cfg *Config) { cfg.LeaseTTL = 30 * time.Second })
	m := c.leader()
	register(t, m, "s", "ep", dram("a", 8<<20))
	for _, k := range []string{"mine", "old"} {
		if err := tryPut(rpcCtx(t), m, k, 64); err != nil {
			t.Fatal(err)
		}
	}
	items(t, m, "remove", m.master().Remove, "mine")
	if got := m.srv.fsm.tombUntil([]string{"mine"}); got != 0 {
		t.Errorf("an object this leader made and no lookup leased has a tomb until %d", got)
	}
	// As if this leader took over now, in a new term, from one that may
	// have leased what is there.
	asIfNewLeader(m)
	items(t, m, "remove", m.master().Remove, "old")
	if got, want := m.srv.fsm.tombUntil([]string{"old"}), m.srv.evictableFrom().UnixNano(); got != want {
		t.Errorf("tomb of an object an earlier leader may have leased until %d, want the end of the leader's first TTL %d", got, want)
	}
}

// TestBatchPutEndHoldsOnlyTheRePut: a batch that ends a re-put of a key a
// lookup leased before its removal, and a put of another key, is answered
// at once, with a hold for the re-put alone: the writer waits, not the
// batch, which carries other puts' ends.
func TestBatchPutEndHoldsOnlyTheRePut(t *testing.T) {
	t.Parallel()
	const ttl = 5 * time.Second
	c := newCluster(t, 1, func(cfg *Config) { cfg.LeaseTTL = ttl })
	m := c.leader()
	register(t, m, "s", "ep", dram("a", 8<<20))
	waitEvictable(t, m)
	if err := tryPut(rpcCtx(t), m, "looked", 64); err != nil {
		t.Fatal(err)
	}
	if resp, err := m.master().Lookup(rpcCtx(t), &pb.LookupRequest{Keys: []string{"looked"}}); err != nil || resp.Matched != 1 {
		t.Fatalf("lookup: %v, %v", resp, err)
	}
	items(t, m, "remove", m.master().Remove, "looked")
	start, err := m.master().BatchPutStart(rpcCtx(t), &pb.BatchPutStartRequest{Items: []*pb.PutStartRequest{{Key: "looked", Size: 64}, {Key: "fresh", Size: 64}}})
	if err != nil {
		t.Fatal(err)
	}
	end := &pb.BatchPutEndRequest{}
	for i, k := range []string{"looked", "fresh"} {
		end.Items = append(end.Items, &pb.PutEndItem{Key: k, PutId: start.Results[i].PutId, Size: 64})
	}
	resp, err := m.master().BatchPutEnd(rpcCtx(t), end)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range resp.Results {
		if r.Code != 0 {
			t.Fatalf("put end %d: %v", i, r)
		}
	}
	if len(resp.HoldMs) != 2 || resp.HoldMs[0] == 0 || resp.HoldMs[0] > uint32(ttl/time.Millisecond) || resp.HoldMs[1] != 0 {
		t.Fatalf("holds %v, want one for the re-put (at most the lease, %v) and none for the fresh key", resp.HoldMs, ttl)
	}
}
