package mastertest

import (
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/store"
	"github.com/tidepool-kv/tidepool/tiers"
)

// Heartbeat is the stores' heartbeat interval unless StartStore's cfg
// changes it.
const Heartbeat = 100 * time.Millisecond

// registerTimeout bounds how long StartStore waits for a registration.
const registerTimeout = 15 * time.Second

// StartStore starts store node id with one DRAM tier "dram0" of capacity
// bytes, listening on a free loopback port and registering with masters;
// cfg, if not nil, adjusts its Config first. It waits until the node has
// registered. The node, and with it the tier, closes when the test ends;
// closing it earlier is fine.
func StartStore(t testing.TB, masters []string, id string, capacity int64, cfg func(*store.Config)) (*store.Node, *tiers.DRAMTier) {
	t.Helper()
	tier, err := tiers.NewDRAM("dram0", capacity)
	if err != nil {
		t.Fatal(err)
	}
	c := store.Config{
		ID: id, Masters: masters, Listen: "127.0.0.1:0", Tiers: []tiers.Tier{tier},
		HeartbeatInterval: Heartbeat, Logger: Logger(),
	}
	if cfg != nil {
		cfg(&c)
	}
	n, err := store.New(c)
	if err != nil {
		tier.Close()
		t.Fatalf("store %s: %v", id, err)
	}
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Errorf("close store %s: %v", id, err)
		}
	})
	select {
	case <-n.Registered():
	case <-time.After(registerTimeout):
		t.Fatalf("store %s did not register within %v", id, registerTimeout)
	}
	return n, tier
}
