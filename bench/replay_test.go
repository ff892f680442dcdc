package bench_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/tidepool-kv/tidepool/bench"
	"github.com/tidepool-kv/tidepool/bench/trace"
	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
	"github.com/tidepool-kv/tidepool/master/mastertest"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestReplay replays a generated trace against an in-process master and
// store: with room for every block the pool hits exactly what LRU does
// (every repeat), with room for few it hits less, but no less than LRU,
// and nothing is left.
func TestReplay(t *testing.T) {
	m := mastertest.Start(t, nil)
	mastertest.StartStore(t, []string{m.Addr()}, "s0", 64<<20, nil)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	conn, err := leaderconn.Dial([]string{m.Addr()}, leaderconn.Credentials{})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	reqs := trace.Generate(trace.GenConfig{Requests: 150, Seed: 5})
	distinct := trace.Distinct(reqs)
	cfg := bench.ReplayConfig{
		Client: client.Config{Masters: []string{m.Addr()}},
		Admin: func(ctx context.Context, call func(pb.AdminClient) error) error {
			return conn.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, _ ...grpc.CallOption) error {
				return call(pb.NewAdminClient(cc))
			})
		},
		Trace: reqs, Capacities: []int{distinct / 20, distinct + 10}, BlockBytes: 4096, PrefillUsPerToken: 0.1,
	}
	rows, err := bench.Replay(ctx, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	small, all := rows[0], rows[1]
	for _, r := range rows {
		// Under a small quota every object of the tenant may be read-leased
		// (a replay reads them within a lease TTL): they are evicted too.
		if r.Errors != 0 || r.Pool.Requests != len(reqs) || r.Pool.Blocks != r.LRU.Blocks {
			t.Errorf("row %+v", r)
		}
	}
	if all.Pool.HitBlocks != all.LRU.HitBlocks || all.LRU.HitBlocks != all.Belady.HitBlocks {
		t.Errorf("with room for all: pool %d hit blocks, LRU %d, Belady %d", all.Pool.HitBlocks, all.LRU.HitBlocks, all.Belady.HitBlocks)
	}
	if small.Pool.HitBlocks >= all.Pool.HitBlocks || small.Pool.HitBlocks < small.LRU.HitBlocks || small.Belady.HitBlocks < small.LRU.HitBlocks {
		t.Errorf("room for %d of %d blocks: pool %d hit blocks (all: %d), LRU %d, Belady %d",
			small.Capacity, distinct, small.Pool.HitBlocks, all.Pool.HitBlocks, small.LRU.HitBlocks, small.Belady.HitBlocks)
	}
	t.Logf("%d distinct blocks; at %d: pool %.3f, LRU %.3f, Belady %.3f", distinct, small.Capacity,
		small.Pool.BlockHitRate(), small.LRU.BlockHitRate(), small.Belady.BlockHitRate())
	c, err := client.New(client.Config{Masters: []string{m.Addr()}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	waitEmpty := time.Now().Add(10 * time.Second)
	for {
		left, err := c.List(ctx, "replay/")
		if err == nil && len(left) == 0 {
			break
		}
		if time.Now().After(waitEmpty) {
			t.Fatalf("left behind: %d objects, %v", len(left), err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
