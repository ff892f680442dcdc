package bench

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/tidepool-kv/tidepool/master/leaderconn"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// MetaConfig says what Meta measures.
type MetaConfig struct {
	// Masters are the cluster's master addresses, and Credentials what
	// each client shows them.
	Masters     []string
	Credentials leaderconn.Credentials
	// Ops are "put", "get" and "exists" (default all three).
	Ops []string
	// Batches are the keys per call (default 1, 128, 1024).
	Batches []int
	// Clients are the concurrent callers per row, each with its own
	// connection (default 1, 2, 4).
	Clients []int
	// Duration is how long each row runs (default 3 s).
	Duration time.Duration
	// Prefix starts every key Meta writes; it removes them all when done.
	Prefix string
}

// MetaRow is one row: an op at a batch size and client count.
type MetaRow struct {
	Op        string  `json:"op"`
	Batch     int     `json:"batch"`
	Clients   int     `json:"clients"`
	Calls     int     `json:"calls"`
	Errors    int     `json:"errors"`
	KeysPerS  float64 `json:"keys_per_s"`
	MeanMs    float64 `json:"mean_ms"`
	P99Ms     float64 `json:"p99_ms"`
	Seconds   float64 `json:"seconds"`
	FirstFail string  `json:"first_error,omitempty"`
}

// metaValue is the size every put declares: tiny, as in master_bench; no
// bytes are written.
const metaValue = 64

// Meta runs every row of cfg and returns them, in order; row(r) (if not
// nil) sees each as it ends. Keys it put are removed before it returns.
func Meta(ctx context.Context, cfg MetaConfig, row func(MetaRow)) ([]MetaRow, error) {
	if len(cfg.Ops) == 0 {
		cfg.Ops = []string{"put", "get", "exists"}
	}
	if len(cfg.Batches) == 0 {
		cfg.Batches = []int{1, 128, 1024}
	}
	if len(cfg.Clients) == 0 {
		cfg.Clients = []int{1, 2, 4}
	}
	if cfg.Duration <= 0 {
		cfg.Duration = 3 * time.Second
	}
	if cfg.Prefix == "" {
		cfg.Prefix = fmt.Sprintf("bench-meta/%d/", time.Now().UnixNano())
	}
	for _, op := range cfg.Ops {
		if op != "put" && op != "get" && op != "exists" {
			return nil, fmt.Errorf("bench meta: unknown op %q (want put, get, exists)", op)
		}
	}
	conns := make([]*leaderconn.Conn, slices.Max(cfg.Clients))
	for i := range conns {
		c, err := leaderconn.Dial(cfg.Masters, cfg.Credentials)
		if err != nil {
			closeAll(conns)
			return nil, fmt.Errorf("bench meta: %w", err)
		}
		conns[i] = c
	}
	defer closeAll(conns)
	m := &meta{cfg: cfg, conns: conns}
	defer m.cleanup()

	var rows []MetaRow
	for _, op := range cfg.Ops {
		for _, batch := range cfg.Batches {
			if op != "put" {
				// Gets and exists ask about keys that are there: one batch.
				if err := m.seed(ctx, batch); err != nil {
					return rows, err
				}
			}
			for _, clients := range cfg.Clients {
				r := m.row(ctx, op, batch, clients)
				if op == "put" {
					m.cleanup() // untimed: the master's table does not grow row by row
				}
				if err := ctx.Err(); err != nil {
					return rows, err
				}
				rows = append(rows, r)
				if row != nil {
					row(r)
				}
			}
		}
	}
	return rows, nil
}

func closeAll(conns []*leaderconn.Conn) {
	for _, c := range conns {
		if c != nil {
			c.Close()
		}
	}
}

type meta struct {
	cfg    MetaConfig
	conns  []*leaderconn.Conn
	seeded []string // keys gets and exists ask about

	mu struct {
		sync.Mutex
		put []string // keys to remove at the end
		seq int
	}
}

// keys returns n new keys: the prefix and a sequence number of at least
// nine digits. They share one string, so a batch's keys cost the client
// two allocations, not one each: the benchmark measures the master.
func (m *meta) keys(n int) []string {
	m.mu.Lock()
	first := m.mu.seq
	m.mu.seq += n
	m.mu.Unlock()
	buf := make([]byte, 0, n*(len(m.cfg.Prefix)+12))
	ends := make([]int, n)
	for i := range n {
		buf = append(buf, m.cfg.Prefix...)
		seq := first + i
		for p := uint64(100_000_000); p > 1 && uint64(seq) < p; p /= 10 {
			buf = append(buf, '0')
		}
		buf = strconv.AppendInt(buf, int64(seq), 10)
		ends[i] = len(buf)
	}
	all := string(buf)
	out := make([]string, n)
	for i, start := 0, 0; i < n; i++ {
		out[i], start = all[start:ends[i]], ends[i]
	}
	m.mu.Lock()
	m.mu.put = append(m.mu.put, out...)
	m.mu.Unlock()
	return out
}

func (m *meta) seed(ctx context.Context, n int) error {
	if len(m.seeded) >= n {
		return nil
	}
	keys := m.keys(n - len(m.seeded))
	for i := 0; i < len(keys); i += 1024 {
		if err := fillBatch(ctx, m.conns[0], keys[i:min(i+1024, len(keys))], metaValue); err != nil {
			return fmt.Errorf("bench meta: seed keys: %w", err)
		}
	}
	m.seeded = append(m.seeded, keys...)
	return nil
}

// row runs op with clients callers for the configured duration.
func (m *meta) row(ctx context.Context, op string, batch, clients int) MetaRow {
	type result struct {
		lat   []time.Duration
		errs  int
		first error
	}
	results := make([]result, clients)
	deadline := time.Now().Add(m.cfg.Duration)
	start := time.Now()
	var wg sync.WaitGroup
	for w := range clients {
		wg.Go(func() {
			r := &results[w]
			c := m.conns[w]
			for time.Now().Before(deadline) && ctx.Err() == nil {
				var keys []string
				if op == "put" {
					keys = m.keys(batch)
				} else {
					keys = m.seeded[:batch]
				}
				t := time.Now()
				err := m.call(ctx, c, op, keys)
				r.lat = append(r.lat, time.Since(t))
				if err != nil {
					r.errs++
					if r.first == nil {
						r.first = err
					}
				}
			}
		})
	}
	wg.Wait()
	secs := time.Since(start).Seconds()
	var lat []time.Duration
	out := MetaRow{Op: op, Batch: batch, Clients: clients, Seconds: secs}
	for _, r := range results {
		lat = append(lat, r.lat...)
		out.Errors += r.errs
		if r.first != nil && out.FirstFail == "" {
			out.FirstFail = r.first.Error()
		}
	}
	out.Calls = len(lat)
	if out.Calls == 0 {
		return out
	}
	slices.Sort(lat)
	var sum time.Duration
	for _, d := range lat {
		sum += d
	}
	out.KeysPerS = float64((out.Calls-out.Errors)*batch) / secs
	out.MeanMs = float64(sum) / float64(out.Calls) / 1e6
	out.P99Ms = float64(lat[min(len(lat)-1, len(lat)*99/100)]) / 1e6
	return out
}

func (m *meta) call(ctx context.Context, c *leaderconn.Conn, op string, keys []string) error {
	req := &pb.KeysRequest{Keys: keys}
	switch op {
	case "put":
		return fillBatch(ctx, c, keys, metaValue)
	case "get":
		return do(ctx, c, func(mc pb.MasterClient, o ...grpc.CallOption) error {
			resp, err := mc.GetReplicas(ctx, req, o...)
			if err == nil {
				for _, r := range resp.Results {
					if err = itemError(r.Status); err != nil {
						break
					}
				}
			}
			return err
		})
	default:
		return do(ctx, c, func(mc pb.MasterClient, o ...grpc.CallOption) error {
			resp, err := mc.Exists(ctx, req, o...)
			if err == nil && slices.Contains(resp.Exists, false) {
				err = errors.New("exists: a seeded key is absent")
			}
			return err
		})
	}
}

// cleanup removes every key put so far (seeded keys included: they are
// seeded again when needed).
func (m *meta) cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	m.mu.Lock()
	keys := m.mu.put
	m.mu.put = nil
	m.mu.Unlock()
	m.seeded = nil
	for i := 0; i < len(keys); i += 16384 {
		part := keys[i:min(i+16384, len(keys))]
		_ = do(ctx, m.conns[0], func(mc pb.MasterClient, o ...grpc.CallOption) error {
			_, err := mc.Remove(ctx, &pb.KeysRequest{Keys: part}, o...)
			return err
		})
	}
}

func do(ctx context.Context, c *leaderconn.Conn, fn func(pb.MasterClient, ...grpc.CallOption) error) error {
	return c.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) error {
		return fn(pb.NewMasterClient(cc), opts...)
	})
}

func itemError(st *pb.ItemStatus) error {
	if st.GetCode() == 0 {
		return nil
	}
	return fmt.Errorf("code %d: %s", st.GetCode(), st.GetMessage())
}

func firstItemError(sts []*pb.ItemStatus) error {
	for _, st := range sts {
		if err := itemError(st); err != nil {
			return err
		}
	}
	return nil
}
