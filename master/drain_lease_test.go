package master

import (
	"testing"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestDrainWaitsForLeases: a drain copy's CopyEnd drops the source
// replica with its space kept until the key's leases end; the node is
// taken out only then, since a drained store unregisters its segments at
// once and a reader inside its lease must still find the old replica.
func TestDrainWaitsForLeases(t *testing.T) {
	t.Parallel()
	e := newTierEnv(t, func(cfg *Config) { cfg.LeaseTTL = 5 * time.Second })
	m := e.m
	fa := startFakeStore(t, m, "a", reportOK, dram("a", segCap))
	putBatch(t, m, sized(64*kib, nil, "x")...)
	startFakeStore(t, m, "b", reportOK, dram("a", segCap))
	e.skew.Add(int64(6 * time.Second)) // past leaderSince + LeaseTTL
	resp, err := m.master().GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: []string{"x"}})
	if err != nil || len(resp.Results[0].Replicas) != 1 || resp.Results[0].Replicas[0].Node != "a" {
		t.Fatalf("get x: %v %v", resp, err)
	}
	leaseEnd := m.srv.cfg.Now().Add(m.srv.cfg.LeaseTTL)
	if _, err := drainOnce(t, e.admin(), &pb.DrainRequest{Node: "a"}); err != nil {
		t.Fatal(err)
	}
	if now := m.srv.cfg.Now(); m.srv.fsm.drained("a", fa.epoch) && now.Before(leaseEnd) {
		t.Fatalf("node a drained (its store unregisters its segments) at %v, while the lease on x's replica on a runs until %v",
			now.Format(time.StampMilli), leaseEnd.Format(time.StampMilli))
	}
}
