//go:build linux

package integration

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestPutsRightAfterStartNotRefused is issue 12's first finding: a master
// that has just started evicted nothing for one lease TTL, so 256 puts of
// 4 MiB into `tidepool up --dram 64MiB --ssd 512MiB` started as soon as it
// answered failed from the 140th on. A leader now evicts at once what it
// made itself (it knows every lease on that); none is refused.
func TestPutsRightAfterStartNotRefused(t *testing.T) {
	ctx := t.Context()
	u := startUp(t, ctx, t.TempDir(), "--dram", "64MiB", "--ssd", "512MiB")
	c := newClient(t, u.grpc)
	value := make([]byte, 4<<20)
	const n, workers = 256, 8
	var next, failed atomic.Int64
	var first sync.Once
	var firstErr error
	start := time.Now()
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := next.Add(1) - 1; i < n; i = next.Add(1) - 1 {
				if err := c.Put(ctx, fmt.Sprintf("after-start/%03d", i), value); err != nil {
					failed.Add(1)
					first.Do(func() { firstErr = fmt.Errorf("put %d: %w", i, err) })
				}
			}
		})
	}
	wg.Wait()
	t.Logf("%d puts of 4 MiB into 576 MiB right after start: %v, %d refused", n, time.Since(start).Round(time.Millisecond), failed.Load())
	if failed.Load() > 0 {
		t.Fatalf("%d of %d puts refused; first: %v", failed.Load(), n, firstErr)
	}
}

// TestPutsRightAfterLeaderChangeNotRefused: the same, right after the
// leader of three masters is killed, into a pool the old leader filled: the
// new leader may not evict what the old one may have leased before one
// lease TTL, so the puts wait for it instead of failing.
func TestPutsRightAfterLeaderChangeNotRefused(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	const lease = 3 * time.Second
	h := startMasters(t, ctx, 3, "--lease-ttl", lease.String())
	masters := strings.Join(h.grpc, ",")
	startStore(t, ctx, "s1", masters, "dram:64MiB")
	c := newClient(t, h.grpc...)
	value := make([]byte, 4<<20)
	put := func(prefix string, n int) (refused int64, first error) {
		var next, failed atomic.Int64
		var once sync.Once
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				for i := next.Add(1) - 1; i < int64(n); i = next.Add(1) - 1 {
					if err := c.Put(ctx, fmt.Sprintf("%s/%03d", prefix, i), value); err != nil {
						failed.Add(1)
						once.Do(func() { first = fmt.Errorf("put %d: %w", i, err) })
					}
				}
			})
		}
		wg.Wait()
		return failed.Load(), first
	}
	if n, err := put("before", 32); n > 0 { // 128 MiB into 64: the first leader evicts what it made
		t.Fatalf("%d puts refused before the leader change; first: %v", n, err)
	}
	st, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var old int
	if _, err := fmt.Sscanf(st.LeaderId, "m%d", &old); err != nil || old < 1 || old > 3 {
		t.Fatalf("leader id %q", st.LeaderId)
	}
	h.procs[old-1].kill(t)
	waitFor(t, 30*time.Second, func() error {
		st, err := c.Status(ctx)
		if err != nil || st.LeaderId == "" || st.LeaderId == fmt.Sprintf("m%d", old) {
			return fmt.Errorf("no new leader yet (%v)", err)
		}
		return nil
	})
	start := time.Now()
	n, first := put("after", 16)
	t.Logf("16 puts of 4 MiB into a full pool right after the leader change: %v (lease %v), %d refused", time.Since(start).Round(time.Millisecond), lease, n)
	if n > 0 {
		t.Fatalf("%d of 16 puts refused after the leader change; first: %v", n, first)
	}
}
