//go:build linux

package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/client/kvhash"
)

// TestScoreAgreesWithLookup: against a real `tidepool up`, the Score of
// 1,000 prompts with known overlap with what was put matches what a
// Lookup matches, block for block; `tidepool score` and `tidepool lookup`
// on token lists say the same.
func TestScoreAgreesWithLookup(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	u := startUp(t, ctx, t.TempDir())
	c, err := client.New(client.Config{Masters: []string{u.grpc}, LookupCache: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	h, err := kvhash.New(kvhash.Config{Scheme: kvhash.XXH3})
	if err != nil {
		t.Fatal(err)
	}
	ns := kvhash.Namespace{Scheme: kvhash.XXH3, Model: "org/model"}
	keysOf := func(tokens []uint32) []string {
		hashes, err := h.Hash(nil, tokens, nil)
		if err != nil {
			t.Fatal(err)
		}
		keys := make([]string, len(hashes))
		for i, hh := range hashes {
			keys[i] = ns.Key(hh)
		}
		return keys
	}
	rng := rand.New(rand.NewPCG(1, 2))
	randomTokens := func(blocks int) []uint32 {
		out := make([]uint32, blocks*h.BlockSize())
		for i := range out {
			out[i] = rng.Uint32N(50000)
		}
		return out
	}
	// 50 stored prompts of 8 blocks each; a query continues the first m
	// blocks of one of them (m from 0 to 8) with blocks of its own.
	const stored, storedBlocks = 50, 8
	prompts := make([][]uint32, stored)
	for i := range prompts {
		prompts[i] = randomTokens(storedBlocks)
		keys := keysOf(prompts[i])
		values := make([][]byte, len(keys))
		for j := range values {
			values[j] = []byte(fmt.Sprintf("block %d of prompt %d", j, i))
		}
		if err := errors.Join(c.BatchPutChain(ctx, "", keys, values)...); err != nil {
			t.Fatal(err)
		}
	}
	type query struct {
		tokens []uint32
		want   int
	}
	queries := make([]query, 1000)
	for i := range queries {
		p, m := prompts[rng.IntN(stored)], rng.IntN(storedBlocks+1)
		queries[i] = query{append(append([]uint32(nil), p[:m*h.BlockSize()]...), randomTokens(1+rng.IntN(4))...), m}
	}
	for i, q := range queries {
		keys := keysOf(q.tokens)
		s, err := c.Score(ctx, keys, nil)
		if err != nil {
			t.Fatal(err)
		}
		m, err := c.Lookup(ctx, keys)
		if err != nil {
			t.Fatal(err)
		}
		if s.Matched != q.want || m.Len() != q.want || s.Tiers["dram"] != q.want || math.Abs(s.Score-0.8*float64(q.want)) > 1e-9 {
			t.Fatalf("query %d: score %+v, lookup %d; want %d blocks, all in DRAM", i, s, m.Len(), q.want)
		}
	}
	// The commands, on token lists, for a few.
	for _, q := range queries[:10] {
		tokens := strings.Trim(strings.Join(strings.Fields(fmt.Sprint(q.tokens)), ","), "[]")
		args := []string{"--masters", u.grpc, "--scheme", "xxh3-64", "--model", "org/model", "--tokens", tokens, "--json"}
		var s struct {
			Matched int            `json:"matched"`
			Tiers   map[string]int `json:"tiers"`
		}
		var l struct {
			Matched int      `json:"matched"`
			Keys    []string `json:"keys"`
		}
		if err := json.Unmarshal(mustCLI(t, ctx, nil, append([]string{"score"}, args...)...).stdout, &s); err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(mustCLI(t, ctx, nil, append([]string{"lookup"}, args...)...).stdout, &l); err != nil {
			t.Fatal(err)
		}
		if s.Matched != q.want || l.Matched != q.want || len(l.Keys) != q.want || s.Tiers["dram"] != q.want {
			t.Fatalf("tidepool score %+v, tidepool lookup %+v: want %d blocks", s, l, q.want)
		}
	}
}
