package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"strconv"
	"time"

	measure "github.com/tidepool-kv/tidepool/bench" // this package has a type bench
	"github.com/tidepool-kv/tidepool/client"
)

func runBenchMeta(ctx context.Context, e *env, args []string) error {
	var ops, batches, clients listFlag
	var duration time.Duration
	var asJSON bool
	var cpuProfile string
	var cfgp *client.Config // the client's config, Masters set once the flags are parsed
	ctx, _, _, done, err := clientCommand(ctx, e, time.Hour, "bench meta", "[flags]",
		`Measure the master alone, as Mooncake's master_bench does: batches of metadata calls with tiny
values and no data transfer (put: BatchPutStart and BatchPutEnd; get: GetReplicas; exists: Exists), one
row per op, batch size and client count: keys/s, mean and p99 per call. Keys it puts are removed.`,
		args, 0, 0, func(fs *flag.FlagSet, cfg *client.Config) {
			fs.Var(&ops, "ops", "operations: put, get, exists (default all)")
			fs.Var(&batches, "batch", "keys per call (default 1,128,1024)")
			fs.Var(&clients, "clients", "concurrent callers, each with a connection of its own (default 1,2,4)")
			fs.DurationVar(&duration, "duration", 3*time.Second, "how long each row runs")
			fs.BoolVar(&asJSON, "json", false, "print one JSON object per row instead of a table")
			profileFlag(fs, &cpuProfile)
			cfgp = cfg
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
	batchList, err := intList(batches, "--batch", nil, 1, 16384)
	if err != nil {
		return err
	}
	clientList, err := intList(clients, "--clients", nil, 1, 256)
	if err != nil {
		return err
	}
	const rowFormat = "%-7s %6s %7s %8s %6s %12s %9s %9s\n"
	if !asJSON {
		fmt.Fprintf(e.stdout, rowFormat, "OP", "BATCH", "CLIENTS", "CALLS", "ERRORS", "KEYS/s", "MEAN ms", "P99 ms")
	}
	var firstFail string
	_, err = measure.Meta(ctx, measure.MetaConfig{Masters: cfgp.Masters, Credentials: cfgp.Credentials, Ops: ops, Batches: batchList, Clients: clientList, Duration: duration},
		func(r measure.MetaRow) {
			if r.FirstFail != "" && firstFail == "" {
				firstFail = r.FirstFail
			}
			if asJSON {
				line, _ := json.Marshal(r)
				fmt.Fprintln(e.stdout, string(line))
				return
			}
			fmt.Fprintf(e.stdout, rowFormat, r.Op, strconv.Itoa(r.Batch), strconv.Itoa(r.Clients), strconv.Itoa(r.Calls),
				strconv.Itoa(r.Errors), fmt.Sprintf("%.0f", r.KeysPerS), fmt.Sprintf("%.3f", r.MeanMs), fmt.Sprintf("%.3f", r.P99Ms))
		})
	if err != nil {
		return err
	}
	if firstFail != "" {
		fmt.Fprintf(e.stderr, "bench meta: calls failed; the first: %s\n", firstFail)
	}
	return nil
}

func runBenchFill(ctx context.Context, e *env, args []string) error {
	var fc measure.FillConfig
	var cfgp *client.Config
	ctx, _, _, done, err := clientCommand(ctx, e, time.Hour, "bench fill", "[flags]",
		`Put many tiny objects through the master alone (BatchPutStart and BatchPutEnd, no bytes written)
and leave them there, to measure what the master's object table costs: its memory per object
(process_resident_memory_bytes on its /metrics) and its restart time. Remove them afterwards with
tidepool admin evict --prefix PREFIX.`,
		args, 0, 0, func(fs *flag.FlagSet, cfg *client.Config) {
			fs.IntVar(&fc.Count, "count", 1<<20, "objects to put")
			fs.IntVar(&fc.Batch, "batch", 4096, "objects a call")
			fs.IntVar(&fc.KeyBytes, "key-bytes", 30, "length of every key")
			fs.IntVar(&fc.ValueBytes, "value-bytes", 64, "size every object declares")
			fs.StringVar(&fc.Prefix, "prefix", "fill/", "start of every key")
			cfgp = cfg
		})
	if err != nil {
		return err
	}
	defer done()
	if fc.Count < 1 || fc.Batch < 1 || fc.Batch > 16384 {
		return fmt.Errorf("%w: --count must be positive and --batch 1 to 16384", errUsage)
	}
	fc.Masters, fc.Credentials = cfgp.Masters, cfgp.Credentials
	step := max(fc.Count/10, 1)
	start := time.Now()
	fc.Progress = func(n int) {
		if n%step < fc.Batch || n == fc.Count {
			fmt.Fprintf(e.stderr, "bench fill: %d of %d objects (%.0f keys/s)\n", n, fc.Count, float64(n)/time.Since(start).Seconds())
		}
	}
	took, err := measure.Fill(ctx, fc)
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "put %d objects of %d-byte keys in %v: %.0f keys/s\n", fc.Count, fc.KeyBytes, took.Round(time.Millisecond), float64(fc.Count)/took.Seconds())
	return nil
}
