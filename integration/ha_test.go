//go:build linux

package integration

import (
	"fmt"
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
