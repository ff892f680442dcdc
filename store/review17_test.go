package store_test

import (
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/engine/enginetest"
	"github.com/tidepool-kv/tidepool/master/mastertest"
	"github.com/tidepool-kv/tidepool/store"
	"github.com/tidepool-kv/tidepool/tiers"
)

// review17Tier is an SSD tier whose every read and write fails with EIO.
type review17Tier struct{ tiers.Tier }

func (f review17Tier) Segment() engine.Segment { return review17Seg{f.Tier.Segment()} }

type review17Seg struct{ engine.Segment }

func (s review17Seg) ReadAt(p []byte, off int64) (int, error) {
	return 0, fmt.Errorf("read %s: %w", s.Name(), syscall.EIO)
}

func (s review17Seg) WriteAt(p []byte, off int64) (int, error) {
	return 0, fmt.Errorf("write %s: %w", s.Name(), syscall.EIO)
}

// TestReview17FailedSegmentBackAfterReregister: a segment taken out for
// its I/O errors comes back into the pool when the same store process
// registers again (declared dead after a short cut): the node forgets the
// failure with its ioWatch, the master with node.failed, though the disk
// is no better ("a new process" is not what registers).
func TestReview17FailedSegmentBackAfterReregister(t *testing.T) {
	m := mastertest.Start(t, nil)
	cl := newClient(t, m.Addr())
	p := enginetest.NewProxy(t, m.Addr())
	n, _ := mastertest.StartStore(t, []string{p.Addr()}, "n1", 1<<20, func(cfg *store.Config) {
		cfg.HeartbeatInterval = heartbeat
		ssd, err := tiers.NewSSD("ssd0", t.TempDir(), 4<<20)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Tiers = append(cfg.Tiers, review17Tier{ssd})
	})
	w, err := client.New(client.Config{Masters: []string{m.Addr()}, Tier: "ssd", Logger: mastertest.Logger(), EngineConfig: engine.Config{NoShm: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	t.Log(w.Put(t.Context(), "k", make([]byte, 4096))) // its write fails: EIO
	waitFor(t, waitLong, "the master to take n1/ssd0@1 out", func() bool { return segments(t, cl)["n1/ssd0@1"] == nil })

	p.SetDown(true)
	waitFor(t, 5*mastertest.NodeTTL, "the master to declare the node dead", func() bool {
		return segments(t, cl)["n1/dram0@1"] == nil
	})
	p.SetDown(false)
	waitFor(t, waitLong, "the node to register again", func() bool { return n.Epoch() == 2 })
	time.Sleep(10 * heartbeat)
	if s := segments(t, cl)["n1/ssd0@2"]; s != nil {
		t.Fatalf("the failing SSD is back in the pool after the same process registered again: %v", s)
	}
}
