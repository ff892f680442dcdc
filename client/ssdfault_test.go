package client_test

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/master/mastertest"
	"github.com/tidepool-kv/tidepool/store"
	"github.com/tidepool-kv/tidepool/tiers"
	"github.com/tidepool-kv/tidepool/tiers/tierstest"
)

// TestSSDTierIOErrors: the disk under an SSD tier starts failing (a FUSE
// filesystem answers its data file's reads, writes and syncs with EIO).
// Gets of objects with another replica are served from it, whether the
// client reads the file itself (same host) or asks the store over the
// rails; the store sees the error either way (a same-host read that fails
// falls over to the rails), reports the segment on its next heartbeat, and
// the master takes it out: objects with a replica left elsewhere keep it
// (and read back), objects it alone held are dropped as lost (not found,
// never wrong bytes), and new SSD puts go elsewhere. Nothing else breaks.
func TestSSDTierIOErrors(t *testing.T) {
	for _, tc := range []struct {
		name  string
		noShm bool
	}{{"same host", false}, {"rails", true}} {
		t.Run(tc.name, func(t *testing.T) { testSSDTierIOErrors(t, tc.noShm) })
	}
}

func testSSDTierIOErrors(t *testing.T, noShm bool) {
	disk := tierstest.MountFaultFS(t)
	c := newCluster(t, clusterOpts{stores: []storeSpec{{id: "b"}}})
	ssdOf := func(dir string) func(*store.Config) {
		return func(cfg *store.Config) {
			ssd, err := tiers.NewSSD("ssd0", dir, 32<<20)
			if err != nil {
				t.Fatal(err)
			}
			cfg.Tiers = append(cfg.Tiers, ssd)
		}
	}
	mastertest.StartStore(t, []string{c.addr}, "a", 64<<20, ssdOf(disk.Dir))
	// Healed before a's store closes (cleanups run last first), so its
	// closing sync succeeds.
	t.Cleanup(func() { disk.Fail(nil) })
	mastertest.StartStore(t, []string{c.addr}, "s", 64<<20, ssdOf(t.TempDir()))
	cl, err := client.New(client.Config{Masters: []string{c.addr}, Tier: "ssd", Logger: mastertest.Logger(), EngineConfig: engine.Config{NoShm: noShm}})
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

	if io := cl.Engine().FileIO(); (io != engine.FileIO{}) == noShm {
		t.Fatalf("same-host file I/O %+v with NoShm %v", io, noShm)
	}
	disk.Fail(dataFile)
	for _, k := range twice {
		if got, err := cl.Get(ctx, k); err != nil || !bytes.Equal(got, vals[k]) {
			t.Fatalf("get %s, with another replica, while a's SSD fails: %d bytes, %v", k, len(got), err)
		}
	}
	waitFor(t, startTimeout, "a's SSD taken out of the pool", func() bool { return !hasSegment(t, cl, "a/ssd0@1") })
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

// TestSSDTierSyncError: a disk that fails while nothing reads or writes it
// is caught by the store's next index sync (a failed fdatasync may have
// dropped written pages) and taken out of the pool the same way.
func TestSSDTierSyncError(t *testing.T) {
	disk := tierstest.MountFaultFS(t)
	c := newCluster(t, clusterOpts{})
	mastertest.StartStore(t, []string{c.addr}, "a", 64<<20, func(cfg *store.Config) {
		ssd, err := tiers.NewSSD("ssd0", disk.Dir, 32<<20)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Tiers = append(cfg.Tiers, ssd)
		cfg.IndexSyncInterval = 50 * time.Millisecond
	})
	t.Cleanup(func() { disk.Fail(nil) })
	cl := c.newClient()
	ctx := testCtx(t)
	waitFor(t, startTimeout, "a's SSD in the pool", func() bool { return hasSegment(t, cl, "a/ssd0@1") })
	disk.Fail(dataFile)
	waitFor(t, startTimeout, "a's SSD taken out of the pool", func() bool { return !hasSegment(t, cl, "a/ssd0@1") })
	if err := cl.Put(ctx, "after", value(1, 4<<10)); err != nil {
		t.Fatalf("put after a's SSD failed: %v", err)
	}
}

// dataFile matches an SSD tier's data file, not its index.
func dataFile(path string) bool { return strings.HasSuffix(path, ".data") }

func hasSegment(t *testing.T, cl *client.Client, name string) bool {
	t.Helper()
	st, err := cl.Status(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range st.Segments {
		if s.Name == name {
			return true
		}
	}
	return false
}
