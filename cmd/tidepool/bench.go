package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/tiers"
)

// benchRow is one line of `tidepool bench` output.
type benchRow struct {
	Op          string  `json:"op"`
	Size        int64   `json:"size"`
	Batch       int     `json:"batch"`
	Concurrency int     `json:"concurrency"`
	Ops         int     `json:"ops"` // calls; each moves Batch values
	KeysPerS    float64 `json:"keys_per_s"`
	Errors      int     `json:"errors"`
	Bytes       int64   `json:"bytes"`
	Seconds     float64 `json:"seconds"`
	GBps        float64 `json:"gbps"`
	P50ms       float64 `json:"p50_ms"`
	P99ms       float64 `json:"p99_ms"`
	// The row's same-host SSD ops by path (see engine.FileIO), if any.
	FileIO *engine.FileIO `json:"file_io,omitempty"`
}

func profileFlag(fs *flag.FlagSet, path *string) {
	fs.StringVar(path, "cpuprofile", "", "write a CPU profile of this client to the file, for go tool pprof")
}

// startProfile starts a CPU profile into path, if one is named, and
// returns what stops it.
func startProfile(path string) (stop func(), err error) {
	if path == "" {
		return func() {}, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
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
	if len(args) > 0 && args[0] == "fill" {
		return runBenchFill(ctx, e, args[1:])
	}
	if len(args) > 0 && args[0] == "replay" {
		return runBenchReplay(ctx, e, args[1:])
	}
	var ops, sizes listFlag
	var conc, batches listFlag
	var duration time.Duration
	var asJSON bool
	var cpuProfile string
	var getKeys int
	ctx, c, _, done, err := clientCommand(ctx, e, time.Hour, "bench", "[flags]",
		"Measure put, get and exists against a running cluster: one row per op, value size, batch and\nconcurrency, with keys/s, throughput in GB/s (10^9 bytes) and p50/p99 latency per call. With\n--batch N a call is BatchPut, BatchGet or an exists check (Present) of N keys.",
		args, 0, 0, func(fs *flag.FlagSet, cfg *client.Config) {
			putFlags(fs, cfg)
			fs.Var(&ops, "ops", "operations to run: put, get, exists (default put,get)")
			fs.Var(&batches, "batch", "keys per call (default 1)")
			fs.Var(&sizes, "sizes", "value sizes (default 64KiB,1MiB,4MiB)")
			fs.Var(&conc, "concurrency", "concurrent requests per row (default 1,2,4,8)")
			fs.DurationVar(&duration, "duration", 3*time.Second, "how long each row runs")
			fs.IntVar(&getKeys, "get-keys", 16, "distinct keys per value size that get rows read")
			fs.BoolVar(&asJSON, "json", false, "print one JSON object per row instead of a table")
			profileFlag(fs, &cpuProfile)
		})
	if err != nil {
		return err
	}
	defer done()
	stop, err := startProfile(cpuProfile)
	if err != nil {
		return err
	}
	defer stop()
	if len(ops) == 0 {
		ops = listFlag{"put", "get"}
	}
	if len(sizes) == 0 {
		sizes = listFlag{"64KiB", "1MiB", "4MiB"}
	}
	if len(conc) == 0 {
		conc = listFlag{"1", "2", "4", "8"}
	}
	if len(batches) == 0 {
		batches = listFlag{"1"}
	}
	var batchList []int
	for _, s := range batches {
		var n int
		if _, err := fmt.Sscanf(s, "%d", &n); err != nil || n < 1 || n > 4096 {
			return fmt.Errorf("%w: --batch %q: want 1 to 4096", errUsage, s)
		}
		batchList = append(batchList, n)
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
	b := &bench{c: c, stderr: e.stderr, progress: e.stderr, duration: duration, getKeys: getKeys, prefix: fmt.Sprintf("bench/%d/", time.Now().UnixNano())}
	if asJSON {
		b.progress = io.Discard // for scripts: stderr only for errors
	}
	defer b.cleanup()

	if err := b.warm(ctx); err != nil {
		return err
	}
	const rowFormat = "%-6s %9s %5v %5v %7v %7v %10v %7v %9v %9v\n"
	if !asJSON {
		fmt.Fprintf(e.stdout, rowFormat, "OP", "SIZE", "BATCH", "CONC", "CALLS", "ERRORS", "KEYS/s", "GB/s", "P50 ms", "P99 ms")
	}
	for _, op := range ops {
		if op != "put" && op != "get" && op != "exists" {
			return fmt.Errorf("%w: --ops %q: want put, get or exists", errUsage, op)
		}
		for _, size := range sizeList {
			for _, batch := range batchList {
				for _, n := range concList {
					if ctx.Err() != nil {
						return ctx.Err()
					}
					row, err := b.row(ctx, op, size, batch, n)
					if err != nil {
						return err
					}
					if asJSON {
						line, _ := json.Marshal(row)
						fmt.Fprintln(e.stdout, string(line))
						continue
					}
					fmt.Fprintf(e.stdout, rowFormat, row.Op, human(uint64(row.Size)), row.Batch, row.Concurrency, row.Ops, row.Errors,
						fmt.Sprintf("%.0f", row.KeysPerS), fmt.Sprintf("%.2f", row.GBps), fmt.Sprintf("%.3f", row.P50ms), fmt.Sprintf("%.3f", row.P99ms))
					if io := row.FileIO; io != nil {
						fmt.Fprintf(e.stdout, "       SSD file ops: %d O_DIRECT, %d O_DIRECT through a bounce buffer, %d through the page cache\n", io.Direct, io.Bounced, io.Buffered)
					}
				}
			}
		}
	}
	return nil
}

type bench struct {
	c        *client.Client
	stderr   io.Writer
	progress io.Writer // the warm's; stderr, or nothing with --json
	duration time.Duration
	getKeys  int
	prefix   string
	seq      atomic.Int64
	mu       sync.Mutex
	keys     []string // every key written, removed at the end
}

// row runs one op at one size, batch and concurrency for the bench's
// duration. Put rows also stop when they have written a quarter of the
// pool's free space, and remove what they wrote afterwards, untimed.
func (b *bench) row(ctx context.Context, op string, size int64, batch, workers int) (benchRow, error) {
	value := make([]byte, size)
	if _, err := rand.Read(value); err != nil {
		return benchRow{}, err
	}
	var getKeys []string
	budget := int64(-1)
	if op == "put" {
		st, err := b.c.Status(ctx)
		if err != nil {
			return benchRow{}, err
		}
		for _, s := range st.Segments {
			budget += int64(s.Capacity-s.Used) / 4
		}
	} else {
		var err error
		if getKeys, err = b.populate(ctx, size, max(b.getKeys, batch), value); err != nil {
			return benchRow{}, err
		}
	}
	if err := b.waitWarm(ctx); err != nil {
		return benchRow{}, err
	}
	io0 := b.c.Engine().FileIO()
	var written, keys atomic.Int64
	var lat [][]time.Duration = make([][]time.Duration, workers)
	var errs atomic.Int64
	var firstErr error
	var errOnce sync.Once
	var putKeys [][]string = make([][]string, workers)
	stop := time.Now().Add(b.duration)
	start := time.Now()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			names := make([]string, batch)
			var name []byte
			values := make([][]byte, batch)
			bufs := make([][]byte, batch)
			for j := range batch {
				values[j], bufs[j] = value, make([]byte, size)
			}
			for i := 0; time.Now().Before(stop) && ctx.Err() == nil; i++ {
				if op == "put" && budget >= 0 && written.Load()+size*int64(batch) > budget {
					return
				}
				for j := range names {
					if op == "put" {
						// One allocation a key: Sprintf took 3% of a row's CPU.
						name = strconv.AppendInt(append(append(name[:0], b.prefix...), "put/"...), b.seq.Add(1), 10)
						names[j] = string(name)
					} else {
						names[j] = getKeys[(w+(i*batch+j)*workers)%len(getKeys)]
					}
				}
				t0 := time.Now()
				var err error
				switch op {
				case "put":
					err = errors.Join(b.c.BatchPut(ctx, names, values)...)
					putKeys[w] = append(putKeys[w], names...)
				case "get":
					_, es := b.c.BatchGetInto(ctx, names, bufs)
					err = errors.Join(es...)
				case "exists":
					var present []bool
					if present, err = b.c.Present(ctx, names); err == nil && slices.Contains(present, false) {
						err = errors.New("a key the row put is not there")
					}
				}
				if err != nil {
					errs.Add(1)
					errOnce.Do(func() { firstErr = err })
					continue
				}
				lat[w] = append(lat[w], time.Since(t0))
				keys.Add(int64(batch))
				if op != "exists" {
					written.Add(size * int64(batch))
				}
			}
		})
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
		Op: op, Size: size, Batch: batch, Concurrency: workers, Ops: len(all), Errors: int(errs.Load()),
		Bytes: written.Load(), Seconds: elapsed.Seconds(),
		KeysPerS: float64(keys.Load()) / elapsed.Seconds(),
		GBps:     float64(written.Load()) / 1e9 / elapsed.Seconds(),
		P50ms:    ms(percentile(all, 0.50)), P99ms: ms(percentile(all, 0.99)),
	}
	if io := b.c.Engine().FileIO(); io != io0 {
		row.FileIO = &engine.FileIO{Direct: io.Direct - io0.Direct, Bounced: io.Bounced - io0.Bounced, Buffered: io.Buffered - io0.Buffered}
	}
	if len(all) == 0 && firstErr != nil {
		return row, fmt.Errorf("every %s of %d bytes failed: %w", op, size, firstErr)
	}
	return row, nil
}

// warm puts one small key, which maps the memory of the store it lands on
// if that store shares this host, and waits for the client to warm what it
// mapped (see waitWarm).
func (b *bench) warm(ctx context.Context) error {
	key := b.prefix + "warm"
	if err := b.c.Put(ctx, key, make([]byte, 4096)); err != nil {
		return fmt.Errorf("first put: %w", err)
	}
	b.keys = append(b.keys, key)
	return b.waitWarm(ctx)
}

// waitWarm waits until the client's engine has touched every page of the
// store memory it has mapped (engine.Config.NoShmWarm), with progress on
// stderr unless --json: rows then measure a client that has run for a while, not its
// first touches. A row that maps another store's memory warms it beside
// its puts; the next row waits for it.
func (b *bench) waitWarm(ctx context.Context) error {
	start := time.Now()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for said := start; ; {
		w := b.c.Engine().ShmWarmth()
		if w.Cold == 0 {
			if time.Since(start) > time.Second {
				fmt.Fprintf(b.progress, "tidepool bench: warmed %s of store memory in %.1fs\n", human(uint64(w.Mapped)), time.Since(start).Seconds())
			}
			return nil
		}
		if time.Since(said) >= time.Second {
			said = time.Now()
			fmt.Fprintf(b.progress, "tidepool bench: warming this client's mapping of store memory: %s of %s\n", human(uint64(w.Mapped-w.Cold)), human(uint64(w.Mapped)))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
}

// populate writes n keys of this size for get and exists rows to read;
// rows of the same size share them.
func (b *bench) populate(ctx context.Context, size int64, n int, value []byte) ([]string, error) {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%sget/%d/%d", b.prefix, size, i)
	}
	for lo := 0; lo < n; lo += removeBatch {
		hi := min(lo+removeBatch, n)
		vals := make([][]byte, hi-lo)
		for i := range vals {
			vals[i] = value
		}
		if err := errors.Join(b.c.BatchPut(ctx, keys[lo:hi], vals)...); err != nil {
			return nil, fmt.Errorf("populate keys for get: %w", err)
		}
	}
	b.mu.Lock()
	b.keys = append(b.keys, keys...)
	b.mu.Unlock()
	return keys, nil
}

// removeBatch is how many keys one BatchRemove of the cleanup carries.
const removeBatch = 1024

// remove deletes keys and returns those it could not, for cleanup.
func (b *bench) remove(ctx context.Context, keys []string) (left []string) {
	for lo := 0; lo < len(keys); lo += removeBatch {
		part := keys[lo:min(lo+removeBatch, len(keys))]
		for i, err := range b.c.BatchRemove(ctx, part) {
			if err != nil && !errors.Is(err, client.ErrNotFound) {
				left = append(left, part[i])
			}
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
