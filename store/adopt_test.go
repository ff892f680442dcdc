package store_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/master/mastertest"
	"github.com/tidepool-kv/tidepool/store"
	"github.com/tidepool-kv/tidepool/tiers"
)

// TestAdoptInPages: a store whose SSD index holds more objects than one
// registration carries offers them in pages; the master re-adopts every
// one, and the index sync pages through them back.
func TestAdoptInPages(t *testing.T) {
	const objects = 25_000 // two and a half pages
	m := mastertest.Start(t, nil)
	dir := t.TempDir()
	tier, err := tiers.NewSSD("ssd0", dir, objects*4096)
	if err != nil {
		t.Fatal(err)
	}
	kept := make([]tiers.SSDObject, objects)
	for i := range kept {
		kept[i] = tiers.SSDObject{Key: fmt.Sprintf("kept/%06d", i), Offset: uint64(i) * 4096, Size: 100, Checksum: uint32(i)}
	}
	if err := tier.Index().Put(kept...); err != nil {
		t.Fatal(err)
	}
	n, err := store.New(store.Config{
		ID: "s1", Masters: []string{m.Addr()}, Listen: "127.0.0.1:0", Tiers: []tiers.Tier{tier},
		HeartbeatInterval: heartbeat, IndexSyncInterval: 100 * time.Millisecond, Logger: mastertest.Logger(),
	})
	if err != nil {
		tier.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Close() })
	cl := newClient(t, m.Addr())
	waitFor(t, waitLong, "every kept object adopted", func() bool {
		for _, s := range segments(t, cl) {
			if s.Node == "s1" && s.Objects == objects {
				return true
			}
		}
		return false
	})
	// Adopted in a page after the first: readable by key.
	for _, k := range []string{"kept/000000", "kept/012345", "kept/024999"} {
		if ok, err := cl.Exists(t.Context(), k); err != nil || !ok {
			t.Fatalf("%s after adoption: %v, %v", k, ok, err)
		}
	}
	// The sync pages through the master's view: it drops the removed object
	// and keeps every other (a sync that read one page would keep 10000).
	if err := cl.Remove(t.Context(), "kept/024999"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, waitLong, "the index synced", func() bool {
		all, err := tier.Index().All()
		return err == nil && len(all) == objects-1
	})
}
