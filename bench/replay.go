package bench

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/tidepool-kv/tidepool/bench/trace"
	"github.com/tidepool-kv/tidepool/client"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// ReplayConfig is a replay of a trace against a running pool.
type ReplayConfig struct {
	// Client reaches the pool; the replay sets its tenant (one per
	// capacity) and turns its lookup cache off, so that every lookup
	// reaches the master and counts for recency as each request of an
	// engine that does not repeat itself within seconds would. Admin runs
	// Admin calls.
	Client client.Config
	Admin  func(ctx context.Context, call func(pb.AdminClient) error) error
	Trace  []trace.Request
	// Capacities are the pool sizes to replay at, in blocks: each is the
	// DRAM objects quota of a tenant of its own.
	Capacities []int
	// BlockBytes is the value of one 512-token block (scaled down so that
	// a pool on one machine holds the capacities).
	BlockBytes int
	// PrefillUsPerToken prices a token that missed, for the TTFT estimate.
	PrefillUsPerToken float64
	// Speed replays at that many times the trace's own pace (0: as fast
	// as the pool answers); Concurrency is how many requests may be in
	// flight (default 1: the pool sees the trace's order exactly, as the
	// simulations do).
	Speed       float64
	Concurrency int
	// Run names this replay's keys and tenants (default the start time).
	Run string
	// Progress, if set, hears of each request replayed.
	Progress func(capacity, done, total int)
}

// ReplayRow is one capacity's figures: the pool's hits next to LRU's and
// Belady's on the same trace and capacity, and what the pool's requests
// took.
type ReplayRow struct {
	Capacity int          `json:"capacity_blocks"`
	Pool     trace.Result `json:"tidepool"`
	LRU      trace.Result `json:"lru"`
	Belady   trace.Result `json:"belady"`
	// TTFT is the estimate per request: its lookup and the fetch of its
	// hit blocks, measured, plus PrefillUsPerToken for each missed token.
	TTFTp50ms, TTFTp99ms     float64
	Lookupp50ms, Lookupp99ms float64
	Getp50ms, Getp99ms       float64
	Putp50ms, Putp99ms       float64
	Errors                   int
	FirstError               string `json:",omitempty"`
}

// failed counts a request's error, keeping the first.
func (r *ReplayRow) failed(err error) {
	if r.Errors++; r.FirstError == "" {
		r.FirstError = err.Error()
	}
}

// Replay replays cfg.Trace once per capacity (see replayer.request).
// After each capacity the tenant's objects are evicted.
func Replay(ctx context.Context, cfg ReplayConfig, row func(ReplayRow)) ([]ReplayRow, error) {
	if cfg.BlockBytes <= 0 || len(cfg.Client.Masters) == 0 || cfg.Admin == nil {
		return nil, errors.New("bench: a replay needs a pool, an admin and a block size")
	}
	if cfg.Run == "" {
		cfg.Run = strconv.FormatInt(time.Now().UnixNano(), 36)
	}
	var rows []ReplayRow
	for _, capacity := range cfg.Capacities {
		if capacity <= 0 {
			return rows, fmt.Errorf("bench: capacity %d blocks", capacity)
		}
		r, err := replayAt(ctx, cfg, capacity)
		if err != nil {
			return rows, err
		}
		r.LRU, r.Belady = trace.LRU(cfg.Trace, capacity), trace.Belady(cfg.Trace, capacity)
		rows = append(rows, r)
		if row != nil {
			row(r)
		}
	}
	return rows, nil
}

func replayAt(ctx context.Context, cfg ReplayConfig, capacity int) (ReplayRow, error) {
	row := ReplayRow{Capacity: capacity}
	tenant := fmt.Sprintf("replay-%s-%d", cfg.Run, capacity)
	quota := &pb.TenantQuota{Tenant: tenant, Tier: pb.Tier_TIER_DRAM, Objects: uint64(capacity)}
	if err := cfg.Admin(ctx, func(a pb.AdminClient) error { _, err := a.SetQuota(ctx, quota); return err }); err != nil {
		return row, fmt.Errorf("bench: set the replay's quota: %w", err)
	}
	defer func() {
		// Leave nothing behind: the tenant's objects, then its quota.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		_ = cfg.Admin(cctx, func(a pb.AdminClient) error {
			_, err := a.Evict(cctx, &pb.EvictRequest{Tenant: tenant})
			return err
		})
		_ = cfg.Admin(cctx, func(a pb.AdminClient) error {
			_, err := a.SetQuota(cctx, &pb.TenantQuota{Tenant: tenant, Tier: pb.Tier_TIER_DRAM})
			return err
		})
	}()
	cc := cfg.Client
	cc.Tenant, cc.LookupCache = tenant, -1
	c, err := client.New(cc)
	if err != nil {
		return row, err
	}
	defer c.Close()
	r := &replayer{cfg: cfg, c: c, capacity: capacity, row: &row,
		prefix: "replay/" + cfg.Run + "/" + strconv.Itoa(capacity) + "/"}
	if err := r.run(ctx); err != nil {
		return row, err
	}
	row.TTFTp50ms, row.TTFTp99ms = pct(r.ttft, 50), pct(r.ttft, 99)
	row.Lookupp50ms, row.Lookupp99ms = pct(r.lookups, 50), pct(r.lookups, 99)
	row.Getp50ms, row.Getp99ms = pct(r.gets, 50), pct(r.gets, 99)
	row.Putp50ms, row.Putp99ms = pct(r.puts, 50), pct(r.puts, 99)
	return row, nil
}

// replayer replays the trace at one capacity.
type replayer struct {
	cfg      ReplayConfig
	c        *client.Client
	capacity int
	prefix   string

	mu                        sync.Mutex // guards the rest
	row                       *ReplayRow
	done                      int
	ttft, lookups, gets, puts []time.Duration
}

// run replays the requests in timestamp order, cfg.Concurrency at a time,
// each no earlier than its time in the trace over cfg.Speed.
func (r *replayer) run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	next := make(chan trace.Request)
	var wg sync.WaitGroup
	for range max(r.cfg.Concurrency, 1) {
		wg.Go(func() {
			for req := range next {
				r.request(ctx, req)
			}
		})
	}
	start := time.Now()
	var err error
	for _, req := range r.cfg.Trace {
		if r.cfg.Speed > 0 {
			at := start.Add(time.Duration(float64(req.Timestamp-r.cfg.Trace[0].Timestamp) * float64(time.Millisecond) / r.cfg.Speed))
			if err = sleepUntil(ctx, at); err != nil {
				break
			}
		}
		select {
		case next <- req:
			continue
		case <-ctx.Done():
			err = ctx.Err()
		}
		break
	}
	close(next)
	wg.Wait()
	return err
}

func sleepUntil(ctx context.Context, at time.Time) error {
	d := time.Until(at)
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// request replays one request: a lookup of its chain, gets of the matched
// blocks, a chain put of the rest. A block counts as hit only if its get
// succeeded, as for an engine.
func (r *replayer) request(ctx context.Context, req trace.Request) {
	keys := make([]string, len(req.HashIDs))
	for j, id := range req.HashIDs {
		keys[j] = r.prefix + strconv.FormatInt(id, 10)
	}
	start := time.Now()
	m, err := r.c.Lookup(ctx, keys)
	lookup := time.Since(start)
	if err != nil {
		// A request counts even so, as a miss: the simulations count it.
		r.record(func() { r.lookups = append(r.lookups, lookup); r.row.Pool.Add(req, 0); r.row.failed(err) })
		return
	}
	hit := 0
	var get time.Duration
	if n := m.Len(); n > 0 {
		bufs := make([][]byte, n)
		for j := range bufs {
			bufs[j] = make([]byte, r.cfg.BlockBytes)
		}
		t0 := time.Now()
		_, errs := r.c.GetMatched(ctx, m, bufs)
		get = time.Since(t0)
		for hit < n && errs[hit] == nil {
			hit++
		}
	}
	fetch := time.Since(start)
	missed := req.InputLength - req.Tokens(hit)
	ttft := fetch + time.Duration(r.cfg.PrefillUsPerToken*float64(missed)*float64(time.Microsecond))
	var put time.Duration
	var putErr error
	// Of a chain longer than the pool, only a prefix fits (as in the
	// simulations); the rest would be refused by the quota.
	if keys = keys[:min(len(keys), r.capacity)]; hit < len(keys) {
		parent := ""
		if hit > 0 {
			parent = keys[hit-1]
		}
		values := make([][]byte, len(keys)-hit)
		for j := range values {
			values[j] = blockValue(req.HashIDs[hit+j], r.cfg.BlockBytes)
		}
		t0 := time.Now()
		for _, err := range r.c.BatchPutChain(ctx, parent, keys[hit:], values) {
			// Another request in flight putting the same block is no
			// failure: an engine would leave it to that one.
			if err != nil && !errors.Is(err, client.ErrConflict) {
				putErr = err
				break
			}
		}
		put = time.Since(t0)
	}
	r.record(func() {
		r.row.Pool.Add(req, hit)
		r.lookups, r.ttft = append(r.lookups, lookup), append(r.ttft, ttft)
		if m.Len() > 0 {
			r.gets = append(r.gets, get)
		}
		if put > 0 {
			r.puts = append(r.puts, put)
		}
		if putErr != nil {
			r.row.failed(putErr)
		}
	})
}

// record updates the figures and reports progress, under the lock, so
// progress is heard one call at a time and in order.
func (r *replayer) record(update func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	update()
	r.done++
	if r.cfg.Progress != nil {
		r.cfg.Progress(r.capacity, r.done, len(r.cfg.Trace))
	}
}

// blockValue is a block's bytes: its id, repeated, so a get that read the
// wrong block would be caught by its checksum and by a reader that looks.
func blockValue(id int64, n int) []byte {
	b := make([]byte, n)
	var w [8]byte
	binary.LittleEndian.PutUint64(w[:], uint64(id))
	for i := 0; i < n; i += 8 {
		copy(b[i:], w[:])
	}
	return b
}

// pct is the p-th percentile of ds in ms (0 for none).
func pct(ds []time.Duration, p int) float64 {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return float64(s[min(len(s)-1, len(s)*p/100)]) / float64(time.Millisecond)
}
