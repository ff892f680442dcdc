package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"text/tabwriter"
	"time"

	"github.com/tidepool-kv/tidepool/engine"
)

func runAdmin(ctx context.Context, e *env, args []string) error {
	if len(args) == 0 {
		return fmt.Errorf("%w: want a subcommand: rails", errUsage)
	}
	switch args[0] {
	case "rails":
		return runAdminRails(ctx, e, args[1:])
	}
	return fmt.Errorf("%w: unknown admin subcommand %q (want rails)", errUsage, args[0])
}

// runAdminRails prints the rail table a daemon serves at /debug/rails.
func runAdminRails(ctx context.Context, e *env, args []string) error {
	fs := newFlags("admin rails", "[--http ADDR]", "Show the transfer engine's rails of a store (or `tidepool up`): state, bytes in flight,\nestimated bandwidth and errors per rail and peer.", e.stderr)
	addr := fs.String("http", "127.0.0.1:9090", "HTTP address of the daemon (its --http)")
	asJSON := fs.Bool("json", false, "print the rails as JSON")
	if _, err := parse(fs, args, 0, 0); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+*addr+"/debug/rails", nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("ask %s for its rails: %w", *addr, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("ask %s for its rails: %s (is it a store or `tidepool up`?)", *addr, resp.Status)
	}
	var rails []engine.RailInfo
	if err := json.NewDecoder(resp.Body).Decode(&rails); err != nil {
		return fmt.Errorf("decode rails from %s: %w", *addr, err)
	}
	if *asJSON {
		return json.NewEncoder(e.stdout).Encode(rails)
	}
	return printRails(e, rails)
}

func printRails(e *env, rails []engine.RailInfo) error {
	if len(rails) == 0 {
		fmt.Fprintln(e.stdout, "no rails yet: the engine has not sent to a peer")
		return nil
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PEER\tRAIL\tSTATE\tIN FLIGHT\tBANDWIDTH\tERRORS")
	for _, r := range rails {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s/s\t%d\n", r.Peer, r.Addr, r.State, human(uint64(r.InflightBytes)), human(uint64(r.Bandwidth)), r.Errors)
	}
	return tw.Flush()
}
