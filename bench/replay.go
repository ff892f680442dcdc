package bench

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strconv"
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

// Replay replays cfg.Trace once per capacity, one request at a time: a
// lookup of its chain, gets of the matched blocks, a chain put of the
// rest. A block counts as hit only if its get succeeded, as for an
// engine. After each capacity the tenant's objects are evicted.
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
	prefix := "replay/" + cfg.Run + "/" + strconv.Itoa(capacity) + "/"
	var ttft, lookups, gets, puts []time.Duration
	bufs := make([][]byte, 0, 64)
	for i, req := range cfg.Trace {
		if err := ctx.Err(); err != nil {
			return row, err
		}
		keys := make([]string, len(req.HashIDs))
		for j, id := range req.HashIDs {
			keys[j] = prefix + strconv.FormatInt(id, 10)
		}
		start := time.Now()
		m, err := c.Lookup(ctx, keys)
		lookups = append(lookups, time.Since(start))
		if err != nil {
			row.failed(err)
			continue
		}
		hit := 0
		if n := m.Len(); n > 0 {
			bufs = bufs[:0]
			for range n {
				bufs = append(bufs, make([]byte, cfg.BlockBytes))
			}
			t0 := time.Now()
			_, errs := c.GetMatched(ctx, m, bufs)
			gets = append(gets, time.Since(t0))
			for hit < n && errs[hit] == nil {
				hit++
			}
		}
		fetch := time.Since(start)
		row.Pool.Add(req, hit)
		missed := req.InputLength - req.Tokens(hit)
		ttft = append(ttft, fetch+time.Duration(cfg.PrefillUsPerToken*float64(missed)*float64(time.Microsecond)))
		// Of a chain longer than the pool, only a prefix fits (as in the
		// simulations); the rest would be refused by the quota.
		if keys = keys[:min(len(keys), capacity)]; hit < len(keys) {
			parent := ""
			if hit > 0 {
				parent = keys[hit-1]
			}
			values := make([][]byte, len(keys)-hit)
			for j := range values {
				values[j] = blockValue(req.HashIDs[hit+j], cfg.BlockBytes)
			}
			t0 := time.Now()
			errs := c.BatchPutChain(ctx, parent, keys[hit:], values)
			puts = append(puts, time.Since(t0))
			if err := errors.Join(errs...); err != nil {
				row.failed(err)
			}
		}
		if cfg.Progress != nil {
			cfg.Progress(capacity, i+1, len(cfg.Trace))
		}
	}
	row.TTFTp50ms, row.TTFTp99ms = pct(ttft, 50), pct(ttft, 99)
	row.Lookupp50ms, row.Lookupp99ms = pct(lookups, 50), pct(lookups, 99)
	row.Getp50ms, row.Getp99ms = pct(gets, 50), pct(gets, 99)
	row.Putp50ms, row.Putp99ms = pct(puts, 50), pct(puts, 99)
	return row, nil
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
