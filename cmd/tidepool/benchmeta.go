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
			cfgp = cfg
		})
	if err != nil {
		return err
	}
	defer done()
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
	_, err = measure.Meta(ctx, measure.MetaConfig{Masters: cfgp.Masters, Ops: ops, Batches: batchList, Clients: clientList, Duration: duration},
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
