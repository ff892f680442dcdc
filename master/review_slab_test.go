package master

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// slabCheck ends the puts of a BatchPutStart answer (without replicas, as
// the client does) and checks that each key was published where its start
// said, and that no two puts were given the same bytes.
func slabCheck(t *testing.T, m *member, keys []string, size uint64, resp *pb.BatchPutStartResponse) {
	t.Helper()
	type at struct {
		seg string
		off uint64
	}
	seen := map[at]string{}
	end := &pb.BatchPutEndRequest{}
	for i, r := range resp.Results {
		if r.Status.GetCode() != 0 || r.Exists {
			t.Fatalf("start %q: %v", keys[i], r)
		}
		if len(r.Reservations) != len(r.Replicas) {
			t.Fatalf("start %q: %d reservations for %d replicas", keys[i], len(r.Reservations), len(r.Replicas))
		}
		for _, rep := range r.Replicas {
			if k, ok := seen[at{rep.Segment, rep.Offset}]; ok {
				t.Fatalf("%q and %q were both placed at %s+%d", k, keys[i], rep.Segment, rep.Offset)
			}
			seen[at{rep.Segment, rep.Offset}] = keys[i]
		}
		end.Items = append(end.Items, &pb.PutEndItem{Key: keys[i], PutId: r.PutId, Size: size})
	}
	er, err := m.master().BatchPutEnd(rpcCtx(t), end)
	if err != nil {
		t.Fatal(err)
	}
	for i, st := range er.Results {
		if st.Code != 0 {
			t.Fatalf("end %q: %v", keys[i], st)
		}
	}
	gr, err := m.master().GetReplicas(rpcCtx(t), &pb.KeysRequest{Keys: keys})
	if err != nil {
		t.Fatal(err)
	}
	for i, o := range gr.Results {
		want := resp.Results[i].Replicas
		if o.Status.GetCode() != 0 || len(o.Replicas) != len(want) {
			t.Fatalf("%q published as %v, started as %v", keys[i], o, want)
		}
		for j := range want {
			if o.Replicas[j].Segment != want[j].Segment || o.Replicas[j].Offset != want[j].Offset {
				t.Fatalf("%q replica %d published at %s+%d, started at %s+%d", keys[i], j,
					o.Replicas[j].Segment, o.Replicas[j].Offset, want[j].Segment, want[j].Offset)
			}
		}
	}
}

// TestReviewSlabTwoReplicas: puts of two replicas each keep their first
// extent in the batch's records and the second outside; each is published
// where its start said.
func TestReviewSlabTwoReplicas(t *testing.T) {
	c := newCluster(t, 1, nil)
	m := c.leader()
	register(t, m, "s1", "ep1", dram("a", 1<<30))
	register(t, m, "s2", "ep2", dram("a", 1<<30))
	var keys []string
	req := &pb.BatchPutStartRequest{}
	for i := range 6 {
		keys = append(keys, fmt.Sprintf("two/%d", i))
		req.Items = append(req.Items, &pb.PutStartRequest{Key: keys[i], Size: 4096, Replicas: 2})
	}
	resp, err := m.master().BatchPutStart(rpcCtx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range resp.Results {
		if len(r.Replicas) != 2 || r.Replicas[0].Node == r.Replicas[1].Node {
			t.Fatalf("%q: %v", keys[i], r.Replicas)
		}
	}
	slabCheck(t, m, keys, 4096, resp)
}

// TestReviewSlabEvictRetry: puts into a full segment place again after
// makeRoom, reusing their record's first extent.
func TestReviewSlabEvictRetry(t *testing.T) {
	e := newEvictEnv(t, nil)
	const size = 64 * kib
	batchPut(t, e.m, size, keyNames("old", segCap/size)...)
	e.waitEvictable(t)
	keys := keyNames("new", 6)
	req := &pb.BatchPutStartRequest{}
	for _, k := range keys {
		req.Items = append(req.Items, &pb.PutStartRequest{Key: k, Size: size})
	}
	resp, err := e.m.master().BatchPutStart(rpcCtx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	slabCheck(t, e.m, keys, size, resp)
	if n := e.evictions(t, "allocation"); n == 0 {
		t.Fatalf("no put evicted: the retry after makeRoom was not taken")
	}
}

// TestReviewSlabConcurrentExpiry: batches placed while the sweep expires
// puts, and others end them by key (run with -race).
func TestReviewSlabConcurrentExpiry(t *testing.T) {
	c := newCluster(t, 1, func(cfg *Config) {
		cfg.PutTimeout = 20 * time.Millisecond
		cfg.SweepInterval = time.Millisecond
	})
	m := c.leader()
	register(t, m, "s", "ep", dram("a", 1<<30))
	ms := &masterService{s: m.srv}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for b := range 30 {
				req := &pb.BatchPutStartRequest{}
				for i := range 16 {
					req.Items = append(req.Items, &pb.PutStartRequest{Key: fmt.Sprintf("c/%d/%d/%d", g, b, i), Size: 100})
				}
				done := make(chan struct{})
				go func() { // ends by key, racing the start's answer
					defer close(done)
					end := &pb.BatchPutEndRequest{}
					for _, it := range req.Items {
						end.Items = append(end.Items, &pb.PutEndItem{Key: it.Key, Size: 100})
					}
					ms.BatchPutEnd(ctx, end)
				}()
				resp, err := ms.BatchPutStart(ctx, req)
				if err != nil {
					t.Error(err)
					return
				}
				for _, r := range resp.Results {
					_ = fmt.Sprint(r.Reservations, r.Replicas, r.PutId)
				}
				<-done
			}
		})
	}
	wg.Wait()
}
