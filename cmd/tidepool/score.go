package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/tidepool-kv/tidepool/client"
)

const chainArgs = "(--scheme S --model M [hash flags] [--tokens 1,2,3|-] | --keys K1,K2,...)"

const chainHelp = `The chain is a prompt's token ids, hashed into object keys as an engine does (the flags of
` + "`tidepool hash`" + ` with --model), or object keys given with --keys.`

// runLookup is `tidepool lookup`: the pool's answer to an engine's lookup
// of a chain, which leases the blocks it matches.
func runLookup(ctx context.Context, e *env, args []string) error {
	var b blockFlags
	var keys string
	var asJSON bool
	var fs *flag.FlagSet
	ctx, c, _, done, err := clientCommand(ctx, e, time.Minute, "lookup", chainArgs,
		"Print how many leading blocks of a chain the pool holds, and their keys, as an engine's lookup\nsees them (it leases them, as that lookup does).\n"+chainHelp,
		args, 0, 0, func(f *flag.FlagSet, cfg *client.Config) {
			b.register(f)
			f.StringVar(&keys, "keys", "", "the chain's object keys, separated by commas")
			f.BoolVar(&asJSON, "json", false, "print a JSON object")
			cfg.LookupCache, fs = -1, f
		})
	if err != nil {
		return err
	}
	defer done()
	chain, err := b.keys(e, fs, keys)
	if err != nil {
		return err
	}
	m, err := c.Lookup(ctx, chain)
	if err != nil {
		return err
	}
	if asJSON {
		return json.NewEncoder(e.stdout).Encode(struct {
			Matched int      `json:"matched"`
			Blocks  int      `json:"blocks"`
			Keys    []string `json:"keys"`
		}{m.Len(), len(chain), m.Keys()})
	}
	fmt.Fprintf(e.stdout, "%d of %d blocks cached\n", m.Len(), len(chain))
	for _, k := range m.Keys() {
		fmt.Fprintln(e.stdout, k)
	}
	return nil
}

// runScore is `tidepool score`: what a router asks of the pool.
func runScore(ctx context.Context, e *env, args []string) error {
	var b blockFlags
	var keys, weights string
	var asJSON bool
	var fs *flag.FlagSet
	ctx, c, _, done, err := clientCommand(ctx, e, time.Minute, "score", chainArgs+" [--weights hbm=1,dram=0.8,ssd=0.5]",
		"Print how many leading blocks of a chain the pool holds, in all and per tier, and a router's\nscore of them: the sum over those blocks of the weight of the fastest tier each is in. It\nleases nothing and is no use of the blocks, so asking changes nothing in the pool.\n"+chainHelp,
		args, 0, 0, func(f *flag.FlagSet, _ *client.Config) {
			b.register(f)
			f.StringVar(&keys, "keys", "", "the chain's object keys, separated by commas")
			f.StringVar(&weights, "weights", "", "weights by tier, e.g. hbm=1,dram=0.8,ssd=0.5 (the default)")
			f.BoolVar(&asJSON, "json", false, "print a JSON object")
			fs = f
		})
	if err != nil {
		return err
	}
	defer done()
	w, err := parseWeights(weights)
	if err != nil {
		return err
	}
	chain, err := b.keys(e, fs, keys)
	if err != nil {
		return err
	}
	s, err := c.Score(ctx, chain, w)
	if err != nil {
		return err
	}
	if asJSON {
		return json.NewEncoder(e.stdout).Encode(struct {
			Matched int            `json:"matched"`
			Blocks  int            `json:"blocks"`
			Tiers   map[string]int `json:"tiers"`
			Score   float64        `json:"score"`
		}{s.Matched, len(chain), s.Tiers, s.Score})
	}
	fmt.Fprintf(e.stdout, "%d of %d blocks cached, score %.4g\n", s.Matched, len(chain), s.Score)
	for _, t := range []string{"hbm", "dram", "ssd"} {
		if n, ok := s.Tiers[t]; ok {
			fmt.Fprintf(e.stdout, "%-5s %d leading blocks\n", t, n)
		}
	}
	return nil
}

// parseWeights reads "hbm=1,dram=0.8".
func parseWeights(s string) (map[string]float64, error) {
	if s == "" {
		return nil, nil
	}
	out := map[string]float64{}
	for _, f := range strings.Split(s, ",") {
		name, v, ok := strings.Cut(strings.TrimSpace(f), "=")
		w, err := strconv.ParseFloat(v, 64)
		if !ok || err != nil || w < 0 || w != w || w > 1e300 {
			return nil, fmt.Errorf("%w: --weights %q: want TIER=WEIGHT pairs with weights of 0 or more", errUsage, f)
		}
		out[name] = w
	}
	return out, nil
}
