//go:build linux

package integration

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/client"
)

// incarnation is the value of key's gen-th put: each put of a key is told
// apart by its bytes and so its checksum.
func incarnation(key string, gen int) []byte {
	sum := sha256.Sum256(fmt.Appendf(nil, "%s#%d", key, gen))
	return bytes.Repeat(sum[:], 4096/len(sum))
}

// checksums lists the checksums of a match's blocks.
func checksums(m client.Match) []uint32 {
	var out []uint32
	for _, b := range m.Blocks {
		out = append(out, b.Checksum)
	}
	return out
}

// lookers runs n goroutines that look chain up on c until stop is called
// (or the test ends), and passes each answer to check with whether the
// lookup started after mark was called. wait returns once that many more
// lookups have been answered; stop returns how many started after mark.
func lookers(t *testing.T, ctx context.Context, c *client.Client, chain []string, n int, check func(m client.Match, late bool)) (mark func(), wait func(lookups int64), stop func() int64) {
	var after atomic.Bool
	var total, late atomic.Int64
	done := make(chan struct{})
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			for {
				select {
				case <-done:
					return
				default:
				}
				l := after.Load()
				m, err := c.Lookup(ctx, chain)
				if err != nil {
					t.Errorf("lookup: %v", err)
					return
				}
				total.Add(1)
				if l {
					late.Add(1)
				}
				check(m, l)
			}
		})
	}
	mark = func() { after.Store(true) }
	wait = func(lookups int64) {
		t.Helper()
		from := total.Load()
		waitFor(t, 30*time.Second, func() error {
			if got := total.Load() - from; got < lookups {
				return fmt.Errorf("%d lookups of %d", got, lookups)
			}
			return nil
		})
	}
	var once sync.Once
	stop = func() int64 {
		once.Do(func() { close(done) })
		wg.Wait()
		return late.Load()
	}
	t.Cleanup(func() { stop() }) // should the test end early
	return mark, wait, stop
}

// TestLookupNeverServesRemovedBlock is issue 11's item 6 with real
// processes: lookups run on the client that removes a block of their
// chain, and none that starts after Remove returned reports the block.
// The lease is long, so a descriptor put back in the cache by a lookup in
// flight during the removal would be served for the whole test.
func TestLookupNeverServesRemovedBlock(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	m := startMaster(t, ctx, t.TempDir(), "--lease-ttl", "60s")
	startStore(t, ctx, "s1", m.grpc, "dram:64MiB")
	c := newClient(t, m.grpc)
	const rounds, blocks, removed, looking = 20, 16, 9, 4
	var bad atomic.Int64
	var late int64
	for round := range rounds {
		chain := chainKeys(tokenBlocks(uint32(round), blocks))
		vals := make([][]byte, len(chain))
		for i, k := range chain {
			vals[i] = incarnation(k, 0)
		}
		for i, err := range c.BatchPutChain(ctx, "", chain, vals) {
			if err != nil {
				t.Fatalf("put block %d: %v", i, err)
			}
		}
		mark, wait, stop := lookers(t, ctx, c, chain, looking, func(m client.Match, late bool) {
			if late && m.Len() > removed {
				bad.Add(1)
			}
		})
		wait(50) // the chain is cached, and lookups answer from the cache
		if err := c.Remove(ctx, chain[removed]); err != nil {
			t.Fatal(err)
		}
		mark()
		wait(200)
		late += stop()
		if t.Failed() {
			return
		}
	}
	if n := bad.Load(); n > 0 {
		t.Fatalf("%d of %d lookups that started after Remove returned reported the removed block", n, late)
	}
	t.Logf("%d lookups after %d removals, none reported the removed block", late, rounds)
}

// TestLookupNeverServesOlderIncarnation: after a key is removed and put
// again, the client that did so, with lookups of the key running on it, a
// client that put it again after another removed it, and a bystander that
// had the old one cached, look it up as the new incarnation and read the
// new bytes: the master answers the re-put once the lookup leases of the
// removed one have ended.
func TestLookupNeverServesOlderIncarnation(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	const lease = 2 * time.Second
	m := startMaster(t, ctx, t.TempDir(), "--lease-ttl", lease.String())
	startStore(t, ctx, "s1", m.grpc, "dram:64MiB")
	a, b, bystander := newClient(t, m.grpc), newClient(t, m.grpc), newClient(t, m.grpc)

	// lookupAs looks key up on c and checks it answers, and reads, gen.
	lookupAs := func(c *client.Client, key string, gen int) error {
		mt, err := c.Lookup(ctx, []string{key})
		if err != nil {
			return err
		}
		want := incarnation(key, gen)
		if mt.Len() != 1 {
			return fmt.Errorf("matched %d blocks, want 1", mt.Len())
		}
		if got := mt.Blocks[0].Checksum; got != client.Checksum(want) {
			return fmt.Errorf("checksum %08x, want %08x (incarnation %d)", got, client.Checksum(want), gen)
		}
		buf := make([]byte, len(want))
		if _, errs := c.GetMatched(ctx, mt, [][]byte{buf}); errs[0] != nil {
			return fmt.Errorf("get matched: %w", errs[0])
		}
		if !bytes.Equal(buf, want) {
			return fmt.Errorf("read other bytes than incarnation %d", gen)
		}
		return nil
	}
	put := func(c *client.Client, key string, gen int) {
		t.Helper()
		if err := c.Put(ctx, key, incarnation(key, gen)); err != nil {
			t.Fatalf("put %s #%d: %v", key, gen, err)
		}
	}
	cached := func(c *client.Client, key string, gen int) {
		t.Helper()
		if err := lookupAs(c, key, gen); err != nil {
			t.Fatalf("lookup of %s #%d: %v", key, gen, err)
		}
	}

	t.Run("RemovedAndPutAgainByTheLooker", func(t *testing.T) {
		const rounds, looking = 10, 4
		key := chainKeys(tokenBlocks(100, 1))[0]
		put(a, key, 0)
		var bad atomic.Int64
		var late int64
		for gen := 1; gen <= rounds; gen++ {
			cached(a, key, gen-1)
			var mu sync.Mutex
			var first error
			mark, wait, stop := lookers(t, ctx, a, []string{key}, looking, func(mt client.Match, late bool) {
				if late && (mt.Len() != 1 || mt.Blocks[0].Checksum != client.Checksum(incarnation(key, gen))) {
					bad.Add(1)
					mu.Lock()
					if first == nil {
						first = fmt.Errorf("want incarnation %d (checksum %08x): matched %d blocks, checksums %08x", gen, client.Checksum(incarnation(key, gen)), mt.Len(), checksums(mt))
					}
					mu.Unlock()
				}
			})
			wait(50)
			if err := a.Remove(ctx, key); err != nil {
				t.Fatal(err)
			}
			put(a, key, gen)
			mark()
			wait(200)
			late += stop()
			if n := bad.Load(); n > 0 {
				t.Fatalf("%d lookups that started after the re-put returned served another incarnation; first: %v", n, first)
			}
			if err := lookupAs(a, key, gen); err != nil {
				t.Fatalf("incarnation %d: %v", gen, err)
			}
		}
		t.Logf("%d lookups after %d removes and re-puts, all of the current incarnation", late, rounds)
	})

	// inCache returns once a lookup of key on c is answered from c's
	// cache: with the lease end of the lookup before it.
	inCache := func(c *client.Client, key string) {
		t.Helper()
		var last time.Time
		waitFor(t, 10*time.Second, func() error {
			mt, err := c.Lookup(ctx, []string{key})
			if err != nil || mt.Len() != 1 {
				return fmt.Errorf("lookup: %d blocks, %v", mt.Len(), err)
			}
			prev := last
			last = mt.LeaseEnd
			if !mt.LeaseEnd.Equal(prev) {
				return fmt.Errorf("lease end %v, the lookup before %v: asked the master", mt.LeaseEnd, prev)
			}
			return nil
		})
	}

	t.Run("PutAgainAfterAnotherRemoved", func(t *testing.T) {
		for gen := 1; gen <= 5; gen++ {
			key := chainKeys(tokenBlocks(200+uint32(gen), 1))[0]
			put(a, key, 0)
			cached(a, key, 0)
			inCache(a, key)
			if err := b.Remove(ctx, key); err != nil {
				t.Fatal(err)
			}
			put(a, key, gen)
			if err := lookupAs(a, key, gen); err != nil {
				t.Fatalf("the re-putting client: %v", err)
			}
			if err := lookupAs(b, key, gen); err != nil {
				t.Fatalf("the removing client: %v", err)
			}
		}
	})

	// A bystander with the old incarnation cached, and lookups of it
	// running, is not told; its cache entries end with their lease, which
	// the re-put outwaits.
	t.Run("BystanderAfterThePut", func(t *testing.T) {
		for gen := 1; gen <= 3; gen++ {
			key := chainKeys(tokenBlocks(300+uint32(gen), 1))[0]
			put(a, key, 0)
			cached(bystander, key, 0)
			inCache(bystander, key)
			var bad atomic.Int64
			mark, wait, stop := lookers(t, ctx, bystander, []string{key}, 2, func(mt client.Match, late bool) {
				if late && (mt.Len() != 1 || mt.Blocks[0].Checksum != client.Checksum(incarnation(key, 1))) {
					bad.Add(1)
				}
			})
			wait(50)
			if err := a.Remove(ctx, key); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			put(a, key, 1)
			took := time.Since(start)
			mark()
			wait(100)
			late := stop()
			if n := bad.Load(); n > 0 {
				t.Fatalf("%d of the bystander's %d lookups that started after the re-put returned served the old incarnation", n, late)
			}
			if err := lookupAs(bystander, key, 1); err != nil {
				t.Fatalf("the bystander after the re-put: %v", err)
			}
			t.Logf("the re-put of a key the bystander had cached returned after %v (lease %v); %d lookups after it, all of the new incarnation", took.Round(time.Millisecond), lease, late)
		}
	})
}
