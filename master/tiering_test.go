package master

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// The tiering and drain tests run one master with a quick sweep and fake
// stores: goroutines that heartbeat like a store and make the copies the
// leader hands them, by reporting them (no bytes move).

// copyMode is what a fake store does with the copies it is handed.
type copyMode int32

const (
	reportOK     copyMode = iota // report each done on the next heartbeat
	reportFailed                 // report each failed
	holdCopies                   // keep them unreported until the mode changes
)

// fakeStore is a store node that only heartbeats, with copy_slots 8.
type fakeStore struct {
	node       string
	epoch      uint64
	putTimeout time.Duration
	mode       atomic.Int32
	mu         struct {
		sync.Mutex
		got   []*pb.CopyTask // every copy handed to it
		held  []*pb.CopyTask // not reported yet
		beats int            // heartbeats answered
		err   error          // of the last heartbeat
		bad   []string       // malformed copy tasks
	}
}

// startFakeStore registers node with specs and heartbeats for it every
// 20 ms until the test ends.
func startFakeStore(t *testing.T, m *member, node string, mode copyMode, specs ...*pb.SegmentSpec) *fakeStore {
	t.Helper()
	resp := register(t, m, node, "ep-"+node, specs...)
	fs := &fakeStore{node: node, epoch: resp.Epoch, putTimeout: m.srv.cfg.PutTimeout}
	fs.mode.Store(int32(mode))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	reg := m.registry()
	go func() {
		defer close(done)
		fs.run(ctx, reg)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		fs.mu.Lock()
		defer fs.mu.Unlock()
		for _, b := range fs.mu.bad {
			t.Errorf("store %s was handed a bad copy task: %s", node, b)
		}
	})
	return fs
}

func (fs *fakeStore) run(ctx context.Context, reg pb.RegistryClient) {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	var report []*pb.CopyResult // sent again until a heartbeat takes it
	for {
		fs.mu.Lock()
		mode := copyMode(fs.mode.Load())
		if mode != holdCopies {
			st := &pb.ItemStatus{}
			if mode == reportFailed {
				st = &pb.ItemStatus{Code: int32(codes.Internal), Message: "injected copy failure"}
			}
			for _, task := range fs.mu.held {
				report = append(report, &pb.CopyResult{Id: task.Id, Key: task.Key, Status: st})
			}
			fs.mu.held = nil
		}
		fs.mu.Unlock()
		hctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		resp, err := reg.Heartbeat(hctx, &pb.HeartbeatRequest{Node: fs.node, Epoch: fs.epoch, CopiesDone: report, CopySlots: 8})
		cancel()
		if ctx.Err() != nil {
			return
		}
		fs.mu.Lock()
		fs.mu.err = err
		if err == nil {
			fs.mu.beats++
			report = nil
			if len(resp.Copies) > 8 {
				fs.mu.bad = append(fs.mu.bad, fmt.Sprintf("%d copies for 8 slots", len(resp.Copies)))
			}
			for _, task := range resp.Copies {
				if problem := fs.checkTask(task); problem != "" {
					fs.mu.bad = append(fs.mu.bad, fmt.Sprintf("%s: %v", problem, task))
				}
				fs.mu.got = append(fs.mu.got, task)
				fs.mu.held = append(fs.mu.held, task)
			}
		}
		fs.mu.Unlock()
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// checkTask says what is wrong with a copy task, if anything.
func (fs *fakeStore) checkTask(task *pb.CopyTask) string {
	switch {
	case task.Id == 0 || task.Key == "" || task.Size == 0:
		return "no id, key or size"
	case task.Source == nil || task.Target == nil:
		return "no source or target"
	case task.Source.Node != fs.node:
		return "the source is on another node"
	case task.Source.Segment == task.Target.Segment:
		return "source and target are one segment"
	case task.Source.Length != task.Size || task.Target.Length != task.Size:
		return "a replica's length is not the size"
	case task.TimeoutMs == 0 || time.Duration(task.TimeoutMs)*time.Millisecond > fs.putTimeout:
		return "a timeout of none or beyond the put timeout"
	}
	return ""
}

func (fs *fakeStore) tasks() []*pb.CopyTask {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return slices.Clone(fs.mu.got)
}

func (fs *fakeStore) held() int {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return len(fs.mu.held)
}

func (fs *fakeStore) beats() int {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return fs.mu.beats
}

func (fs *fakeStore) lastErr() error {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return fs.mu.err
}

// tierEnv is one master whose clock a test may move forward.
type tierEnv struct {
	m    *member
	reg  *prometheus.Registry
	skew atomic.Int64 // nanoseconds added to the master's clock
}

func newTierEnv(t *testing.T, tweak func(*Config)) *tierEnv {
	t.Helper()
	e := &tierEnv{reg: prometheus.NewRegistry()}
	c := newCluster(t, 1, func(cfg *Config) {
		cfg.LeaseTTL = 200 * time.Millisecond
		// Some stores here are registered and never heartbeat: a slow run
		// under the race detector must not declare them dead.
		cfg.NodeTTL = time.Minute
		cfg.Registerer = e.reg
		cfg.Now = func() time.Time { return time.Now().Add(time.Duration(e.skew.Load())) }
		if tweak != nil {
			tweak(cfg)
		}
	})
	e.m = c.leader()
	return e
}

// noWriteBack keeps DRAM objects from gaining SSD copies ahead of need, so
// a test sees demotion alone.
func noWriteBack(cfg *Config) { cfg.NoWriteBack = true }

func (e *tierEnv) admin() pb.AdminClient { return pb.NewAdminClient(e.m.conn) }

func (e *tierEnv) waitEvictable(t *testing.T) {
	t.Helper()
	waitFor(t, 30*time.Second, "the leader may evict", func() error {
		if from := e.m.srv.evictableFrom(); e.m.srv.cfg.Now().Before(from) {
			return fmt.Errorf("not before %v", from)
		}
		return nil
	})
}

// count sums the counters of a family whose labels include want
// ("name", "value" pairs).
func (e *tierEnv) count(t *testing.T, family string, want ...string) float64 {
	t.Helper()
	return countLabeled(t, e.reg, family, want...)
}

func countLabeled(t *testing.T, reg *prometheus.Registry, family string, want ...string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, f := range families {
		if f.GetName() != family {
			continue
		}
	metrics:
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			for i := 0; i+1 < len(want); i += 2 {
				if labels[want[i]] != want[i+1] {
					continue metrics
				}
			}
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

// putBatch starts reqs in one BatchPutStart and ends them in one PutEnd,
// so they share one recency; it fails unless every put is placed.
func putBatch(t *testing.T, m *member, reqs ...*pb.PutStartRequest) []*pb.PutStartResult {
	t.Helper()
	resp, err := m.master().BatchPutStart(rpcCtx(t), &pb.BatchPutStartRequest{Items: reqs})
	if err != nil {
		t.Fatal(err)
	}
	keys := make([]string, len(reqs))
	for i, r := range resp.Results {
		if r.Status.GetCode() != 0 || r.Exists || len(r.Replicas) == 0 {
			t.Fatalf("put start %q: %v", reqs[i].Key, r)
		}
		keys[i] = reqs[i].Key
	}
	items(t, m, "put end", m.master().PutEnd, keys...)
	return resp.Results
}

// sized puts keys of size bytes with the same options.
func sized(size uint64, opts *pb.PutStartRequest, keys ...string) []*pb.PutStartRequest {
	out := make([]*pb.PutStartRequest, len(keys))
	for i, k := range keys {
		out[i] = &pb.PutStartRequest{Key: k, Size: size, Checksum: uint32(i), Tier: opts.GetTier(), Replicas: opts.GetReplicas(), Tenant: opts.GetTenant()}
	}
	return out
}

// placement lists where each of keys is readable, as "segment" strings in
// the order readers get them (fastest tier first); a missing key has none.
func placement(t *testing.T, m *member, keys ...string) map[string][]string {
	t.Helper()
	resp, err := m.master().List(rpcCtx(t), &pb.ListRequest{Limit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]string{}
	for _, o := range resp.Objects {
		if !slices.Contains(keys, o.Key) {
			continue
		}
		for _, r := range o.Replicas {
			out[o.Key] = append(out[o.Key], r.Segment)
		}
	}
	return out
}

// copiesInFlight counts the copies the FSM has started and not ended.
func copiesInFlight(f *FSM) int {
	f.mu.RLock()
	defer f.mu.RUnlock()
	n := 0
	for _, o := range f.objects.all() {
		n += len(f.copies(o))
	}
	return n
}

// settled waits until segment seg is at most mark of its capacity and no
// copy is in flight.
func settled(t *testing.T, m *member, seg string, capacity uint64, mark float64) {
	t.Helper()
	waitFor(t, 10*time.Second, seg+" demoted below the watermark", func() error {
		if u := segmentUsed(t, m, seg); float64(u) > mark*float64(capacity) {
			return fmt.Errorf("used %d of %d", u, capacity)
		}
		if n := copiesInFlight(m.srv.fsm); n > 0 {
			return fmt.Errorf("%d copies in flight", n)
		}
		return nil
	})
}

const (
	sDRAM = "s/a@1"
	sSSD  = "s/b@1"
)

// TestTieringDemotes: a DRAM segment above the high watermark has its least
// recently used objects copied to SSD (on the same node, not to HBM, which
// a host reads slower than DRAM but is no place for cold objects) and their
// DRAM replicas dropped; nothing is evicted.
func TestTieringDemotes(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, noWriteBack)
	m := e.m
	hbm := &pb.SegmentSpec{Name: "h", Tier: pb.Tier_TIER_HBM, Capacity: 8 * segCap}
	fs := startFakeStore(t, m, "s", reportOK, dram("a", segCap), hbm, ssd("b", 8*segCap))
	e.waitEvictable(t)
	keys := keyNames("k", 15) // 0.94 of DRAM
	for i, r := range putBatch(t, m, sized(64*kib, nil, keys...)...) {
		if len(r.Replicas) != 1 || r.Replicas[0].Segment != sDRAM {
			t.Fatalf("%s placed on %v, want DRAM", keys[i], r.Replicas)
		}
	}
	settled(t, m, sDRAM, segCap, DefaultHighWatermark)

	// Down to 0.85: 13 objects stay, the two least recently used (a tie,
	// so in key order) moved.
	want := map[string][]string{}
	for i, k := range keys {
		want[k] = []string{sDRAM}
		if i < 2 {
			want[k] = []string{sSSD}
		}
	}
	if got := placement(t, m, keys...); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("placement after demotion:\n got %v\nwant %v", got, want)
	}
	if u := segmentUsed(t, m, sDRAM); u != 13*64*kib {
		t.Fatalf("DRAM used %d, want 13 objects", u)
	}
	if u := segmentUsed(t, m, sSSD); u != 2*64*kib {
		t.Fatalf("SSD used %d, want the 2 demoted objects", u)
	}
	if u := segmentUsed(t, m, "s/h@1"); u != 0 {
		t.Fatalf("HBM used %d: cold objects were demoted into GPU memory", u)
	}
	if n := e.count(t, "tidepool_master_copies_total", "reason", "demote", "result", "ok"); n != 2 {
		t.Fatalf("demotions %v, want 2", n)
	}
	if n := e.count(t, "tidepool_master_copied_bytes_total", "reason", "demote"); n != 2*64*kib {
		t.Fatalf("demoted bytes %v", n)
	}
	if n := e.count(t, "tidepool_master_evictions_total"); n != 0 {
		t.Fatalf("%v evictions: demotion should have made the room", n)
	}
	for _, task := range fs.tasks() {
		if task.Source.Tier != pb.Tier_TIER_DRAM || task.Target.Tier != pb.Tier_TIER_SSD || task.Target.Node != "s" {
			t.Fatalf("demotion task %v: want DRAM to the SSD of the same node", task)
		}
	}
}

// TestTieringDemoteDropsFastReplica: an object above the watermark that
// already has an SSD replica just loses its DRAM one, with no copy.
func TestTieringDemoteDropsFastReplica(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, nil)
	m := e.m
	startFakeStore(t, m, "s", reportOK, dram("a", segCap))
	startFakeStore(t, m, "t", reportOK, ssd("b", 8*segCap)) // heartbeats: a slow run must not lose it
	e.waitEvictable(t)
	keys := keyNames("k", 15)
	for i, r := range putBatch(t, m, sized(64*kib, &pb.PutStartRequest{Replicas: 2}, keys...)...) {
		if len(r.Replicas) != 2 || r.Replicas[0].Segment != sDRAM || r.Replicas[1].Segment != "t/b@1" {
			t.Fatalf("%s placed on %v, want s's DRAM and t's SSD", keys[i], r.Replicas)
		}
	}
	settled(t, m, sDRAM, segCap, DefaultHighWatermark)
	got := placement(t, m, keys...)
	for i, k := range keys {
		want := []string{sDRAM, "t/b@1"}
		if i < 2 {
			want = []string{"t/b@1"}
		}
		if !slices.Equal(got[k], want) {
			t.Fatalf("%s on %v, want %v", k, got[k], want)
		}
	}
	if n := e.count(t, "tidepool_master_replica_drops_total", "reason", "demote"); n != 2 {
		t.Fatalf("demotion drops %v, want 2", n)
	}
	if n := e.count(t, "tidepool_master_copies_total"); n != 0 {
		t.Fatalf("%v copies: the objects had an SSD replica already", n)
	}
	if n := e.count(t, "tidepool_master_evictions_total"); n != 0 {
		t.Fatalf("%v evictions", n)
	}
}

// TestTieringPromotes: an object read DefaultPromoteAfter times from SSD only
// gains a DRAM replica, which readers then get first; its SSD one stays.
func TestTieringPromotes(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, nil)
	m := e.m
	fs := startFakeStore(t, m, "s", reportOK, dram("a", segCap), ssd("b", 8*segCap))
	for i, r := range putBatch(t, m, sized(64*kib, &pb.PutStartRequest{Tier: pb.Tier_TIER_SSD}, "hot", "cold")...) {
		if r.Replicas[0].Segment != sSSD {
			t.Fatalf("put %d placed on %v, want SSD", i, r.Replicas)
		}
	}
	get := func(key string) []*pb.Replica {
		t.Helper()
		resp, err := m.master().GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{key}})
		if err != nil || resp.Results[0].Status.GetCode() != 0 {
			t.Fatalf("get replicas %q: %v %v", key, resp, err)
		}
		return resp.Results[0].Replicas
	}
	for range DefaultPromoteAfter {
		get("hot")
	}
	get("cold") // once: not hot enough
	waitFor(t, 10*time.Second, "hot promoted", func() error {
		if got := placement(t, m, "hot")["hot"]; len(got) != 2 {
			return fmt.Errorf("hot on %v", got)
		}
		return nil
	})
	if reps := get("hot"); len(reps) != 2 || reps[0].Tier != pb.Tier_TIER_DRAM || reps[0].Segment != sDRAM || reps[1].Segment != sSSD {
		t.Fatalf("replicas of a promoted object: %v, want DRAM first, then SSD", reps)
	}
	if got := placement(t, m, "cold")["cold"]; !slices.Equal(got, []string{sSSD}) {
		t.Fatalf("cold, read once, on %v", got)
	}
	if n := e.count(t, "tidepool_master_copies_total", "reason", "promote", "result", "ok"); n != 1 {
		t.Fatalf("promotions %v, want 1", n)
	}
	// Reads served from DRAM promote nothing more.
	for range 2 * DefaultPromoteAfter {
		get("hot")
	}
	beats := fs.beats()
	waitFor(t, 10*time.Second, "ten more heartbeats", func() error {
		if fs.beats() < beats+10 {
			return errors.New("not yet")
		}
		return nil
	})
	if n := len(fs.tasks()); n != 1 {
		t.Fatalf("%d copies handed out, want the one promotion", n)
	}
}

// TestTieringFailedCopies: a copy its store fails frees its target at once
// and leaves the object as it was; demotion retries, and once copies work
// the SSD holds exactly the demoted objects.
func TestTieringFailedCopies(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, noWriteBack)
	m := e.m
	fs := startFakeStore(t, m, "s", reportFailed, dram("a", segCap), ssd("b", 8*segCap))
	e.waitEvictable(t)
	keys := keyNames("k", 15)
	putBatch(t, m, sized(64*kib, nil, keys...)...)
	waitFor(t, 10*time.Second, "copies failed", func() error {
		if n := e.count(t, "tidepool_master_copies_total", "reason", "demote", "result", "failed"); n < 4 {
			return fmt.Errorf("%v failed", n)
		}
		return nil
	})
	for k, segs := range placement(t, m, keys...) {
		if !slices.Equal(segs, []string{sDRAM}) {
			t.Fatalf("%s on %v after failed copies, want DRAM only", k, segs)
		}
	}
	if got := present(t, m, keys...); !slices.Equal(got, keys) {
		t.Fatalf("objects after failed copies: %v", got)
	}
	fs.mode.Store(int32(reportOK))
	settled(t, m, sDRAM, segCap, DefaultHighWatermark)
	if u := segmentUsed(t, m, sSSD); u != 2*64*kib {
		t.Fatalf("SSD used %d, want the 2 demoted objects only: failed copies leaked their targets", u)
	}
	if n := countPending(m.srv.fsm); n != 0 {
		t.Fatalf("%d pending frees: a failed copy's target is free at once", n)
	}
	if n := e.count(t, "tidepool_master_copies_total", "reason", "demote", "result", "ok"); n != 2 {
		t.Fatalf("demotions %v, want 2", n)
	}
	if n := e.count(t, "tidepool_master_evictions_total"); n != 0 {
		t.Fatalf("%v evictions", n)
	}
}

// TestTieringExpiredCopies: copies no store reports end at their deadline;
// their targets stay reserved for the late-write grace, then are free. A
// late report of an ended copy is not counted again.
func TestTieringExpiredCopies(t *testing.T) {
	t.Parallel()
	const putTimeout = 1500 * time.Millisecond
	e := newTierEnv(t, func(cfg *Config) { cfg.PutTimeout = putTimeout; cfg.NoWriteBack = true })
	m := e.m
	fs := startFakeStore(t, m, "s", holdCopies, dram("a", segCap), ssd("b", 8*segCap))
	e.waitEvictable(t)
	keys := keyNames("k", 15)
	putBatch(t, m, sized(64*kib, nil, keys...)...)
	waitFor(t, 10*time.Second, "copies expired", func() error {
		if n := e.count(t, "tidepool_master_copies_total", "reason", "demote", "result", "expired"); n < 1 {
			return fmt.Errorf("%v expired", n)
		}
		return nil
	})
	if fs.held() == 0 {
		t.Fatal("the store was handed no copy")
	}
	for k, segs := range placement(t, m, keys...) {
		if !slices.Equal(segs, []string{sDRAM}) {
			t.Fatalf("%s on %v after expired copies, want DRAM only", k, segs)
		}
	}
	if countPending(m.srv.fsm) == 0 || segmentUsed(t, m, sSSD) == 0 {
		t.Fatal("an expired copy's target was freed before the late-write grace")
	}
	// The store reports everything now: the copies it held, past their
	// deadline, fail (and keep their targets for the grace), new ones
	// demote. Then the grace passes.
	fs.mode.Store(int32(reportOK))
	settled(t, m, sDRAM, segCap, DefaultHighWatermark)
	e.skew.Add(int64(lateWriteGrace) + int64(putTimeout))
	waitFor(t, 10*time.Second, "the expired copies' targets freed", func() error {
		itemCodes(t, "put revoke", m.master().PutRevoke, "tick") // any command releases what is due
		if n := countPending(m.srv.fsm); n != 0 {
			return fmt.Errorf("%d pending frees", n)
		}
		if u := segmentUsed(t, m, sSSD); u != 2*64*kib {
			return fmt.Errorf("SSD used %d, want the 2 demoted objects", u)
		}
		return nil
	})
	if n := e.count(t, "tidepool_master_copies_total", "reason", "demote", "result", "ok"); n != 2 {
		t.Fatalf("demotions %v, want 2", n)
	}
	// A copy is counted once: as expired when the sweep ended it, as
	// failed when its store reported it late, never both.
	ended := e.count(t, "tidepool_master_copies_total", "result", "expired") + e.count(t, "tidepool_master_copies_total", "result", "failed")
	if handed := float64(len(fs.tasks())); ended+2 != handed {
		t.Fatalf("%v copies handed out, %v ended unsuccessfully and 2 well", handed, ended)
	}
	if got := present(t, m, keys...); !slices.Equal(got, keys) {
		t.Fatalf("objects: %v", got)
	}
}

// TestTakeCopies: a heartbeat takes at most its slots of queued copies,
// each with the time left to its deadline as its timeout, and none too
// close to its deadline.
func TestTakeCopies(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, func(cfg *Config) { cfg.PutTimeout = 10 * time.Second })
	s := e.m.srv
	now := s.cfg.Now()
	queue := func(id uint64, left time.Duration) queuedCopy {
		return queuedCopy{task: &pb.CopyTask{Id: id, TimeoutMs: 10_000}, deadline: now.Add(left)}
	}
	s.mu.Lock()
	s.mu.copyQueue["n"] = []queuedCopy{
		queue(1, 10*time.Second), queue(2, 500*time.Millisecond), queue(3, -time.Second),
		queue(4, 8*time.Second), queue(5, 9*time.Second), queue(6, 9*time.Second),
	}
	s.mu.Unlock()
	e.skew.Add(int64(2 * time.Second)) // they waited in the queue
	var ids []uint64
	for _, task := range s.takeCopies("n", 3) {
		ids = append(ids, task.Id)
		left := map[uint64]time.Duration{1: 8 * time.Second, 4: 6 * time.Second, 5: 7 * time.Second}[task.Id]
		if got := time.Duration(task.TimeoutMs) * time.Millisecond; got > left || got < left-time.Second {
			t.Fatalf("copy %d: timeout %v, want about the %v left to its deadline", task.Id, got, left)
		}
	}
	if !slices.Equal(ids, []uint64{1, 4, 5}) {
		t.Fatalf("took %v, want 1, 4, 5 (2 and 3 are too close to or past their deadline)", ids)
	}
	if got := s.takeCopies("n", 8); len(got) != 1 || got[0].Id != 6 {
		t.Fatalf("second take = %v, want the rest", got)
	}
	if got := s.takeCopies("n", 8); len(got) != 0 {
		t.Fatalf("third take = %v", got)
	}
}

// TestEvictLeavesFirst: the blocks of a chain put in one batch have the
// same recency; eviction takes the deepest first, so what stays is a
// prefix of the chain.
func TestEvictLeavesFirst(t *testing.T) {
	t.Parallel()
	e := newEvictEnv(t, func(cfg *Config) { cfg.HighWatermark = 1 }) // no sweep eviction
	m, admin := e.m, e.admin()
	e.waitEvictable(t)
	// c0 <- c1 <- ... <- c7, 128 KiB each: the segment is full. Key order
	// is the chain's order, so it cannot stand in for depth.
	chain := keyNames("c", 8)
	var reqs []*pb.PutStartRequest
	for i, k := range chain {
		r := &pb.PutStartRequest{Key: k, Size: 128 * kib}
		if i > 0 {
			r.Parent = chain[i-1]
		}
		reqs = append(reqs, r)
	}
	putBatch(t, m, reqs...)
	if u := e.used(t); u != segCap {
		t.Fatalf("used %d, want a full segment", u)
	}
	for _, tc := range []struct {
		mark float64
		want []string
	}{
		{0.95, chain[7:]},
		{0.85, []string{"c07", "c06"}},
		{0.5, []string{"c07", "c06", "c05", "c04"}},
	} {
		resp, err := admin.Evict(rpcCtx(t), &pb.EvictRequest{ToWatermark: tc.mark, DryRun: true})
		if err != nil {
			t.Fatal(err)
		}
		if got := evictKeys(resp); !slices.Equal(got, tc.want) {
			t.Fatalf("evict to %v picks %v, want %v", tc.mark, got, tc.want)
		}
	}
	// A put that needs room takes the leaf too.
	putObject(t, m, "x", 64*kib)
	want := append(slices.Clone(chain[:7]), "-c07")
	if got := present(t, m, chain...); !slices.Equal(got, want) {
		t.Fatalf("after a put into the full segment: %v, want %v", got, want)
	}
	if n := e.evictions(t, "allocation"); n != 1 {
		t.Fatalf("allocation evictions %v, want 1", n)
	}
	resp, err := m.master().List(rpcCtx(t), &pb.ListRequest{Prefix: "c01"})
	if err != nil || len(resp.Objects) != 1 || resp.Objects[0].Parent != "c00" {
		t.Fatalf("list c01 = %v, %v; want its parent c00", resp, err)
	}
}

// TestAdminEvictTenant: evict --tenant takes the tenant's objects and no
// other, hard pins excepted; the dry run lists exactly those.
func TestAdminEvictTenant(t *testing.T) {
	t.Parallel()
	e := newEvictEnv(t, func(cfg *Config) { cfg.HighWatermark = 1 })
	m, admin := e.m, e.admin()
	acme := []string{"a/0", "a/1", "a/2"}
	putBatch(t, m, sized(kib, &pb.PutStartRequest{Tenant: "acme"}, append(slices.Clone(acme), "a/pinned")...)...)
	putBatch(t, m, sized(kib, &pb.PutStartRequest{Tenant: "zeta"}, "z/0", "a/zeta")...)
	putBatch(t, m, sized(kib, nil, "n/0")...)
	pinKey(t, e, "a/pinned", true, 0)
	all := []string{"a/0", "a/1", "a/2", "a/pinned", "a/zeta", "n/0", "z/0"}
	e.waitEvictable(t)

	_, err := admin.Evict(rpcCtx(t), &pb.EvictRequest{Tenant: "acme", ToWatermark: 0.5})
	wantCode(t, err, codes.InvalidArgument, "evict --tenant with a watermark")
	for _, tc := range []struct {
		req  *pb.EvictRequest
		want []string
	}{
		{&pb.EvictRequest{Tenant: "nobody"}, nil},
		{&pb.EvictRequest{Tenant: "acme", Prefix: "a/1"}, []string{"a/1"}},
		{&pb.EvictRequest{Tenant: "zeta", Prefix: "a/"}, []string{"a/zeta"}},
		{&pb.EvictRequest{Tenant: "acme"}, acme},
	} {
		tc.req.DryRun = true
		resp, err := admin.Evict(rpcCtx(t), tc.req)
		if err != nil {
			t.Fatal(err)
		}
		if got := evictKeys(resp); !slices.Equal(got, tc.want) {
			t.Fatalf("dry run %v lists %v, want %v", tc.req, got, tc.want)
		}
	}
	if got := present(t, m, all...); !slices.Equal(got, all) {
		t.Fatalf("a dry run evicted: %v", got)
	}
	resp, err := admin.Evict(rpcCtx(t), &pb.EvictRequest{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	if got := evictKeys(resp); !slices.Equal(got, acme) || resp.Skipped != 1 || resp.Bytes != 3*kib {
		t.Fatalf("evict --tenant acme = %v (%d bytes, %d skipped)", got, resp.Bytes, resp.Skipped)
	}
	want := []string{"-a/0", "-a/1", "-a/2", "a/pinned", "a/zeta", "n/0", "z/0"}
	if got := present(t, m, all...); !slices.Equal(got, want) {
		t.Fatalf("after evict --tenant acme: %v, want %v", got, want)
	}
	list, err := m.master().List(rpcCtx(t), &pb.ListRequest{Prefix: "z/"})
	if err != nil || len(list.Objects) != 1 || list.Objects[0].Tenant != "zeta" {
		t.Fatalf("list z/ = %v, %v", list, err)
	}
}

// TestNoteReads: only reads served from SSD alone count towards promotion,
// and a negative PromoteAfter turns promotion off.
func TestNoteReads(t *testing.T) {
	ssdOnly := &pb.ObjectReplicas{Replicas: []*pb.Replica{{Tier: pb.Tier_TIER_SSD}}}
	dramFirst := &pb.ObjectReplicas{Replicas: []*pb.Replica{{Tier: pb.Tier_TIER_DRAM}, {Tier: pb.Tier_TIER_SSD}}}
	hbmOnly := &pb.ObjectReplicas{Replicas: []*pb.Replica{{Tier: pb.Tier_TIER_HBM}}}
	missing := &pb.ObjectReplicas{}
	for _, tc := range []struct {
		name  string
		after int
		reads []*pb.ObjectReplicas
		hot   bool
	}{
		{"ssd, twice", 2, []*pb.ObjectReplicas{ssdOnly, ssdOnly}, true},
		{"ssd, once", 2, []*pb.ObjectReplicas{ssdOnly}, false},
		{"ssd, once, threshold 1", 1, []*pb.ObjectReplicas{ssdOnly}, true},
		{"ssd, promotion off", -1, []*pb.ObjectReplicas{ssdOnly, ssdOnly, ssdOnly}, false},
		{"dram replica first", 2, []*pb.ObjectReplicas{dramFirst, dramFirst, dramFirst}, false},
		{"hbm only", 2, []*pb.ObjectReplicas{hbmOnly, hbmOnly, hbmOnly}, false},
		{"not found", 2, []*pb.ObjectReplicas{missing, missing}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := &Server{cfg: Config{PromoteAfter: tc.after}}
			s.mu.slowReads, s.mu.promote = map[string]int{}, map[string]bool{}
			for _, r := range tc.reads {
				s.noteReads([]string{"k"}, []*pb.ObjectReplicas{r})
			}
			if s.mu.promote["k"] != tc.hot {
				t.Fatalf("queued for promotion: %v, want %v", s.mu.promote["k"], tc.hot)
			}
		})
	}
}

// TestTieringWriteBackReclaim: above 0.80 of a DRAM segment its least
// recently used objects get an SSD copy ahead of need and keep their DRAM
// one; a put that then finds DRAM full reclaims such a replica in its own
// raft command and lands in DRAM instead of spilling to SSD.
func TestTieringWriteBackReclaim(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, nil)
	m := e.m
	startFakeStore(t, m, "s", reportOK, dram("a", segCap), ssd("b", 8*segCap))
	e.waitEvictable(t)
	keys := keyNames("k", 14) // 0.875 of DRAM: above the 0.80 mark, below 0.90
	putBatch(t, m, sized(64*kib, nil, keys...)...)
	waitFor(t, 10*time.Second, "the two coldest written back", func() error {
		got := placement(t, m, keys...)
		for i, k := range keys {
			want := []string{sDRAM}
			if i < 2 {
				want = []string{sDRAM, sSSD}
			}
			if !slices.Equal(got[k], want) {
				return fmt.Errorf("%s on %v, want %v", k, got[k], want)
			}
		}
		if n := copiesInFlight(m.srv.FSM()); n != 0 {
			return fmt.Errorf("%d copies in flight", n)
		}
		return nil
	})
	if n := e.count(t, "tidepool_master_copies_total", "reason", "writeback", "result", "ok"); n != 2 {
		t.Fatalf("write-backs %v, want 2", n)
	}

	// Room for two more; the third reclaims the coldest written-back replica.
	more := keyNames("m", 3)
	for i, r := range putBatch(t, m, sized(64*kib, nil, more...)...) {
		if len(r.Replicas) != 1 || r.Replicas[0].Segment != sDRAM {
			t.Fatalf("%s placed on %v, want DRAM", more[i], r.Replicas)
		}
	}
	if got := placement(t, m, keys[0])[keys[0]]; !slices.Equal(got, []string{sSSD}) {
		t.Fatalf("%s on %v after the reclaim, want its SSD copy only", keys[0], got)
	}
	if n := e.count(t, "tidepool_master_replica_drops_total", "reason", "reclaim"); n != 1 {
		t.Fatalf("reclaimed replicas %v, want 1", n)
	}
	if n := e.count(t, "tidepool_master_evictions_total"); n != 0 {
		t.Fatalf("%v evictions; write-back and reclaim should have made the room", n)
	}
}
