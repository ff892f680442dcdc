package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/tidepool-kv/tidepool/client"
)

// lookupRow is one line of `tidepool bench lookup` output.
type lookupRow struct {
	Chain        int     `json:"chain"`
	Hit          float64 `json:"hit"`
	Concurrency  int     `json:"concurrency"`
	Lookups      int     `json:"lookups"`
	Errors       int     `json:"errors"`
	Wrong        int     `json:"wrong"`
	Seconds      float64 `json:"seconds"`
	LookupsPerS  float64 `json:"lookups_per_s"`
	ProbesPerS   float64 `json:"probes_per_s"`
	P50ms        float64 `json:"p50_ms"`
	P99ms        float64 `json:"p99_ms"`
	MatchedTotal int64   `json:"matched_blocks"`
}

func runBenchLookup(ctx context.Context, e *env, args []string) error {
	var chains, hits, conc listFlag
	var duration time.Duration
	var asJSON bool
	var pool int
	var cpuProfile string
	ctx, c, _, done, err := clientCommand(ctx, e, time.Hour, "bench lookup", "[flags]",
		`Measure prefix lookups against a running cluster: it puts chains of tiny blocks, then looks up
chains whose leading fraction --hit is cached, one row per chain length, hit ratio and concurrency:
lookups/s, block probes/s (lookups x chain length) and p50/p99 latency of one lookup. Every answer
is checked against the expected match. The blocks are removed at the end.`,
		args, 0, 0, func(fs *flag.FlagSet, cfg *client.Config) {
			fs.Var(&chains, "chain", "blocks per chain (default 1024)")
			fs.Var(&hits, "hit", "fraction of each looked-up chain that is cached, 0 to 1 (default 1)")
			fs.Var(&conc, "concurrency", "concurrent lookups (default 1,4,16)")
			fs.DurationVar(&duration, "duration", 3*time.Second, "how long each row runs")
			fs.IntVar(&pool, "chains", 4, "distinct chains per length to look up")
			fs.BoolVar(&asJSON, "json", false, "print one JSON object per row instead of a table")
			profileFlag(fs, &cpuProfile)
			cfg.LookupCache = -1 // every lookup goes to the master, unless --cache
			fs.BoolFunc("cache", "let the client answer from its cache of leased descriptors", func(string) error {
				cfg.LookupCache = 0
				return nil
			})
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
	chainList, err := intList(chains, "--chain", []int{1024}, 1, 1<<16)
	if err != nil {
		return err
	}
	concList, err := intList(conc, "--concurrency", []int{1, 4, 16}, 1, 1024)
	if err != nil {
		return err
	}
	hitList := []float64{1}
	if len(hits) > 0 {
		hitList = nil
		for _, h := range hits {
			f, err := strconv.ParseFloat(h, 64)
			if err != nil || f < 0 || f > 1 {
				return fmt.Errorf("%w: --hit %q: want a fraction from 0 to 1", errUsage, h)
			}
			hitList = append(hitList, f)
		}
	}
	if pool < 1 {
		return fmt.Errorf("%w: --chains must be at least 1", errUsage)
	}
	b := &lookupBench{c: c, prefix: fmt.Sprintf("bench/%d/lookup/", time.Now().UnixNano()), duration: duration}
	defer b.cleanup(e)

	const rowFormat = "%6s %5s %5s %8s %6s %11s %13s %9s %9s\n"
	if !asJSON {
		fmt.Fprintf(e.stdout, rowFormat, "CHAIN", "HIT", "CONC", "LOOKUPS", "ERRORS", "LOOKUPS/s", "PROBES/s", "P50 ms", "P99 ms")
	}
	for _, n := range chainList {
		cached, err := b.populate(ctx, n, pool)
		if err != nil {
			return err
		}
		for _, hit := range hitList {
			for _, w := range concList {
				row, err := b.row(ctx, cached, n, hit, w)
				if err != nil {
					return err
				}
				if asJSON {
					line, _ := json.Marshal(row)
					fmt.Fprintln(e.stdout, string(line))
					continue
				}
				fmt.Fprintf(e.stdout, rowFormat, strconv.Itoa(row.Chain), fmt.Sprintf("%.2f", row.Hit), strconv.Itoa(row.Concurrency),
					strconv.Itoa(row.Lookups), strconv.Itoa(row.Errors+row.Wrong), fmt.Sprintf("%.0f", row.LookupsPerS),
					fmt.Sprintf("%.0f", row.ProbesPerS), fmt.Sprintf("%.3f", row.P50ms), fmt.Sprintf("%.3f", row.P99ms))
			}
		}
	}
	return nil
}

// intList parses a list flag of integers in [lo, hi], or returns def.
func intList(l listFlag, name string, def []int, lo, hi int) ([]int, error) {
	if len(l) == 0 {
		return def, nil
	}
	var out []int
	for _, s := range l {
		n, err := strconv.Atoi(s)
		if err != nil || n < lo || n > hi {
			return nil, fmt.Errorf("%w: %s %q: want %d to %d", errUsage, name, s, lo, hi)
		}
		out = append(out, n)
	}
	return out, nil
}

type lookupBench struct {
	c        *client.Client
	prefix   string
	duration time.Duration
	keys     []string // every key written, removed at the end
}

// populate puts pool chains of n one-byte blocks and returns their keys.
func (b *lookupBench) populate(ctx context.Context, n, pool int) ([][]string, error) {
	var out [][]string
	value := []byte{1}
	for p := range pool {
		keys := make([]string, n)
		vals := make([][]byte, n)
		for i := range keys {
			keys[i] = fmt.Sprintf("%s%d/%d/%016x", b.prefix, n, p, i)
			vals[i] = value
		}
		for start := 0; start < n; start += 4096 {
			end := min(start+4096, n)
			parent := ""
			if start > 0 {
				parent = keys[start-1]
			}
			for i, err := range b.c.BatchPutChain(ctx, parent, keys[start:end], vals[start:end]) {
				if err != nil {
					return nil, fmt.Errorf("populate chain block %d: %w", start+i, err)
				}
			}
		}
		b.keys = append(b.keys, keys...)
		out = append(out, keys)
	}
	return out, nil
}

// row looks up chains of n blocks whose first hit*n are cached.
func (b *lookupBench) row(ctx context.Context, cached [][]string, n int, hit float64, workers int) (lookupRow, error) {
	want := int(hit * float64(n))
	queries := make([][]string, len(cached))
	for p, keys := range cached {
		q := slices.Clone(keys[:want])
		for i := want; i < n; i++ {
			q = append(q, fmt.Sprintf("%smiss/%d/%d/%016x", b.prefix, n, p, i))
		}
		queries[p] = q
	}
	var mu sync.Mutex
	var lat []time.Duration
	var errs, wrong int
	var matched int64
	var firstErr error
	start := time.Now()
	deadline := start.Add(b.duration)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			var mine []time.Duration
			var e, bad int
			var m int64
			for i := w; time.Now().Before(deadline) && ctx.Err() == nil; i++ {
				t := time.Now()
				got, err := b.c.Lookup(ctx, queries[i%len(queries)])
				d := time.Since(t)
				switch {
				case err != nil:
					e++
					mu.Lock()
					firstErr = cmp.Or(firstErr, err)
					mu.Unlock()
				case got.Len() != want:
					bad++
				default:
					mine = append(mine, d)
					m += int64(got.Len())
				}
			}
			mu.Lock()
			lat = append(lat, mine...)
			errs, wrong, matched = errs+e, wrong+bad, matched+m
			mu.Unlock()
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	slices.Sort(lat)
	row := lookupRow{
		Chain: n, Hit: hit, Concurrency: workers, Lookups: len(lat), Errors: errs, Wrong: wrong,
		Seconds:     elapsed.Seconds(),
		LookupsPerS: float64(len(lat)) / elapsed.Seconds(),
		ProbesPerS:  float64(len(lat)*n) / elapsed.Seconds(),
		P50ms:       ms(percentile(lat, 0.50)), P99ms: ms(percentile(lat, 0.99)),
		MatchedTotal: matched,
	}
	if len(lat) == 0 && firstErr != nil {
		return row, fmt.Errorf("every lookup of %d blocks failed: %w", n, firstErr)
	}
	if wrong > 0 {
		return row, fmt.Errorf("%d lookups of %d blocks matched other than %d", wrong, n, want)
	}
	return row, nil
}

func (b *lookupBench) cleanup(e *env) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var left int
	for _, err := range b.c.BatchRemove(ctx, b.keys) {
		if err != nil && !errors.Is(err, client.ErrNotFound) {
			left++
		}
	}
	if left > 0 {
		fmt.Fprintf(e.stderr, "tidepool bench lookup: could not remove %d benchmark keys (prefix %s)\n", left, b.prefix)
	}
}
