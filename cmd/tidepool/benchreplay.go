package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"

	measure "github.com/tidepool-kv/tidepool/bench"
	"github.com/tidepool-kv/tidepool/bench/trace"
	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
	"github.com/tidepool-kv/tidepool/tiers"
)

// runBenchReplay is `tidepool bench replay`.
func runBenchReplay(ctx context.Context, e *env, args []string) error {
	var file, capacities, blockSize string
	var requests int
	var prefill, speed float64
	var concurrency int
	var asJSON bool
	var cfgp *client.Config
	ctx, _, _, done, err := clientCommand(ctx, e, 24*time.Hour, "bench replay", "--trace FILE [flags]",
		`Replay a request trace in Mooncake's format (JSON lines: timestamp, input_length, output_length,
hash_ids of 512-token blocks) against the pool, as fast as it answers or at --speed times the trace's
pace, --concurrency requests at a time: a lookup of its chain, gets of the matched blocks, a chain
put of the rest. Each capacity is a tenant of its own under a DRAM
quota of that many blocks; the tenant's objects are evicted afterwards. Prints, per capacity, the
pool's block and token hit rates next to an LRU and a Belady simulation of the same trace and
capacity, a TTFT estimate and the latencies. It sets quotas: in a secure pool, give an admin's token.`,
		args, 0, 0, func(fs *flag.FlagSet, cfg *client.Config) {
			fs.StringVar(&file, "trace", "", "the trace, gzipped if it ends in .gz (bench/trace/testdata holds some)")
			fs.IntVar(&requests, "requests", 0, "replay only the first N requests (0: all)")
			fs.StringVar(&capacities, "capacity", "2%,10%,50%", "pool sizes: blocks, or percentages of the trace's distinct blocks")
			fs.StringVar(&blockSize, "block-bytes", "16KiB", "value of one 512-token block (scaled down from a model's)")
			fs.Float64Var(&prefill, "prefill-us-per-token", 50, "prefill time of a missed token, for the TTFT estimate")
			fs.Float64Var(&speed, "speed", 0, "replay at this many times the trace's pace (0: as fast as the pool answers)")
			fs.IntVar(&concurrency, "concurrency", 1, "requests in flight at once (1: the trace's exact order, as the simulations)")
			fs.BoolVar(&asJSON, "json", false, "print one JSON object per capacity instead of a table")
			cfgp = cfg
		})
	if err != nil {
		return err
	}
	defer done()
	if file == "" {
		return fmt.Errorf("%w: --trace is required", errUsage)
	}
	reqs, err := trace.ReadFile(file, requests)
	if err != nil {
		return err
	}
	bb, err := tiers.ParseSize(blockSize)
	if err != nil || bb <= 0 || bb > 64<<20 {
		return fmt.Errorf("%w: --block-bytes %q: want 1 B to 64 MiB", errUsage, blockSize)
	}
	if !(speed >= 0) || math.IsInf(speed, 0) || concurrency < 1 || concurrency > 1024 {
		return fmt.Errorf("%w: --speed %g, --concurrency %d: want a speed of 0 or more and 1 to 1024 requests", errUsage, speed, concurrency)
	}
	distinct := trace.Distinct(reqs)
	caps, err := parseCapacities(capacities, distinct)
	if err != nil {
		return err
	}
	conn, err := leaderconn.Dial(cfgp.Masters, cfgp.Credentials)
	if err != nil {
		return err
	}
	defer conn.Close()
	fmt.Fprintf(e.stderr, "bench replay: %d requests, %d distinct blocks of %d bytes, capacities %v blocks\n", len(reqs), distinct, bb, caps)
	cfg := measure.ReplayConfig{
		Client: *cfgp,
		Admin: func(ctx context.Context, call func(pb.AdminClient) error) error {
			return conn.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, _ ...grpc.CallOption) error {
				return call(pb.NewAdminClient(cc))
			})
		},
		Trace: reqs, Capacities: caps, BlockBytes: int(bb), PrefillUsPerToken: prefill, Speed: speed, Concurrency: concurrency,
		Progress: func(capacity, n, total int) {
			if n%max(total/10, 1) == 0 {
				fmt.Fprintf(e.stderr, "bench replay: capacity %d: %d of %d requests\n", capacity, n, total)
			}
		},
	}
	const rowFormat = "%9s %8s %8s %8s %8s %8s %8s %9s %9s %9s %7s\n"
	if !asJSON {
		fmt.Fprintf(e.stdout, rowFormat, "CAPACITY", "POOL", "LRU", "BELADY", "POOL tok", "LRU tok", "BEL tok", "TTFT p50", "TTFT p99", "GET p99", "ERRORS")
	}
	_, err = measure.Replay(ctx, cfg, func(r measure.ReplayRow) {
		if asJSON {
			line, _ := json.Marshal(r)
			fmt.Fprintln(e.stdout, string(line))
			return
		}
		p := func(f float64) string { return fmt.Sprintf("%.1f%%", 100*f) }
		ms := func(f float64) string { return fmt.Sprintf("%.2fms", f) }
		fmt.Fprintf(e.stdout, rowFormat, strconv.Itoa(r.Capacity), p(r.Pool.BlockHitRate()), p(r.LRU.BlockHitRate()), p(r.Belady.BlockHitRate()),
			p(r.Pool.TokenHitRate()), p(r.LRU.TokenHitRate()), p(r.Belady.TokenHitRate()), ms(r.TTFTp50ms), ms(r.TTFTp99ms), ms(r.Getp99ms), strconv.Itoa(r.Errors))
	})
	return err
}

// parseCapacities reads "2%,1000": percentages of distinct blocks, or
// blocks.
func parseCapacities(s string, distinct int) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if pct, ok := strings.CutSuffix(f, "%"); ok {
			v, err := strconv.ParseFloat(pct, 64)
			if err != nil || v <= 0 || v > 100 {
				return nil, fmt.Errorf("%w: --capacity %q: want a percentage in (0, 100]", errUsage, f)
			}
			out = append(out, max(1, int(v*float64(distinct)/100)))
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("%w: --capacity %q: want blocks or a percentage", errUsage, f)
		}
		out = append(out, n)
	}
	return out, nil
}
