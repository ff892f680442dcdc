package client_test

import (
	"bytes"
	"errors"
	"fmt"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/master/mastertest"
	"github.com/tidepool-kv/tidepool/store"
	"github.com/tidepool-kv/tidepool/tiers"
)

// failingTier is an SSD tier whose reads and writes fail with EIO once
// fail is set, as a dying disk's do.
type failingTier struct {
	tiers.Tier
	fail *atomic.Bool
}

func (f failingTier) Segment() engine.Segment { return failingSegment{f.Tier.Segment(), f.fail} }

type failingSegment struct {
	engine.Segment
	fail *atomic.Bool
}

func (s failingSegment) ReadAt(p []byte, off int64) (int, error) {
	if s.fail.Load() {
		return 0, fmt.Errorf("read %s: %w", s.Name(), syscall.EIO)
	}
	return s.Segment.ReadAt(p, off)
}

func (s failingSegment) WriteAt(p []byte, off int64) (int, error) {
	if s.fail.Load() {
		return 0, fmt.Errorf("write %s: %w", s.Name(), syscall.EIO)
	}
	return s.Segment.WriteAt(p, off)
}

// TestSSDTierIOErrors: an SSD tier starts failing its reads and writes.
// Gets of objects with another replica are served from it; the store
// reports the segment on its next heartbeat and the master takes it out:
// objects with a replica left elsewhere keep it (and read back), objects
// it alone held are dropped as lost (not found, never wrong bytes), and
// new SSD puts go elsewhere. Nothing else breaks.
func TestSSDTierIOErrors(t *testing.T) {
	var fail atomic.Bool
	c := newCluster(t, clusterOpts{stores: []storeSpec{{id: "b"}}})
	ssdOf := func(id string, faulty bool) func(*store.Config) {
		return func(cfg *store.Config) {
			ssd, err := tiers.NewSSD("ssd0", t.TempDir(), 32<<20)
			if err != nil {
				t.Fatal(err)
			}
			var tier tiers.Tier = ssd
			if faulty {
				tier = failingTier{ssd, &fail}
			}
			cfg.Tiers = append(cfg.Tiers, tier)
		}
	}
	mastertest.StartStore(t, []string{c.addr}, "a", 64<<20, ssdOf("a", true))
	mastertest.StartStore(t, []string{c.addr}, "s", 64<<20, ssdOf("s", false))
	cl, err := client.New(client.Config{Masters: []string{c.addr}, Tier: "ssd", Logger: mastertest.Logger(), EngineConfig: engine.Config{NoShm: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	ctx := testCtx(t)

	vals := map[string][]byte{}
	var twice, once []string
	for i := range 24 {
		k := fmt.Sprintf("k/%02d", i)
		vals[k] = value(uint64(i), 16<<10)
		replicas := 1 + i%2
		if errs := cl.BatchPutWith(ctx, []string{k}, [][]byte{vals[k]}, client.PutOptions{Replicas: replicas}); errs[0] != nil {
			t.Fatal(errs[0])
		}
	}
	infos, err := cl.List(ctx, "k/")
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range infos {
		onA := false
		for _, r := range o.Replicas {
			onA = onA || r.Segment == "a/ssd0@1"
		}
		switch {
		case onA && len(o.Replicas) == 2:
			twice = append(twice, o.Key)
		case onA:
			once = append(once, o.Key)
		}
	}
	if len(twice) == 0 || len(once) == 0 {
		t.Fatalf("a's SSD holds %d objects with another replica and %d without; want some of each", len(twice), len(once))
	}

	fail.Store(true)
	for _, k := range twice {
		if got, err := cl.Get(ctx, k); err != nil || !bytes.Equal(got, vals[k]) {
			t.Fatalf("get %s, with another replica, while a's SSD fails: %d bytes, %v", k, len(got), err)
		}
	}
	waitFor(t, startTimeout, "a's SSD taken out of the pool", func() bool {
		st, err := cl.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range st.Segments {
			if s.Name == "a/ssd0@1" {
				return false
			}
		}
		return true
	})
	for _, k := range twice {
		if got, err := cl.Get(ctx, k); err != nil || !bytes.Equal(got, vals[k]) {
			t.Fatalf("get %s after a's SSD was taken out: %d bytes, %v", k, len(got), err)
		}
	}
	for _, k := range once {
		if got, err := cl.Get(ctx, k); !errors.Is(err, client.ErrNotFound) {
			t.Fatalf("get %s, lost with a's SSD: %d bytes, %v; want ErrNotFound", k, len(got), err)
		}
	}
	for i := range 8 {
		k := fmt.Sprintf("after/%d", i)
		if err := cl.Put(ctx, k, vals["k/00"]); err != nil {
			t.Fatalf("put after a's SSD failed: %v", err)
		}
	}
	infos, err = cl.List(ctx, "after/")
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range infos {
		for _, r := range o.Replicas {
			if r.Segment == "a/ssd0@1" {
				t.Fatalf("%s placed on the failed segment", o.Key)
			}
		}
	}
}
