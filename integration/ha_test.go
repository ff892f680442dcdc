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

	"github.com/tidepool-kv/tidepool/client"
)

// put4MiB puts n values of 4 MiB named prefix/NNN from eight workers and
// returns how many were refused and the first refusal.
func put4MiB(ctx context.Context, c *client.Client, prefix string, n int) (refused int64, first error) {
	value := make([]byte, 4<<20)
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

// TestPutsRightAfterStartNotRefused is issue 12's first finding: a master
// that has just started evicted nothing for one lease TTL, so 256 puts of
// 4 MiB into `tidepool up --dram 64MiB --ssd 512MiB` started as soon as it
// answered failed from the 140th on. A leader now evicts at once what it
// made itself (it knows every lease on that); none is refused.
func TestPutsRightAfterStartNotRefused(t *testing.T) {
	ctx := t.Context()
	u := startUp(t, ctx, t.TempDir(), "--dram", "64MiB", "--ssd", "512MiB")
	c := newClient(t, u.grpc)
	start := time.Now()
	n, first := put4MiB(ctx, c, "after-start", 256)
	t.Logf("256 puts of 4 MiB into 576 MiB right after start: %v, %d refused", time.Since(start).Round(time.Millisecond), n)
	if n > 0 {
		t.Fatalf("%d of 256 puts refused; first: %v", n, first)
	}
}

// TestPutsRightAfterLeaderChangeNotRefused: the same right after the leader
// of three masters (default lease TTL) is killed, into the same 64 MiB of
// DRAM and 512 MiB of SSD, which the old leader filled: the new leader may
// not evict what the old one may have leased before one lease TTL, so the
// puts that need room wait for it instead of failing.
func TestPutsRightAfterLeaderChangeNotRefused(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	h := startMasters(t, ctx, 3)
	masters := strings.Join(h.grpc, ",")
	startStoreArgs(t, ctx, "s1", masters, "--tier", "dram:64MiB", "--tier", "ssd:"+t.TempDir()+":512MiB")
	c := newClient(t, h.grpc...)
	if n, err := put4MiB(ctx, c, "before", 160); n > 0 { // 640 MiB into 576: the first leader evicts what it made
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
	n, first := put4MiB(ctx, c, "after", 256)
	t.Logf("256 puts of 4 MiB into a full pool right after the leader change: %v, %d refused", time.Since(start).Round(time.Millisecond), n)
	if n > 0 {
		t.Fatalf("%d of 256 puts refused after the leader change; first: %v", n, first)
	}
}
