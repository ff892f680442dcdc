//go:build linux

package integration

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/client"
)

// chainKeys hashes blocks of tokens into a chain of keys the way engines
// do: each key covers its parent's, so two chains share keys exactly as far
// as they share a token prefix.
func chainKeys(blocks [][]uint32) []string {
	keys := make([]string, len(blocks))
	var parent []byte
	for i, b := range blocks {
		h := sha256.New()
		h.Write(parent)
		for _, t := range b {
			h.Write(binary.LittleEndian.AppendUint32(nil, t))
		}
		parent = h.Sum(nil)
		keys[i] = "kv/test/" + hex.EncodeToString(parent)
	}
	return keys
}

// tokenBlocks returns n blocks of 16 tokens drawn from a seed: the same
// seed gives the same blocks.
func tokenBlocks(seed uint32, n int) [][]uint32 {
	out := make([][]uint32, n)
	for i := range out {
		out[i] = make([]uint32, 16)
		for j := range out[i] {
			out[i][j] = seed*1_000_003 + uint32(i*16+j)
		}
	}
	return out
}

// TestLookupChains is the prefix lookup's acceptance test with real
// processes: an engine-like client puts 100 chains of 64 blocks that share
// system-prompt prefixes, then looks up chains with known overlap and gets
// the exact matched length every time; blocks leased by a lookup are never
// evicted before the lease ends, though puts of three times the pool's size
// follow.
func TestLookupChains(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	const (
		chains    = 100
		blocks    = 64
		prompt    = 16 // blocks of a shared system prompt
		prompts   = 10
		blockSize = 16 << 10
		pool      = 128 << 20
		leaseTTL  = 8 * time.Second
	)
	m := startMaster(t, ctx, t.TempDir(), "--lease-ttl", leaseTTL.String())
	leaderSince := time.Now() // ready means leader: it took over before this
	startStore(t, ctx, "s1", m.grpc, "dram:128MiB")
	c := newClient(t, m.grpc)
	src := newRand(t)
	value := func(key string) []byte { // derived from the key, so a read can be checked
		sum := sha256.Sum256([]byte(key))
		return bytes.Repeat(sum[:], blockSize/len(sum))
	}
	chainOf := func(p, c uint32) [][]uint32 {
		return append(tokenBlocks(p, prompt), tokenBlocks(1000+c, blocks-prompt)...)
	}
	putChain := func(keys []string) {
		t.Helper()
		vals := make([][]byte, len(keys))
		for i, k := range keys {
			vals[i] = value(k)
		}
		for i, err := range c.BatchPutChain(ctx, "", keys, vals) {
			if err != nil {
				t.Fatalf("put block %d: %v", i, err)
			}
		}
	}
	var all [][]string
	for i := range uint32(chains) {
		keys := chainKeys(chainOf(i%prompts, i))
		putChain(keys)
		all = append(all, keys)
	}

	novel := tokenBlocks(999_999, blocks)
	rng := func(n int) int { return int(src.Uint64() % uint64(n)) }
	cases := 0
	check := func(name string, chain []string, want int) {
		t.Helper()
		got, err := c.Lookup(ctx, chain)
		if err != nil {
			t.Fatalf("%s: lookup: %v", name, err)
		}
		if got.Len() != want {
			t.Fatalf("%s: matched %d of %d blocks, want %d", name, got.Len(), len(chain), want)
		}
		n, err := c.BatchExists(ctx, chain)
		if err != nil || n != want {
			t.Fatalf("%s: batch exists %d, %v; want %d", name, n, err, want)
		}
		cases++
	}
	for i := range uint32(chains) {
		p := i % prompts
		full := chainOf(p, i)
		check("a put chain", all[i], blocks)
		l := 1 + rng(blocks)
		check("a truncated chain", all[i][:l], l)
		check("a chain extended by new blocks", chainKeys(append(full, novel[:8]...)), blocks)
		d := prompt + rng(blocks-prompt)
		check("a chain that diverges", chainKeys(append(full[:d:d], novel[:blocks-d]...)), d)
		check("a shared prompt, then another chain's tokens", chainKeys(append(tokenBlocks(p, prompt), tokenBlocks(1000+(i+1)%chains, blocks-prompt)...)), prompt)
		check("a new first block, then a put chain's tokens", chainKeys(append(novel[:1:1], full[1:]...)), 0)
	}
	t.Logf("%d lookups matched exactly", cases)

	// Lease ten chains, then put three times the pool's size of new chains.
	// A new leader evicts nothing for one lease TTL, so start after that.
	time.Sleep(time.Until(leaderSince.Add(leaseTTL + 200*time.Millisecond)))
	var leased []client.Match
	for i := range 10 {
		mt, err := c.Lookup(ctx, all[i])
		if err != nil || mt.Len() != blocks {
			t.Fatalf("lookup chain %d before the pressure: %d blocks, %v", i, mt.Len(), err)
		}
		leased = append(leased, mt)
	}
	for i := range uint32(3 * pool / (blocks * blockSize)) {
		putChain(chainKeys(tokenBlocks(5000+i, blocks)))
	}
	if n, err := counter(m.http, "tidepool_master_evictions_total"); err != nil || n == 0 {
		t.Fatalf("evictions %v, %v: the puts should have pressed the pool", n, err)
	}
	for i, mt := range leased {
		if time.Now().After(mt.LeaseEnd) {
			t.Fatalf("the pressure outlasted the lease; make the lease longer")
		}
		bufs := make([][]byte, mt.Len())
		for j := range bufs {
			bufs[j] = make([]byte, blockSize)
		}
		_, errs := c.GetMatched(ctx, mt, bufs)
		for j, err := range errs {
			if err != nil {
				t.Fatalf("chain %d block %d, leased by a lookup, after the pressure: %v", i, j, err)
			}
			if !bytes.Equal(bufs[j], value(mt.Blocks[j].Key)) {
				t.Fatalf("chain %d block %d: wrong bytes", i, j)
			}
		}
	}
	t.Logf("%d leased chains of %d blocks read back after %d MiB of puts into %d MiB", len(leased), blocks, 3*pool>>20, pool>>20)
	if n, err := c.BatchExists(ctx, all[0]); err != nil || n != blocks {
		t.Fatalf("chain 0 while still leased: %d present, %v", n, err)
	}
}
