package master

import (
	"context"
	"fmt"
	"testing"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// BenchmarkLeaderBatchPut128 is the leader's share of a batch put of 128
// tiny values, as `tidepool bench meta` sends it, called directly (no
// sockets): BatchPutStart, then BatchPutEnd without replicas and with
// sparse results. The end's raft round writes the log to a temporary
// directory, fsync included; start-ns/op is the BatchPutStart alone. The
// table grows as a bench row's does.
func BenchmarkLeaderBatchPut128(b *testing.B) {
	const n, size = 128, 64
	c := newCluster(b, 1, nil)
	m := c.leader()
	register(b, m, "s", "ep", dram("a", 1<<40))
	ms := &masterService{s: m.srv}
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	var seq int
	var startTime time.Duration
	b.ReportAllocs()
	for b.Loop() {
		starts := make([]pb.PutStartRequest, n)
		req := &pb.BatchPutStartRequest{Items: make([]*pb.PutStartRequest, n)}
		for i := range starts {
			seq++
			r := &starts[i]
			r.Key, r.Size, r.Tier = fmt.Sprintf("bench/%09d", seq), size, pb.Tier_TIER_DRAM
			req.Items[i] = r
		}
		t := time.Now()
		resp, err := ms.BatchPutStart(ctx, req)
		startTime += time.Since(t)
		if err != nil {
			b.Fatal(err)
		}
		ends := make([]pb.PutEndItem, n)
		end := &pb.BatchPutEndRequest{SparseResults: true, Items: make([]*pb.PutEndItem, n)}
		for i, r := range resp.Results {
			if r.Status.GetCode() != 0 {
				b.Fatalf("put start %q: %s", starts[i].Key, r.Status.GetMessage())
			}
			e := &ends[i]
			e.Key, e.PutId, e.Size = starts[i].Key, r.PutId, size
			end.Items[i] = e
		}
		if _, err := ms.BatchPutEnd(ctx, end); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(startTime.Nanoseconds())/float64(b.N), "start-ns/op")
}
