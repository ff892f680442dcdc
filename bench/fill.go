package bench

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc"

	"github.com/tidepool-kv/tidepool/master/leaderconn"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// FillConfig says what Fill puts.
type FillConfig struct {
	Masters     []string
	Credentials leaderconn.Credentials
	// Count objects, Batch a call (default 4096), with keys of KeyBytes
	// (default 30) and values of ValueBytes (default 64), under Prefix.
	Count, Batch, KeyBytes, ValueBytes int
	Prefix                             string
	// Progress (if not nil) sees the count put so far after each call.
	Progress func(done int)
}

// Fill puts cfg.Count objects through the master alone (BatchPutStart and
// BatchPutEnd, no bytes written: the values' space holds whatever it held)
// and leaves them there, to measure what the master's table costs. It
// returns how long the puts took.
func Fill(ctx context.Context, cfg FillConfig) (time.Duration, error) {
	if cfg.Batch <= 0 {
		cfg.Batch = 4096
	}
	if cfg.KeyBytes <= 0 {
		cfg.KeyBytes = 30
	}
	if cfg.ValueBytes <= 0 {
		cfg.ValueBytes = 64
	}
	if cfg.Prefix == "" {
		cfg.Prefix = fmt.Sprintf("fill/%d/", time.Now().Unix())
	}
	if len(cfg.Prefix)+9 > cfg.KeyBytes {
		return 0, fmt.Errorf("bench fill: keys of %d bytes cannot hold the prefix %q and a 9-digit count", cfg.KeyBytes, cfg.Prefix)
	}
	c, err := leaderconn.Dial(cfg.Masters, cfg.Credentials)
	if err != nil {
		return 0, fmt.Errorf("bench fill: %w", err)
	}
	defer c.Close()
	width := cfg.KeyBytes - len(cfg.Prefix)
	start := time.Now()
	for done := 0; done < cfg.Count; {
		n := min(cfg.Batch, cfg.Count-done)
		keys := make([]string, n)
		for i := range keys {
			keys[i] = fmt.Sprintf("%s%0*d", cfg.Prefix, width, done+i)
		}
		if err := fillBatch(ctx, c, keys, uint64(cfg.ValueBytes)); err != nil {
			return time.Since(start), fmt.Errorf("bench fill: after %d objects: %w", done, err)
		}
		done += n
		if cfg.Progress != nil {
			cfg.Progress(done)
		}
	}
	return time.Since(start), nil
}

// fillBatch starts and ends the keys' puts, as BatchPut does minus the
// bytes.
func fillBatch(ctx context.Context, c *leaderconn.Conn, keys []string, size uint64) error {
	// One allocation for the batch's items rather than one per key, as
	// the client does.
	starts := make([]pb.PutStartRequest, len(keys))
	req := &pb.BatchPutStartRequest{Items: make([]*pb.PutStartRequest, len(keys))}
	for i, k := range keys {
		r := &starts[i]
		r.Key, r.Size, r.Tier = k, size, pb.Tier_TIER_DRAM
		req.Items[i] = r
	}
	var start *pb.BatchPutStartResponse
	if err := do(ctx, c, func(mc pb.MasterClient, o ...grpc.CallOption) (err error) {
		start, err = mc.BatchPutStart(ctx, req, o...)
		return err
	}); err != nil {
		return err
	}
	// The ends as the client sends them: without the replicas, which the
	// leader that placed the puts knows, and asking for the failed items'
	// statuses only.
	ends := make([]pb.PutEndItem, len(keys))
	end := &pb.BatchPutEndRequest{SparseResults: true, Items: make([]*pb.PutEndItem, 0, len(keys))}
	for i, r := range start.Results {
		if r.Status.GetCode() != 0 {
			return fmt.Errorf("put start %q: %s", keys[i], r.Status.GetMessage())
		}
		if !r.Exists {
			e := &ends[i]
			e.Key, e.PutId, e.Size = keys[i], r.PutId, size
			end.Items = append(end.Items, e)
		}
	}
	if len(end.Items) == 0 {
		return nil
	}
	return do(ctx, c, func(mc pb.MasterClient, o ...grpc.CallOption) error {
		resp, err := mc.BatchPutEnd(ctx, end, o...)
		if err == nil {
			err = firstItemError(resp.Results)
		}
		if err == nil && len(resp.Unplaced) > 0 {
			err = errors.New("the leader changed during the fill")
		}
		return err
	})
}
