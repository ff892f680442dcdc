package client

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"weak"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// review8Master answers lookups of the keys that start with "hit" (a
// prefix of them), each block of 100 bytes on one segment. old makes it a
// master built before packed keys: it reads Keys only and refuses a
// request without them, as validKeys did.
type review8Master struct {
	pb.UnimplementedMasterServer
	old bool
}

func (m *review8Master) Lookup(ctx context.Context, req *pb.LookupRequest) (*pb.LookupResponse, error) {
	keys := req.Keys
	if !m.old {
		var err error
		if keys, err = req.ChainKeys(16384); err != nil {
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
	}
	if len(keys) == 0 {
		return nil, status.Error(codes.InvalidArgument, "invalid request: no keys")
	}
	n := 0
	for n < len(keys) && strings.HasPrefix(keys[n], "hit") {
		n++
	}
	if req.CountOnly {
		return &pb.LookupResponse{Matched: uint32(n)}, nil
	}
	resp := &pb.LookupResponse{Matched: uint32(n), LeaseTtlMs: 60_000,
		Segments: []*pb.Replica{{Segment: "seg", Node: "s0", Endpoint: "127.0.0.1:1", Tier: pb.Tier_TIER_DRAM}}}
	for i := range n {
		// Block "hit/%05d" k is at k*100, however much of the chain a
		// lookup asks (the client's cache may answer a leading part).
		var k uint64
		fmt.Sscanf(keys[i], "hit/%d", &k)
		resp.Sizes = append(resp.Sizes, 100)
		resp.Checksums = append(resp.Checksums, uint32(k))
		resp.ReplicaCounts = append(resp.ReplicaCounts, 1)
		resp.ReplicaSegments = append(resp.ReplicaSegments, 0)
		resp.ReplicaOffsets = append(resp.ReplicaOffsets, k*100)
	}
	return resp, nil
}

func review8Client(t *testing.T, m *review8Master) *Client {
	t.Helper()
	return fakeMasterClient(t, m)
}

func review8Chain(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("hit/%05d", i)
	}
	return keys
}

// TestReview8CachedKeyPinsAgentRequest: a caller may pass Client.Lookup
// keys that are views of a larger buffer (the agent's packed request);
// the descriptor cache must keep its own copy of a block's key, or a
// 4-byte hit would keep ~4 MiB of missed keys alive for the lease.
func TestReview8CachedKeyPinsAgentRequest(t *testing.T) {
	c := review8Client(t, &review8Master{})
	pin := func(drop bool) weak.Pointer[byte] {
		keys := []string{"hit0"}
		for i := range 1000 {
			keys = append(keys, fmt.Sprintf("miss/%04d/%s", i, strings.Repeat("m", 4000)))
		}
		sent := &pb.LookupRequest{}
		sent.PackKeys(keys)
		wire, err := proto.Marshal(sent)
		if err != nil {
			t.Fatal(err)
		}
		got := &pb.LookupRequest{} // what the agent's handler is given
		if err := proto.Unmarshal(wire, got); err != nil {
			t.Fatal(err)
		}
		views, err := got.ChainKeys(16384)
		if err != nil {
			t.Fatal(err)
		}
		if m, err := c.Lookup(context.Background(), views); err != nil || m.Len() != 1 {
			t.Fatalf("lookup: %d, %v", m.Len(), err)
		}
		c.descs.Wait()
		if _, ok := c.descs.Get("hit0"); !ok {
			t.Skip("the cache did not admit the block")
		}
		if drop {
			c.descs.Del("hit0")
			c.descs.Wait()
		}
		return weak.Make(&got.PackedKeys[0])
	}
	wp := pin(true) // control: nothing cached, the request is freed
	runtime.GC()
	runtime.GC()
	if wp.Value() != nil {
		t.Fatal("control: the request is alive with nothing cached; the test cannot tell")
	}
	wp = pin(false)
	runtime.GC()
	runtime.GC()
	if wp.Value() != nil {
		t.Error("the cached 4-byte key keeps the agent's whole ~4 MiB request alive")
	}
}

// TestReview8LookupAgainstOldMaster: a master built before packed keys
// sees none in a packed request and refuses it with InvalidArgument; the
// client then lists its keys, so lookups and BatchExists keep working
// when clients are upgraded before masters.
func TestReview8LookupAgainstOldMaster(t *testing.T) {
	c := review8Client(t, &review8Master{old: true})
	chain := review8Chain(4)
	if m, err := c.Lookup(context.Background(), chain); err != nil || m.Len() != 4 {
		t.Errorf("lookup against a master without packed keys: %d, %v; want 4", m.Len(), err)
	}
	if n, err := c.BatchExists(context.Background(), chain); err != nil || n != 4 {
		t.Errorf("batch exists against a master without packed keys: %d, %v; want 4", n, err)
	}
}

// TestReview8ReplicasAreFresh: Replicas builds the copies on every call, so a caller that changes one (as readReplicas may order
// them) does not change the cached block; the fields match the columns.
func TestReview8ReplicasAreFresh(t *testing.T) {
	c := review8Client(t, &review8Master{})
	chain := review8Chain(3)
	m, err := c.Lookup(context.Background(), chain)
	if err != nil || m.Len() != 3 {
		t.Fatalf("lookup: %d, %v", m.Len(), err)
	}
	b := m.Blocks[2]
	r := b.Replicas()
	if len(r) != 1 || r[0].Segment != "seg" || r[0].Offset != 200 || r[0].Length != 100 || r[0].Tier != pb.Tier_TIER_DRAM {
		t.Fatalf("replicas %v", r)
	}
	r[0].Offset = 7
	if again := b.Replicas(); again[0].Offset != 200 {
		t.Fatalf("a change to one call's replicas shows in the next: offset %d", again[0].Offset)
	}
	// A second lookup is answered from the cache, with the same replicas.
	m2, err := c.Lookup(context.Background(), chain)
	if err != nil || m2.Len() != 3 || m2.Blocks[2].Replicas()[0].Offset != 200 {
		t.Fatalf("cached lookup: %d, %v", m2.Len(), err)
	}
}

// TestLookupPooledRequests: concurrent lookups of chains of different
// lengths share pooled requests (their packed buffers) and each gets the
// answer to its own chain, as does a chain too long to pool.
func TestLookupPooledRequests(t *testing.T) {
	c := review8Client(t, &review8Master{})
	c.descs.Close() // every lookup asks the master
	c.descs = nil
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 100 {
				hits := (g*31 + i*7) % 50
				chain := review8Chain(hits)
				for j := range 3 {
					chain = append(chain, fmt.Sprintf("miss/%d/%d/%d", g, i, j))
				}
				if n, err := c.BatchExists(context.Background(), chain); err != nil || n != hits {
					t.Errorf("BatchExists of %d hits: %d, %v", hits, n, err)
					return
				}
			}
		})
	}
	wg.Wait()
	long := review8Chain(2)
	for i := 0; len(long)*4000 <= maxPooledKeyBytes; i++ {
		long = append(long, fmt.Sprintf("miss/%d/%s", i, strings.Repeat("m", 4000)))
	}
	if n, err := c.BatchExists(context.Background(), long); err != nil || n != 2 {
		t.Fatalf("a chain past the pool's bound: %d, %v", n, err)
	}
	if n, err := c.BatchExists(context.Background(), review8Chain(3)); err != nil || n != 3 {
		t.Fatalf("after it: %d, %v", n, err)
	}
}
