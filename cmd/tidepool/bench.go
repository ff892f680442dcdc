package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/tiers"
)

// benchRow is one line of `tidepool bench` output.
type benchRow struct {
	Op          string  `json:"op"`
	Size        int64   `json:"size"`
	Concurrency int     `json:"concurrency"`
	Ops         int     `json:"ops"`
	Errors      int     `json:"errors"`
	Bytes       int64   `json:"bytes"`
	Seconds     float64 `json:"seconds"`
	GBps        float64 `json:"gbps"`
	P50ms       float64 `json:"p50_ms"`
	P99ms       float64 `json:"p99_ms"`
}

func runBench(ctx context.Context, e *env, args []string) error {
	if len(args) > 0 && args[0] == "engine" {
		return runBenchEngine(ctx, e, args[1:])
	}
	if len(args) > 0 && args[0] == "lookup" {
		return runBenchLookup(ctx, e, args[1:])
	}
	if len(args) > 0 && args[0] == "meta" {
		return runBenchMeta(ctx, e, args[1:])
	}
	var ops, sizes listFlag
	var conc listFlag
	var duration time.Duration
	var asJSON bool
	var getKeys int
	ctx, c, _, done, err := clientCommand(ctx, e, time.Hour, "bench", "[flags]",
		"Measure put and get against a running cluster: one row per op, value size and concurrency,\nwith throughput in GB/s (10^9 bytes) and p50/p99 latency per request.",
		args, 0, 0, func(fs *flag.FlagSet, cfg *client.Config) {
			putFlags(fs, cfg)
			fs.Var(&ops, "ops", "operations to run: put, get (default put,get)")
			fs.Var(&sizes, "sizes", "value sizes (default 64KiB,1MiB,4MiB)")
			fs.Var(&conc, "concurrency", "concurrent requests per row (default 1,2,4,8)")
			fs.DurationVar(&duration, "duration", 3*time.Second, "how long each row runs")
			fs.IntVar(&getKeys, "get-keys", 16, "distinct keys per value size that get rows read")
			fs.BoolVar(&asJSON, "json", false, "print one JSON object per row instead of a table")
		})
	if err != nil {
		return err
	}
	defer done()
	if len(ops) == 0 {
		ops = listFlag{"put", "get"}
	}
	if len(sizes) == 0 {
		sizes = listFlag{"64KiB", "1MiB", "4MiB"}
	}
	if len(conc) == 0 {
		conc = listFlag{"1", "2", "4", "8"}
	}
	var sizeList []int64
	for _, s := range sizes {
		n, err := tiers.ParseSize(s)
		if err != nil {
			return fmt.Errorf("%w: --sizes: %v", errUsage, err)
		}
		sizeList = append(sizeList, n)
	}
	var concList []int
	for _, s := range conc {
		var n int
		if _, err := fmt.Sscanf(s, "%d", &n); err != nil || n < 1 || n > 1024 {
			return fmt.Errorf("%w: --concurrency %q: want 1 to 1024", errUsage, s)
		}
		concList = append(concList, n)
	}
	b := &bench{c: c, stderr: e.stderr, duration: duration, getKeys: getKeys, prefix: fmt.Sprintf("bench/%d/", time.Now().UnixNano())}
	defer b.cleanup()

	const rowFormat = "%-4s %9s %5v %7v %7v %7v %9v %9v\n"
	if !asJSON {
		fmt.Fprintf(e.stdout, rowFormat, "OP", "SIZE", "CONC", "OPS", "ERRORS", "GB/s", "P50 ms", "P99 ms")
	}
	for _, op := range ops {
		if op != "put" && op != "get" {
			return fmt.Errorf("%w: --ops %q: want put or get", errUsage, op)
		}
		for _, size := range sizeList {
			for _, n := range concList {
				if ctx.Err() != nil {
					return ctx.Err()
				}
				row, err := b.row(ctx, op, size, n)
				if err != nil {
					return err
				}
				if asJSON {
					line, _ := json.Marshal(row)
					fmt.Fprintln(e.stdout, string(line))
					continue
				}
				fmt.Fprintf(e.stdout, rowFormat, row.Op, human(uint64(row.Size)), row.Concurrency, row.Ops, row.Errors,
					fmt.Sprintf("%.2f", row.GBps), fmt.Sprintf("%.3f", row.P50ms), fmt.Sprintf("%.3f", row.P99ms))
			}
		}
	}
	return nil
}

type bench struct {
	c        *client.Client
	stderr   io.Writer
	duration time.Duration
	getKeys  int
	prefix   string
	seq      atomic.Int64
	mu       sync.Mutex
	keys     []string // every key written, removed at the end
}

// row runs one op at one size and concurrency for the bench's duration.
// Put rows also stop when they have written a quarter of the pool's free
// space, and remove what they wrote afterwards, untimed.
func (b *bench) row(ctx context.Context, op string, size int64, workers int) (benchRow, error) {
	value := make([]byte, size)
	if _, err := rand.Read(value); err != nil {
		return benchRow{}, err
	}
	var getKeys []string
	budget := int64(-1)
	if op == "get" {
		var err error
		if getKeys, err = b.populate(ctx, size, value); err != nil {
			return benchRow{}, err
		}
	} else {
		st, err := b.c.Status(ctx)
		if err != nil {
			return benchRow{}, err
		}
		for _, s := range st.Segments {
			budget += int64(s.Capacity-s.Used) / 4
		}
	}
	var written atomic.Int64
	var lat [][]time.Duration = make([][]time.Duration, workers)
	var errs atomic.Int64
	var firstErr error
	var errOnce sync.Once
	var putKeys [][]string = make([][]string, workers)
	stop := time.Now().Add(b.duration)
	start := time.Now()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, size)
			for i := 0; time.Now().Before(stop) && ctx.Err() == nil; i++ {
				if op == "put" && budget >= 0 && written.Load()+size > budget {
					return
				}
				t0 := time.Now()
				var err error
				if op == "put" {
					key := fmt.Sprintf("%sput/%d", b.prefix, b.seq.Add(1))
					err = b.c.Put(ctx, key, value)
					putKeys[w] = append(putKeys[w], key)
				} else {
					_, err = b.c.GetInto(ctx, getKeys[(w+i*workers)%len(getKeys)], buf)
				}
				if err != nil {
					errs.Add(1)
					errOnce.Do(func() { firstErr = err })
					continue
				}
				lat[w] = append(lat[w], time.Since(t0))
				written.Add(size)
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	for _, ks := range putKeys {
		left := b.remove(ctx, ks)
		b.mu.Lock()
		b.keys = append(b.keys, left...)
		b.mu.Unlock()
	}
	all := slices.Concat(lat...)
	slices.Sort(all)
	row := benchRow{
		Op: op, Size: size, Concurrency: workers, Ops: len(all), Errors: int(errs.Load()),
		Bytes: written.Load(), Seconds: elapsed.Seconds(),
		GBps:  float64(written.Load()) / 1e9 / elapsed.Seconds(),
		P50ms: ms(percentile(all, 0.50)), P99ms: ms(percentile(all, 0.99)),
	}
	if len(all) == 0 && firstErr != nil {
		return row, fmt.Errorf("every %s of %d bytes failed: %w", op, size, firstErr)
	}
	return row, nil
}

// populate writes the keys that get rows of this size read.
func (b *bench) populate(ctx context.Context, size int64, value []byte) ([]string, error) {
	keys := make([]string, b.getKeys)
	for i := range keys {
		keys[i] = fmt.Sprintf("%sget/%d/%d", b.prefix, size, i)
		if err := b.c.Put(ctx, keys[i], value); err != nil {
			return nil, fmt.Errorf("populate keys for get: %w", err)
		}
	}
	b.mu.Lock()
	b.keys = append(b.keys, keys...)
	b.mu.Unlock()
	return keys, nil
}

// remove deletes keys and returns those it could not, for cleanup.
func (b *bench) remove(ctx context.Context, keys []string) (left []string) {
	for _, k := range keys {
		if err := b.c.Remove(ctx, k); err != nil && !errors.Is(err, client.ErrNotFound) {
			left = append(left, k)
		}
	}
	return left
}

// cleanup removes every key the benchmark wrote that is still there.
func (b *bench) cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if left := b.remove(ctx, b.keys); len(left) > 0 {
		fmt.Fprintf(b.stderr, "tidepool bench: could not remove %d benchmark keys (prefix %s)\n", len(left), b.prefix)
	}
}

func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[min(len(sorted)-1, int(float64(len(sorted))*p))]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
