package master

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// The eviction tests run one master with a short lease and a quick sweep,
// and one registered fake store "s" with a 1 MiB DRAM segment.
const (
	evictSeg = "s/a@1"
	segCap   = 1 << 20
	kib      = 1 << 10
)

type evictEnv struct {
	m   *member
	reg *prometheus.Registry
}

func newEvictEnv(t *testing.T, tweak func(*Config)) *evictEnv {
	t.Helper()
	reg := prometheus.NewRegistry()
	c := newCluster(t, 1, func(cfg *Config) {
		cfg.LeaseTTL = 200 * time.Millisecond
		cfg.SweepInterval = 50 * time.Millisecond
		cfg.Registerer = reg
		if tweak != nil {
			tweak(cfg)
		}
	})
	m := c.leader()
	register(t, m, "s", "ep", dram("a", segCap))
	return &evictEnv{m: m, reg: reg}
}

func (e *evictEnv) admin() pb.AdminClient { return pb.NewAdminClient(e.m.conn) }

// waitEvictable waits until the leader may evict: one lease TTL after it
// took over.
func (e *evictEnv) waitEvictable(t *testing.T) { waitEvictable(t, e.m) }

// waitEvictable waits until m, the leader, is past its first lease TTL:
// it may evict, and knows every lease in force.
func waitEvictable(t *testing.T, m *member) {
	t.Helper()
	waitFor(t, 30*time.Second, "the leader may evict", func() error {
		if from := m.srv.evictableFrom(); m.srv.cfg.Now().Before(from) {
			return fmt.Errorf("not before %v", from)
		}
		return nil
	})
}

func (e *evictEnv) used(t *testing.T) uint64 { return segmentUsed(t, e.m, evictSeg) }

// evictions sums tidepool_master_evictions_total for one reason.
func (e *evictEnv) evictions(t *testing.T, reason string) float64 {
	t.Helper()
	return countLabeled(t, e.reg, "tidepool_master_evictions_total", "reason", reason)
}

// tryPut runs a whole put without touching t, so goroutines may call it.
func tryPut(ctx context.Context, m *member, key string, size uint64) error {
	return r21Put(ctx, m, "", key, "", size)
}

// batchPut starts and ends the puts of keys, each size bytes, in one
// command each, so the segment fills in a single step.
func batchPut(t *testing.T, m *member, size uint64, keys ...string) {
	t.Helper()
	req := &pb.BatchPutStartRequest{}
	for _, k := range keys {
		req.Items = append(req.Items, &pb.PutStartRequest{Key: k, Size: size})
	}
	resp, err := m.master().BatchPutStart(rpcCtx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range resp.Results {
		if r.Status.GetCode() != 0 || len(r.Replicas) != 1 {
			t.Fatalf("batch put start %q: %v", keys[i], r)
		}
	}
	items(t, m, "put end", m.master().PutEnd, keys...)
}

func pinKey(t *testing.T, e *evictEnv, key string, hard bool, ttl time.Duration) {
	t.Helper()
	resp, err := e.admin().Pin(rpcCtx(t), &pb.PinRequest{Key: key, Hard: hard, TtlMs: uint64(ttl.Milliseconds())})
	if err != nil {
		t.Fatalf("pin %q: %v", key, err)
	}
	if len(resp.Results) != 1 || resp.Results[0].Code != 0 {
		t.Fatalf("pin %q: %v", key, resp.Results)
	}
}

func keyNames(prefix string, n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%s%02d", prefix, i)
	}
	return keys
}

// present lists which of keys exist, as "key" or "-key".
func present(t *testing.T, m *member, keys ...string) []string {
	t.Helper()
	out := make([]string, len(keys))
	for i, ok := range exists(t, m, keys...) {
		out[i] = keys[i]
		if !ok {
			out[i] = "-" + keys[i]
		}
	}
	return out
}

// TestEvictPressureLRU: with the watermark sweep off, puts into a full
// segment evict least recently used objects first; an object read since
// its put outlasts those only put (a segmented LRU, see keepRead).
func TestEvictPressureLRU(t *testing.T) {
	t.Parallel()
	e := newEvictEnv(t, func(cfg *Config) { cfg.HighWatermark = 1 })
	m := e.m
	old := keyNames("old", 16)
	for _, k := range old {
		putObject(t, m, k, 64*kib)
	}
	if u := e.used(t); u != segCap {
		t.Fatalf("used %d, want a full segment", u)
	}
	if _, err := m.master().GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{"old00"}}); err != nil {
		t.Fatal(err)
	}
	// Let the lease of that get end (and the leader become evictable):
	// old00 is now merely read, and more recently used than the others.
	time.Sleep(m.srv.cfg.LeaseTTL + 50*time.Millisecond)
	e.waitEvictable(t)

	fresh := keyNames("new", 17)
	for i, k := range fresh {
		putObject(t, m, k, 64*kib)
		if u := e.used(t); u > segCap {
			t.Fatalf("used %d beyond capacity", u)
		}
		// Victims so far: old01..old(i+1), then new00, never old00.
		var want []string
		for j, o := range old {
			gone := j >= 1 && j <= i+1
			want = append(want, map[bool]string{true: "-" + o, false: o}[gone])
		}
		if got := present(t, m, old...); !slices.Equal(got, want) {
			t.Fatalf("after put %d: old objects %v, want %v", i, got, want)
		}
	}
	if got := present(t, m, fresh...); got[0] != "-new00" || got[1] != "-new01" || !slices.Equal(got[2:], fresh[2:]) {
		t.Fatalf("new objects %v: want only new00 and new01 evicted", got)
	}
	if n := e.evictions(t, "allocation"); n != 17 {
		t.Fatalf("allocation evictions %v, want 17", n)
	}
	if n := e.evictions(t, "watermark"); n != 0 {
		t.Fatalf("watermark evictions %v with the sweep off", n)
	}
}

// TestEvictPressureRandomSizes fills the segment four times over with
// objects of random sizes, the watermark sweep running: no put fails, and
// what is left is always the most recently put.
func TestEvictPressureRandomSizes(t *testing.T) {
	t.Parallel()
	e := newEvictEnv(t, nil)
	m := e.m
	e.waitEvictable(t)
	rng := rand.New(rand.NewPCG(1, 2))
	var keys []string
	var total uint64
	for i := 0; total < 4*segCap; i++ {
		size := 4*kib + rng.Uint64N(252*kib)
		k := fmt.Sprintf("k%03d", i)
		if err := tryPut(rpcCtx(t), m, k, size); err != nil {
			t.Fatalf("put %d (%s, %d bytes) after %d bytes: %v", i, k, size, total, err)
		}
		keys = append(keys, k)
		total += size
		if u := e.used(t); u > segCap {
			t.Fatalf("used %d beyond capacity", u)
		}
		// Least recently used go first: the survivors are a suffix.
		ex := exists(t, m, keys...)
		first := slices.Index(ex, true)
		if first < 0 || slices.Contains(ex[first:], false) {
			t.Fatalf("after put %d: survivors %v are not the most recent puts", i, present(t, m, keys...))
		}
	}
	if e.evictions(t, "allocation") == 0 {
		t.Fatal("four segments' worth of puts evicted nothing on allocation")
	}
	// After the last sweep the segment is at most 0.85 full.
	waitFor(t, 5*time.Second, "used at or below 0.85", func() error {
		if u := e.used(t); float64(u) > (DefaultHighWatermark-DefaultEvictRatio)*segCap {
			return fmt.Errorf("used %d of %d", u, segCap)
		}
		return nil
	})
}

// TestEvictPressureConcurrent: puts from several clients at once into a
// full segment all succeed, though each one's eviction may free the room
// another one takes.
func TestEvictPressureConcurrent(t *testing.T) {
	t.Parallel()
	e := newEvictEnv(t, func(cfg *Config) { cfg.HighWatermark = 1 })
	m := e.m
	e.waitEvictable(t)
	const workers, each = 4, 24
	var wg sync.WaitGroup
	errs := make(chan error, workers*each)
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for i := range each {
				k := fmt.Sprintf("w%d/%02d", w, i)
				size := 16*kib + rng.Uint64N(112*kib)
				if err := tryPut(rpcCtx(t), m, k, size); err != nil {
					errs <- fmt.Errorf("put %s (%d bytes): %w", k, size, err)
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if u := e.used(t); u > segCap {
		t.Fatalf("used %d beyond capacity", u)
	}
}

// TestEvictNotBeforeLeaseTTL: in its first lease TTL a leader evicts
// nothing an earlier leader can have leased (what was made before it took
// over): a put into a full segment waits for the TTL instead of failing,
// and the sweep waits too.
func TestEvictNotBeforeLeaseTTL(t *testing.T) {
	t.Parallel()
	e := newEvictEnv(t, func(cfg *Config) {
		cfg.LeaseTTL = 3 * time.Second
		cfg.HighWatermark = 0.5
	})
	m := e.m
	batchPut(t, m, 64*kib, keyNames("k", 16)...)
	// As if this leader took over now, from one that may have leased them.
	asIfNewLeader(m)
	from := m.srv.evictableFrom()
	done := make(chan error, 1)
	go func() { done <- tryPut(rpcCtx(t), m, "early", 64*kib) }()
	for m.srv.cfg.Now().Before(from) {
		if u := e.used(t); u < segCap && m.srv.cfg.Now().Before(from) {
			t.Fatalf("used %d of %d before the leader may evict what an earlier one leased", u, segCap)
		}
		select {
		case err := <-done:
			if m.srv.cfg.Now().Before(from) {
				t.Fatalf("the put into a full segment was answered (%v) before the leader may evict", err)
			}
			done <- err
		case <-time.After(50 * time.Millisecond):
		}
	}
	if err := <-done; err != nil {
		t.Fatalf("the put that waited for the lease TTL: %v", err)
	}
	waitFor(t, 5*time.Second, "the segment down to its watermark", func() error {
		if u := e.used(t); float64(u) > 0.5*segCap {
			return fmt.Errorf("used %d", u)
		}
		return nil
	})
	putObject(t, m, "late", 64*kib)
}

// asIfNewLeader makes m look as if it took over now from an earlier
// leader: its first lease TTL starts, and every object looks published in
// an earlier term, so that leader may have leased it.
func asIfNewLeader(m *member) {
	m.srv.mu.Lock()
	m.srv.mu.leaderSince = m.srv.cfg.Now()
	m.srv.mu.Unlock()
	f := m.srv.fsm
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, o := range f.objects.all() {
		o.setFlag(flagPublishedInTerm, false)
	}
}

// TestNewLeaderEvictsWhatItMade: in its first lease TTL a leader evicts
// what it made itself (it knows every lease on that), so a put into a
// pool it filled is not refused nor held.
func TestNewLeaderEvictsWhatItMade(t *testing.T) {
	t.Parallel()
	e := newEvictEnv(t, func(cfg *Config) { cfg.LeaseTTL = time.Minute })
	m := e.m
	batchPut(t, m, 64*kib, keyNames("k", 16)...)
	if !m.srv.cfg.Now().Before(m.srv.evictableFrom()) {
		t.Fatal("setup outlasted a minute's lease TTL")
	}
	if err := tryPut(rpcCtx(t), m, "more", 64*kib); err != nil {
		t.Fatalf("a put into a pool this leader filled, in its first lease TTL: %v", err)
	}
	if !m.srv.cfg.Now().Before(m.srv.evictableFrom()) {
		t.Fatal("the put waited for the lease TTL")
	}
}

// TestEvictHardPin: a hard-pinned object is never evicted, even when it is
// the only candidate; the put then fails for lack of space.
func TestEvictHardPin(t *testing.T) {
	t.Parallel()
	e := newEvictEnv(t, func(cfg *Config) { cfg.HighWatermark = 1 })
	m := e.m
	putObject(t, m, "hard", segCap)
	pinKey(t, e, "hard", true, 0)
	e.waitEvictable(t)
	for range 3 {
		_, err := m.master().PutStart(rpcCtx(t), &pb.PutStartRequest{Key: "x", Size: 64 * kib})
		wantCode(t, err, codes.ResourceExhausted, "a put when only a hard-pinned object could make room")
	}
	gr, err := m.master().GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{"hard"}})
	if err != nil || gr.Results[0].Status.Code != 0 || gr.Results[0].Size != segCap {
		t.Fatalf("the hard-pinned object after the failed puts: %v, %v", gr, err)
	}
	// Admin eviction by key keeps it too, and says so.
	for _, dry := range []bool{true, false} {
		resp, err := e.admin().Evict(rpcCtx(t), &pb.EvictRequest{Key: "hard", DryRun: dry})
		if err != nil || len(resp.Objects) != 0 || resp.Skipped != 1 || resp.Bytes != 0 {
			t.Fatalf("evict --key hard (dry run %v) = %v, %v; want nothing evicted, 1 skipped", dry, resp, err)
		}
	}
	if !exists(t, m, "hard")[0] {
		t.Fatal("the hard-pinned object is gone")
	}
	if n := e.evictions(t, "allocation") + e.evictions(t, "admin"); n != 0 {
		t.Fatalf("%v evictions counted", n)
	}
	// Unpinned, it makes room like any other (once its lease has ended).
	items(t, m, "unpin", e.admin().Unpin, "hard")
	waitFor(t, 5*time.Second, "a put once the pin is gone", func() error {
		return tryPut(rpcCtx(t), m, "x", 64*kib)
	})
	if exists(t, m, "hard")[0] {
		t.Fatal("the unpinned object survived the put that needed its space")
	}
}

// TestEvictSoftPin: a soft-pinned object goes only when the unpinned ones
// cannot free enough; an expired soft pin protects nothing.
func TestEvictSoftPin(t *testing.T) {
	t.Parallel()
	e := newEvictEnv(t, func(cfg *Config) { cfg.HighWatermark = 1 })
	m := e.m
	const q = segCap / 4
	putObject(t, m, "soft", q) // the least recently used
	pinKey(t, e, "soft", false, time.Hour)
	for _, k := range []string{"u1", "u2", "u3"} {
		putObject(t, m, k, q)
	}
	e.waitEvictable(t)
	check := func(what string, want ...string) {
		t.Helper()
		keys := []string{"soft", "u1", "u2", "u3", "n1", "big", "huge"}
		var got []string
		for _, k := range present(t, m, keys...) {
			if k[0] != '-' {
				got = append(got, k)
			}
		}
		if !slices.Equal(got, want) {
			t.Fatalf("%s: objects %v, want %v", what, got, want)
		}
	}
	putObject(t, m, "n1", q)
	check("after a quarter-segment put", "soft", "u2", "u3", "n1")
	putObject(t, m, "big", 3*q)
	check("after a three-quarter put", "soft", "big")
	if n := e.evictions(t, "allocation"); n != 4 {
		t.Fatalf("allocation evictions %v, want 4", n)
	}
	// Only the soft-pinned object and big are left: a whole-segment put
	// needs both, so the soft pin gives way.
	putObject(t, m, "huge", segCap)
	check("after a whole-segment put", "huge")

	// An expired soft pin counts for nothing: e1 is the least recently
	// used and goes first.
	keys := []string{"e1", "e2", "e3", "e4"}
	putObject(t, m, keys[0], q)
	pinKey(t, e, "e1", false, time.Millisecond)
	for _, k := range keys[1:] {
		putObject(t, m, k, q)
	}
	time.Sleep(5 * time.Millisecond)
	putObject(t, m, "f", q)
	if got := present(t, m, keys...); !slices.Equal(got, []string{"-e1", "e2", "e3", "e4"}) {
		t.Fatalf("after a put with e1's soft pin expired: %v", got)
	}
}

// TestEvictSkipsLeased: the policy never picks an object under a read
// lease, and once the lease is over, the object read outlasts those only
// put.
func TestEvictSkipsLeased(t *testing.T) {
	t.Parallel()
	const ttl = 3 * time.Second
	e := newEvictEnv(t, func(cfg *Config) {
		cfg.HighWatermark = 1
		cfg.LeaseTTL = ttl
	})
	m := e.m
	e.waitEvictable(t)
	putObject(t, m, "k00", 64*kib)
	leased := time.Now()
	if _, err := m.master().GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{"k00"}}); err != nil {
		t.Fatal(err)
	}
	keys := keyNames("k", 16)
	for _, k := range keys[1:] { // more recent than the get of k00
		putObject(t, m, k, 64*kib)
	}
	putObject(t, m, "n1", 64*kib)
	if time.Since(leased) > ttl-500*time.Millisecond {
		t.Skip("setup outlasted the lease; cannot tell a lease from luck")
	}
	if got := present(t, m, "k00", "k01", "k02"); !slices.Equal(got, []string{"k00", "-k01", "k02"}) {
		t.Fatalf("with k00 leased: %v, want k01 evicted instead", got)
	}
	time.Sleep(time.Until(leased.Add(ttl + 100*time.Millisecond)))
	putObject(t, m, "n2", 64*kib)
	if got := present(t, m, "k00", "k02", "k03"); !slices.Equal(got, []string{"k00", "-k02", "k03"}) {
		t.Fatalf("after the lease: %v, want k02 evicted", got)
	}
}

// TestPickVictimsOrder: least recently used first, objects read since
// their put after those only put until read ones would be more than
// readShare of them, and never a leased or hard-pinned one.
func TestPickVictimsOrder(t *testing.T) {
	now := time.Unix(1000, 0)
	obj := func(key string, used int64, read, leased bool) evictable {
		o := evictable{key: key, used: used, freed: 1}
		if read {
			o.lease = now.UnixNano() - 1 // ended
		}
		if leased {
			o.lease = now.UnixNano() + 1
		}
		return o
	}
	for _, tc := range []struct {
		name string
		objs []evictable
		want []string // every object, in the order eviction takes them
	}{
		{"plain LRU", []evictable{obj("c", 3, false, false), obj("a", 1, false, false), obj("b", 2, false, false)}, []string{"a", "b", "c"}},
		{"only put first", []evictable{obj("a", 1, true, false), obj("b", 2, false, false), obj("c", 3, true, false), obj("d", 4, false, false), obj("e", 5, false, false)},
			[]string{"b", "d", "e", "a", "c"}},
		{"read beyond their share", []evictable{obj("a", 1, true, false), obj("b", 2, true, false), obj("c", 3, true, false), obj("d", 4, true, false), obj("e", 5, false, false)},
			// 4 read of 5: more than 60% until one of them went.
			[]string{"a", "e", "b", "c", "d"}},
		{"all read", []evictable{obj("b", 2, true, false), obj("a", 1, true, false)}, []string{"a", "b"}},
		{"leased skipped", []evictable{obj("a", 1, false, true), obj("b", 2, false, false), obj("c", 3, true, false)}, []string{"b", "c"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			victims, _ := (&Server{}).pickVictims(slices.Clone(tc.objs), uint64(len(tc.objs)), now)
			var got []string
			for _, v := range victims {
				got = append(got, v.key)
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("victims %v, want %v", got, tc.want)
			}
		})
	}
}

// TestEvictWatermark: a segment above the high watermark is brought down
// to high - ratio by the sweep, least recently used first, never the
// hard-pinned, and no further than that.
func TestEvictWatermark(t *testing.T) {
	t.Parallel()
	e := newEvictEnv(t, func(cfg *Config) { cfg.HighWatermark = 0.5 })
	m := e.m
	const high, ratio = 0.5, DefaultEvictRatio
	limit := uint64(math.Floor((high - ratio) * segCap))
	putObject(t, m, "k00", 64*kib)
	pinKey(t, e, "k00", true, 0)
	e.waitEvictable(t)

	round := func(n int, keys []string, want []string) {
		t.Helper()
		batchPut(t, m, 64*kib, keys...)
		waitFor(t, 5*time.Second, "the sweep brings the segment to the watermark", func() error {
			if u := e.used(t); u > limit {
				return fmt.Errorf("used %d, want at most %d", u, limit)
			}
			return nil
		})
		time.Sleep(150 * time.Millisecond) // a few more sweeps change nothing
		if u := e.used(t); u > limit || u+64*kib <= limit {
			t.Fatalf("round %d: used %d, want in (%d, %d]: evicted to the watermark and no further", n, u, limit-64*kib, limit)
		}
		all := append(keyNames("k", 15), keyNames("r", 6)...)
		var got []string
		for _, k := range present(t, m, all...) {
			if k[0] != '-' {
				got = append(got, k)
			}
		}
		if !slices.Equal(got, want) {
			t.Fatalf("round %d: objects %v, want %v", n, got, want)
		}
	}
	// 15 objects: 0.94 full. Evicting k01..k08 leaves 7, 0.44.
	round(1, keyNames("k", 15)[1:], []string{"k00", "k09", "k10", "k11", "k12", "k13", "k14"})
	if n := e.evictions(t, "watermark"); n != 8 {
		t.Fatalf("watermark evictions %v, want 8", n)
	}
	// Six more: 13 objects, 0.81 full. k09..k14 are the least recently used.
	round(2, keyNames("r", 6), []string{"k00", "r00", "r01", "r02", "r03", "r04", "r05"})
	if n := e.evictions(t, "watermark"); n != 14 {
		t.Fatalf("watermark evictions %v, want 14", n)
	}
	if n := e.evictions(t, "allocation"); n != 0 {
		t.Fatalf("allocation evictions %v without allocation pressure", n)
	}
}

// TestEvictWatermarkOnlySegmentsAbove: the sweep evicts from the segments
// above the high watermark only; one below it stays as it is, even when it
// is above high - ratio.
func TestEvictWatermarkOnlySegmentsAbove(t *testing.T) {
	t.Parallel()
	const high, ratio = 0.8, 0.1
	e := newEvictEnv(t, func(cfg *Config) { cfg.HighWatermark, cfg.EvictRatio = high, ratio })
	m := e.m
	e.waitEvictable(t)
	// s/a@1 at 0.75: between high - ratio and high.
	b := keyNames("b", 12)
	batchPut(t, m, 64*kib, b...)
	register(t, m, "t", "ep2", dram("a", segCap))
	// Three 300 KiB objects fit only on t/a@1: 0.88 full.
	a := keyNames("a", 3)
	for _, k := range a {
		if r := putObject(t, m, k, 300*kib); r.Segment != "t/a@1" {
			t.Fatalf("%s placed on %s", k, r.Segment)
		}
	}
	waitFor(t, 5*time.Second, "t/a@1 brought down", func() error {
		if u := segmentUsed(t, m, "t/a@1"); float64(u) > (high-ratio)*segCap {
			return fmt.Errorf("used %d", u)
		}
		return nil
	})
	time.Sleep(150 * time.Millisecond)
	if got := present(t, m, a...); !slices.Equal(got, []string{"-a00", "a01", "a02"}) {
		t.Fatalf("objects of the segment above the watermark: %v", got)
	}
	if got := present(t, m, b...); !slices.Equal(got, b) {
		t.Fatalf("objects of the segment below the watermark: %v, want all kept", got)
	}
	if u := e.used(t); u != 12*64*kib {
		t.Fatalf("used %d of the segment below the watermark, want it untouched", u)
	}
}

func evictKeys(resp *pb.EvictResponse) []string {
	var keys []string
	for _, o := range resp.Objects {
		keys = append(keys, o.Key)
	}
	return keys
}

func TestAdminEvict(t *testing.T) {
	t.Parallel()
	e := newEvictEnv(t, func(cfg *Config) { cfg.HighWatermark = 1 })
	m, admin := e.m, e.admin()
	var all []string
	put := func(k string, size uint64) {
		t.Helper()
		putObject(t, m, k, size)
		all = append(all, k)
	}
	for i := range 6 {
		put(fmt.Sprintf("p/%d", i), uint64(i+1)*kib)
	}
	for i := range 3 {
		put(fmt.Sprintf("q/%d", i), 2*kib)
	}
	put("px", kib) // a prefix of "p/" is not "p/"
	pinKey(t, e, "p/1", true, 0)
	pinKey(t, e, "p/2", false, time.Hour)
	e.waitEvictable(t)

	evict := func(req *pb.EvictRequest) *pb.EvictResponse {
		t.Helper()
		resp, err := admin.Evict(rpcCtx(t), req)
		if err != nil {
			t.Fatalf("evict %v: %v", req, err)
		}
		return resp
	}
	remaining := func() []string {
		t.Helper()
		var out []string
		for _, k := range present(t, m, all...) {
			if k[0] != '-' {
				out = append(out, k)
			}
		}
		return out
	}

	t.Run("invalid", func(t *testing.T) {
		for _, req := range []*pb.EvictRequest{
			{},
			{DryRun: true},
			{Tier: pb.Tier_TIER_DRAM},
			{ToWatermark: 0.5, Prefix: "p/"},
			{ToWatermark: 0.5, Key: "p/0"},
			{ToWatermark: 0.5, OlderThanMs: 10},
			{ToWatermark: 1},
			{ToWatermark: 1.5},
			{ToWatermark: -0.1},
			{ToWatermark: math.NaN()},
			{ToWatermark: math.Inf(1)},
			{ToWatermark: math.NaN(), Prefix: "p/"},
		} {
			_, err := admin.Evict(rpcCtx(t), req)
			wantCode(t, err, codes.InvalidArgument, fmt.Sprintf("evict %v", req))
		}
		if got := remaining(); !slices.Equal(got, all) {
			t.Fatalf("an invalid evict removed objects: %v", got)
		}
		// Pin and Unpin check their input too.
		_, err := admin.Pin(rpcCtx(t), &pb.PinRequest{Key: ""})
		wantCode(t, err, codes.InvalidArgument, "pin of an empty key")
		_, err = admin.Pin(rpcCtx(t), &pb.PinRequest{Key: "p/0", TtlMs: uint64((25 * time.Hour).Milliseconds())})
		wantCode(t, err, codes.InvalidArgument, "a soft pin over 24 h")
		_, err = admin.Unpin(rpcCtx(t), &pb.KeysRequest{})
		wantCode(t, err, codes.InvalidArgument, "unpin of no keys")
		resp, err := admin.Pin(rpcCtx(t), &pb.PinRequest{Key: "nope", Hard: true})
		if err != nil || len(resp.Results) != 1 || codes.Code(resp.Results[0].Code) != codes.NotFound {
			t.Fatalf("pin of a missing key = %v, %v; want item NotFound", resp, err)
		}
	})

	t.Run("key", func(t *testing.T) {
		dry := evict(&pb.EvictRequest{Key: "q/0", DryRun: true})
		if got := evictKeys(dry); !slices.Equal(got, []string{"q/0"}) || dry.Bytes != 2*kib || dry.Skipped != 0 {
			t.Fatalf("dry run = %v", dry)
		}
		if !exists(t, m, "q/0")[0] {
			t.Fatal("a dry run evicted")
		}
		real := evict(&pb.EvictRequest{Key: "q/0"})
		if got := evictKeys(real); !slices.Equal(got, []string{"q/0"}) || real.Bytes != 2*kib {
			t.Fatalf("evict --key q/0 = %v", real)
		}
		if exists(t, m, "q/0")[0] {
			t.Fatal("q/0 survived its eviction")
		}
		if resp := evict(&pb.EvictRequest{Key: "q/0"}); len(resp.Objects) != 0 || resp.Bytes != 0 || resp.Skipped != 0 {
			t.Fatalf("evict of a missing key = %v", resp)
		}
	})

	t.Run("prefix dry run equals the real run", func(t *testing.T) {
		// A leased object matches too: its space is kept until the lease ends.
		if _, err := m.master().GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{"p/4"}}); err != nil {
			t.Fatal(err)
		}
		before, objs := e.used(t), remaining()
		dry := evict(&pb.EvictRequest{Prefix: "p/", DryRun: true})
		if got := remaining(); !slices.Equal(got, objs) {
			t.Fatalf("a dry run changed the objects: %v, before %v", got, objs)
		}
		if u := e.used(t); u != before {
			t.Fatalf("a dry run changed used bytes: %d -> %d", before, u)
		}
		real := evict(&pb.EvictRequest{Prefix: "p/"})
		want := []string{"p/0", "p/2", "p/3", "p/5", "p/4"} // by recency; p/1 hard pinned; p/4 just read
		if got := evictKeys(dry); !slices.Equal(got, want) {
			t.Fatalf("dry run lists %v, want %v", got, want)
		}
		if got := evictKeys(real); !slices.Equal(got, evictKeys(dry)) || real.Bytes != dry.Bytes || real.Skipped != dry.Skipped {
			t.Fatalf("evict --prefix p/ = %v (%d bytes, %d skipped), dry run %v (%d bytes, %d skipped)",
				evictKeys(real), real.Bytes, real.Skipped, evictKeys(dry), dry.Bytes, dry.Skipped)
		}
		if real.Bytes != (1+3+4+6+5)*kib || real.Skipped != 1 {
			t.Fatalf("evict --prefix p/: %d bytes, %d skipped; want %d and 1", real.Bytes, real.Skipped, (1+3+4+6+5)*kib)
		}
		if got := present(t, m, "p/0", "p/1", "p/2", "p/3", "p/4", "p/5", "px", "q/1"); !slices.Equal(got, []string{"-p/0", "p/1", "-p/2", "-p/3", "-p/4", "-p/5", "px", "q/1"}) {
			t.Fatalf("after evict --prefix p/: %v", got)
		}
		waitFor(t, 5*time.Second, "the space of the evicted objects freed", func() error {
			itemCodes(t, "put revoke", m.master().PutRevoke, "tick")
			if u, want := e.used(t), before-(1+3+4+6+5)*kib; u != want {
				return fmt.Errorf("used %d, want %d", u, want)
			}
			return nil
		})
		if resp := evict(&pb.EvictRequest{Prefix: "p/"}); len(resp.Objects) != 0 || resp.Skipped != 1 {
			t.Fatalf("second evict --prefix p/ = %v, want nothing but the hard pin skipped", resp)
		}
		if n := e.evictions(t, "admin"); n != 6 {
			t.Fatalf("admin evictions %v, want 6", n)
		}
	})

	t.Run("older than", func(t *testing.T) {
		put("age/old", kib)
		time.Sleep(400 * time.Millisecond)
		put("age/new", kib)
		for _, dry := range []bool{true, false} {
			resp := evict(&pb.EvictRequest{Prefix: "age/", OlderThanMs: 200, DryRun: dry})
			if got := evictKeys(resp); !slices.Equal(got, []string{"age/old"}) {
				t.Fatalf("evict --older-than 200ms (dry run %v) = %v", dry, got)
			}
		}
		if got := present(t, m, "age/old", "age/new"); !slices.Equal(got, []string{"-age/old", "age/new"}) {
			t.Fatalf("after evict --older-than: %v", got)
		}
		// With no prefix, the age alone selects: everything put before.
		dry := evict(&pb.EvictRequest{OlderThanMs: 200, DryRun: true})
		if got := evictKeys(dry); slices.Contains(got, "age/new") || !slices.Contains(got, "px") || slices.Contains(got, "p/1") {
			t.Fatalf("evict --older-than 200ms --dry-run = %v", got)
		}
	})

	t.Run("to watermark", func(t *testing.T) {
		for i := range 12 {
			put(fmt.Sprintf("w/%02d", i), 64*kib)
		}
		u := e.used(t)
		if u < segCap/2 {
			t.Fatalf("setup: used %d", u)
		}
		if resp := evict(&pb.EvictRequest{ToWatermark: 0.3, Tier: pb.Tier_TIER_SSD, DryRun: true}); len(resp.Objects) != 0 {
			t.Fatalf("to watermark of the SSD tier, which has no segment, = %v", evictKeys(resp))
		}
		dry := evict(&pb.EvictRequest{ToWatermark: 0.3, DryRun: true})
		dramDry := evict(&pb.EvictRequest{ToWatermark: 0.3, Tier: pb.Tier_TIER_DRAM, DryRun: true})
		if !slices.Equal(evictKeys(dry), evictKeys(dramDry)) {
			t.Fatalf("to watermark, all tiers %v, DRAM %v", evictKeys(dry), evictKeys(dramDry))
		}
		if e.used(t) != u {
			t.Fatal("a dry run changed used bytes")
		}
		real := evict(&pb.EvictRequest{ToWatermark: 0.3})
		if !slices.Equal(evictKeys(real), evictKeys(dry)) || real.Bytes != dry.Bytes {
			t.Fatalf("to watermark: evicted %v (%d bytes), dry run %v (%d bytes)", evictKeys(real), real.Bytes, evictKeys(dry), dry.Bytes)
		}
		if slices.Contains(evictKeys(real), "p/1") {
			t.Fatal("to watermark evicted the hard-pinned object")
		}
		if got := e.used(t); float64(got) > 0.3*segCap || u-got < real.Bytes {
			t.Fatalf("used %d after evicting %d of %d to 0.3", got, real.Bytes, u)
		}
		if resp := evict(&pb.EvictRequest{ToWatermark: 0.3, DryRun: true}); len(resp.Objects) != 0 {
			t.Fatalf("a second to-watermark dry run still lists %v", evictKeys(resp))
		}
		if !exists(t, m, "p/1")[0] {
			t.Fatal("the hard-pinned object is gone")
		}
	})
}

// TestAdminPinEvictOnFollower: the admin service refuses on a follower, naming the
// leader like the others.
func TestAdminPinEvictOnFollower(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 3, nil)
	leader := c.leader()
	register(t, leader, "s", "ep", dram("a", segCap))
	putObject(t, leader, "k", kib)
	for _, f := range c.followers() {
		a := pb.NewAdminClient(f.conn)
		_, err := a.Evict(rpcCtx(t), &pb.EvictRequest{Key: "k", DryRun: true})
		wantCode(t, err, codes.Unavailable, "evict on a follower")
		_, err = a.Pin(rpcCtx(t), &pb.PinRequest{Key: "k", Hard: true})
		wantCode(t, err, codes.Unavailable, "pin on a follower")
	}
	if resp, err := pb.NewAdminClient(leader.conn).Pin(rpcCtx(t), &pb.PinRequest{Key: "k", Hard: true}); err != nil || resp.Results[0].Code != 0 {
		t.Fatalf("pin on the leader = %v, %v", resp, err)
	}
	// The pin is replicated: a new leader keeps it.
	for i, m := range c.members {
		if m == leader {
			c.kill(i)
		}
	}
	leader = c.leader()
	resp, err := pb.NewAdminClient(leader.conn).Evict(rpcCtx(t), &pb.EvictRequest{Key: "k"})
	if err != nil || len(resp.Objects) != 0 || resp.Skipped != 1 {
		t.Fatalf("evict of the pinned key on the new leader = %v, %v", resp, err)
	}
	if !exists(t, leader, "k")[0] {
		t.Fatal("the pinned object is gone after the failover")
	}
}
