//go:build linux

package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/client"
)

// TestReview13TombHoles: real processes, a lease of 3 s.
//
// ExistsPut: a removes a key the bystander has cached and puts it again
// (held by the master until the lookup lease ends); meanwhile b puts the
// key too, is answered Exists, and returns at once. A bystander lookup
// that starts after b's put returned answers the removed incarnation.
//
// UnrelatedPutHeld: a's re-put of a removed key is held; a put of a fresh
// key on the same client meanwhile waits for it (the client sends one
// coalesced BatchPutEnd at a time, and the master holds the whole batch).
func TestReview13TombHoles(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	const lease = 3 * time.Second
	m := startMaster(t, ctx, t.TempDir(), "--lease-ttl", lease.String())
	startStore(t, ctx, "s1", m.grpc, "dram:64MiB")
	a, b, bystander := newClient(t, m.grpc), newClient(t, m.grpc), newClient(t, m.grpc)
	put := func(c *client.Client, key string, gen int) {
		t.Helper()
		if err := c.Put(ctx, key, incarnation(key, gen)); err != nil {
			t.Fatalf("put %s #%d: %v", key, gen, err)
		}
	}
	lookupSum := func(c *client.Client, key string) (uint32, error) {
		mt, err := c.Lookup(ctx, []string{key})
		if err != nil {
			return 0, err
		}
		if mt.Len() != 1 {
			return 0, fmt.Errorf("matched %d", mt.Len())
		}
		return mt.Blocks[0].Checksum, nil
	}

	// rePutHeld removes key on a and puts it again there, and returns once
	// the new one is published (a's put is held meanwhile), with the
	// channel its put's result comes on.
	rePutHeld := func(key string) chan error {
		t.Helper()
		if err := a.Remove(ctx, key); err != nil {
			t.Fatal(err)
		}
		held := make(chan error, 1)
		go func() { held <- a.Put(ctx, key, incarnation(key, 1)) }()
		waitFor(t, 10*time.Second, func() error {
			if n, err := b.BatchExists(ctx, []string{key}); err != nil || n != 1 {
				return fmt.Errorf("not published yet (%d, %v)", n, err)
			}
			return nil
		})
		return held
	}

	t.Run("ExistsPut", func(t *testing.T) {
		key := chainKeys(tokenBlocks(1300, 1))[0]
		put(a, key, 0)
		if sum, err := lookupSum(bystander, key); err != nil || sum != client.Checksum(incarnation(key, 0)) {
			t.Fatalf("bystander lookup: %08x, %v", sum, err)
		}
		held := rePutHeld(key) // once it is published, b's put is answered Exists
		start := time.Now()
		put(b, key, 2)
		took := time.Since(start)
		sum, err := lookupSum(bystander, key)
		if err != nil {
			t.Fatal(err)
		}
		if sum == client.Checksum(incarnation(key, 0)) {
			t.Errorf("b's put of the key returned after %v (Exists); a bystander lookup that started after it answered the removed incarnation", took.Round(time.Millisecond))
		}
		if err := <-held; err != nil {
			t.Fatal(err)
		}
	})

	t.Run("UnrelatedPutHeld", func(t *testing.T) {
		key := chainKeys(tokenBlocks(1301, 1))[0]
		fresh := chainKeys(tokenBlocks(1302, 1))[0]
		put(a, key, 0)
		if _, err := lookupSum(bystander, key); err != nil {
			t.Fatal(err)
		}
		held := rePutHeld(key)
		start := time.Now()
		put(a, fresh, 0) // never removed: nothing to wait for
		if took := time.Since(start); took > lease/3 {
			t.Errorf("a put of a fresh key took %v on a client whose re-put of a removed key is held (lease %v)", took.Round(time.Millisecond), lease)
		}
		if err := <-held; err != nil {
			t.Fatal(err)
		}
	})
}
