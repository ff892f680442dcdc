package master

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Review of the read lease end kept in each object (leaseUntil, a CAS
// max): leases weeks apart, long ones, concurrent ones, and the removals
// and evictions that must wait for them. (A 32-bit millisecond encoding of
// the lease was dropped after these tests caught its wraparound bugs.)

const (
	r7HalfWrap = int64(1<<31) * 1e6 // ns: half the 2^32 ms wrap, 24.855 days
	r7TTL      = 10 * time.Second
	r7Day      = int64(24 * time.Hour)
)

// r7Server is a Server with no raft, enough for lease, startRemove,
// leaseEnd and pickVictims: its clock reads *clock (unix nanos), and it
// has led since t0.
func r7Server(f *FSM, ttl time.Duration, clock *atomic.Int64) *Server {
	s := &Server{fsm: f}
	s.cfg.LeaseTTL = ttl
	s.cfg.Now = func() time.Time { return time.Unix(0, clock.Load()) }
	s.mu.removing = map[string]int{}
	s.mu.leaderSince = time.Unix(0, t0)
	return s
}

// r7Setup is an FSM with one complete object "k" of 100 bytes put at t0,
// and a Server whose clock starts at t0.
func r7Setup(t *testing.T, ttl time.Duration) (*fsmDriver, *Server, *atomic.Int64) {
	t.Helper()
	d := newDriver(t)
	seg := d.register(t0, "n1", "ep1", dram("dram0", 4096)).SegmentIDs[0]
	d.put(t0, "k", 100, seg)
	var clock atomic.Int64
	clock.Store(t0)
	return d, r7Server(d.f, ttl, &clock), &clock
}

// r7Grant grants the read lease a GetReplicas at the server's now would.
func r7Grant(t *testing.T, s *Server) int64 {
	t.Helper()
	keys := []string{"k"}
	objs := s.fsm.complete(keys)
	if objs[0] == nil {
		t.Fatal("k is not complete")
	}
	if refused := s.lease(keys, objs, s.cfg.Now().UnixNano(), s.cfg.Now().Add(s.cfg.LeaseTTL).UnixNano(), false); len(refused) > 0 {
		t.Fatalf("lease refused: %v", refused)
	}
	return s.cfg.Now().Add(s.cfg.LeaseTTL).UnixNano()
}

// r7FreeAfter is when a Remove of k started at the server's now would let
// its space be reused.
func r7FreeAfter(s *Server) int64 {
	at, done := s.startRemove([]string{"k"})
	done()
	return at.UnixNano()
}

// r7Evictable reports whether the sweep, at the server's now, would pick k.
func r7Evictable(s *Server) bool {
	now := s.cfg.Now()
	victims, _ := s.pickVictims(s.fsm.completeObjects(func(string) bool { return true }), 1, now)
	for _, v := range victims {
		if v.key == "k" {
			return true
		}
	}
	return false
}

// TestReview7LeaseMaxRecentOld: a later lease replaces an earlier one and
// an earlier one never shortens a later one, for leases a nanosecond to
// weeks apart.
func TestReview7LeaseMaxRecentOld(t *testing.T) {
	const wrap = int64(1<<32) * 1e6
	for _, base := range []int64{t0, wrap - 5e9, 3*wrap - 1} {
		for _, gap := range []int64{1, 1e6, int64(r7TTL), r7Day, 20 * r7Day} {
			o := allocObject("k", "")
			o.leaseUntil(0, base, false)
			o.leaseUntil(0, base+gap, false)
			o.leaseUntil(0, base, false) // the earlier one again: no effect
			if got, want := o.lease.Load(), evenUp(base+gap); got != want {
				t.Fatalf("base %d gap %d: ends at %d, want %d", base, gap, got, want)
			}
		}
	}
}

// TestReview7ConcurrentLeasesKeepMax: leaseUntil from many goroutines keeps
// the latest exp (run with -race).
func TestReview7ConcurrentLeasesKeepMax(t *testing.T) {
	o := allocObject("k", "")
	var wg sync.WaitGroup
	const n = 8
	for g := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				o.leaseUntil(0, t0+int64(i*n+g)*1e6, false)
			}
		}()
	}
	wg.Wait()
	want := evenUp(t0 + int64(199*n+n-1)*1e6)
	if got := o.lease.Load(); got != want {
		t.Fatalf("ends at %d, want %d", got, want)
	}
}

// TestReview7SnapshotReadAtLaterNow: the sweep takes now, then scans; a
// lease granted between the two, and one granted before and still live,
// keep the object out of the victims; an expired one does not.
func TestReview7SnapshotReadAtLaterNow(t *testing.T) {
	_, s, clock := r7Setup(t, r7TTL)
	clock.Store(t0 + 30e9)
	now := s.cfg.Now()
	r7Grant(t, s)         // at now
	clock.Add(int64(5e9)) // the scan runs 5 s later
	objs := s.fsm.completeObjects(func(string) bool { return true })
	if leased := s.byRecency(objs, now); !leased["k"] {
		t.Fatal("leased at the sweep's now, yet not leased in its scan")
	}
	if leased := s.byRecency(objs, now.Add(r7TTL-time.Millisecond)); !leased["k"] {
		t.Fatal("a ms before the lease ends it reads as ended")
	}
	if leased := s.byRecency(objs, now.Add(r7TTL+time.Millisecond)); leased["k"] {
		t.Fatal("a ms after the lease ends it reads as live")
	}
}

// TestReview7RemoveWaitsForLease: a Remove or eviction started during a
// lease waits for its end, the usual case.
func TestReview7RemoveWaitsForLease(t *testing.T) {
	_, s, clock := r7Setup(t, r7TTL)
	clock.Store(t0 + 60e9)
	exp := r7Grant(t, s)
	clock.Add(int64(time.Second))
	if at := r7FreeAfter(s); at < exp {
		t.Fatalf("space reusable at %d, before the lease ends at %d", at, exp)
	}
	if r7Evictable(s) {
		t.Fatal("picked for eviction under a live lease")
	}
	clock.Store(exp + 1e6)
	if !r7Evictable(s) {
		t.Fatal("not evictable after its lease ended")
	}
}

// TestReview7LeaseAfterHalfWrapIsLost: an object last leased 2^31 ms
// (24.855 days) before a new lease's end. Compared as int32(v-old), the
// new end would be "not later" and dropped, and the old value read as in
// the past: a Remove would free the space at once and the sweep evict the
// object while a reader holds its replica. The new lease must win.
func TestReview7LeaseAfterHalfWrapIsLost(t *testing.T) {
	for _, extra := range []int64{0, 1e6, 5e9, int64(r7TTL)} {
		_, s, clock := r7Setup(t, r7TTL)
		clock.Store(t0 + 60e9)
		first := r7Grant(t, s)
		// The next read comes when its lease's end is 2^31 ms (+extra)
		// after the first one's.
		clock.Store(first + r7HalfWrap + extra - int64(r7TTL))
		exp := r7Grant(t, s)
		clock.Add(int64(time.Second))
		if got := s.fsm.leaseEnd([]string{"k"}); got < exp {
			t.Errorf("extra %d ms: lease granted until %d reads as ending at %d (%.1f days early)",
				extra/1e6, exp, got, float64(exp-got)/float64(r7Day))
		}
		if at := r7FreeAfter(s); at < exp {
			t.Errorf("extra %d ms: a Remove frees the space at %d, %.1f days before the live lease ends", extra/1e6, at, float64(exp-at)/float64(r7Day))
		}
		if r7Evictable(s) {
			t.Errorf("extra %d ms: the sweep evicts k under a live lease", extra/1e6)
		}
	}
}

// TestReview7StaleLeaseReadsAsLive: a lease that ended between half a wrap
// and a wrap ago (24.9 to 49.7 days) must read as ended, not as one that
// ends up to 24.9 days from now (the object could not be evicted, and a
// Remove would hold its space for weeks).
func TestReview7StaleLeaseReadsAsLive(t *testing.T) {
	for _, ago := range []int64{25 * r7Day, 30 * r7Day, 40 * r7Day} {
		_, s, clock := r7Setup(t, r7TTL)
		clock.Store(t0 + 60e9)
		exp := r7Grant(t, s)
		clock.Store(exp + ago)
		now := clock.Load()
		if got := s.fsm.leasedAt([]string{"k"}, now); got["k"] {
			t.Errorf("%d days after its lease ended: read as leased, until %.1f days from now",
				ago/r7Day, float64(s.fsm.leaseEnd([]string{"k"})-now)/float64(r7Day))
		}
		if at := r7FreeAfter(s); at > now+int64(r7TTL) {
			t.Errorf("%d days after the last lease ended, a Remove holds the space %.1f days", ago/r7Day, float64(at-now)/float64(r7Day))
		}
		if !r7Evictable(s) {
			t.Errorf("%d days after the last lease ended: never picked for eviction", ago/r7Day)
		}
	}
}

// TestReview7LongLeaseTTL: a lease of 25 days (past 2^31 ms) reads back
// whole, and a Remove waits for it.
func TestReview7LongLeaseTTL(t *testing.T) {
	_, s, clock := r7Setup(t, 25*24*time.Hour)
	clock.Store(t0 + 60e9)
	exp := r7Grant(t, s)
	if got := s.fsm.leaseEnd([]string{"k"}); got < exp {
		t.Errorf("a lease of %v until %d reads as ending at %d", 25*24*time.Hour, exp, got)
	}
	if at := r7FreeAfter(s); at < exp {
		t.Errorf("a lease of %v: a Remove frees the space %v before it ends", 25*24*time.Hour, time.Duration(exp-at))
	}
}

// evenUp is a lease end as an object keeps it: even, rounded up (its low
// bit marks a lookup's lease).
func evenUp(t int64) int64 { return t + t&leaseCached }
