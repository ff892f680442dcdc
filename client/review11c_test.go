package client

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/engine"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// review11cMaster answers every lookup whole (each block 4 KiB at offset
// 0 of one engine segment, checksum as last put, else 7, leased for a
// minute), places every put there and publishes it on BatchPutEnd.
type review11cMaster struct {
	pb.UnimplementedMasterServer
	endpoint string
	mu       sync.Mutex
	sums     map[string]uint32
	putID    uint64
}

func (m *review11cMaster) Lookup(ctx context.Context, req *pb.LookupRequest) (*pb.LookupResponse, error) {
	keys, err := req.ChainKeys(16384)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	resp := &pb.LookupResponse{Matched: uint32(len(keys)), LeaseTtlMs: 60_000,
		Segments: []*pb.Replica{{Segment: "seg", Node: "s0", Endpoint: m.endpoint, Tier: pb.Tier_TIER_DRAM}}}
	for _, k := range keys {
		sum, ok := m.sums[k]
		if !ok {
			sum = 7
		}
		resp.Sizes = append(resp.Sizes, 4096)
		resp.Checksums = append(resp.Checksums, sum)
		resp.ReplicaCounts = append(resp.ReplicaCounts, 1)
		resp.ReplicaSegments = append(resp.ReplicaSegments, 0)
		resp.ReplicaOffsets = append(resp.ReplicaOffsets, 0)
	}
	return resp, nil
}

func (m *review11cMaster) BatchPutStart(ctx context.Context, req *pb.BatchPutStartRequest) (*pb.BatchPutStartResponse, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	resp := &pb.BatchPutStartResponse{}
	for _, it := range req.Items {
		m.putID++
		resp.Results = append(resp.Results, &pb.PutStartResult{Status: &pb.ItemStatus{}, PutId: m.putID, WriteTimeoutMs: 10_000,
			Replicas: []*pb.Replica{{Segment: "seg", Node: "s0", Endpoint: m.endpoint, Offset: 0, Length: it.Size, Tier: pb.Tier_TIER_DRAM}}})
	}
	return resp, nil
}

func (m *review11cMaster) BatchPutEnd(ctx context.Context, req *pb.BatchPutEndRequest) (*pb.BatchPutEndResponse, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	resp := &pb.BatchPutEndResponse{}
	for _, it := range req.Items {
		if m.sums == nil {
			m.sums = map[string]uint32{}
		}
		m.sums[it.Key] = it.Checksum
		resp.Results = append(resp.Results, &pb.ItemStatus{})
	}
	return resp, nil
}

// TestReview11cRePutRightAfterLookup: BatchPutWith drops the cached
// descriptor of a key it put only if GetTTL finds it (client.go, the
// deferred drop). A descriptor the client's last lookup is still
// caching, its Set queued in ristretto's buffer behind the rest of the
// chain, is not found, so no Del is queued behind the Set, and when the
// Set lands the old incarnation is served for the rest of its lease:
// the client's next lookup of the key it has just put answers the old
// checksum. (An unconditional Del would queue behind the Set, as the
// removals comment describes.) The lookup here is of a long chain whose
// last block is the one put again, as a prefix cache's lookups are.
func TestReview11cRePutRightAfterLookup(t *testing.T) {
	m := &review11cMaster{endpoint: servePeer(t, engine.NewMemSegment("seg", make([]byte, 1<<20)))}
	c := fakeMasterClient(t, m)
	c.setWriteTimeout(10e9)
	ctx := context.Background()
	const rounds, chainLen = 10, 16384
	stale := 0
	for round := range rounds {
		chain := make([]string, chainLen)
		for i := range chain {
			chain[i] = fmt.Sprintf("r11c/%d/%05d", round, i)
		}
		key := chain[len(chain)-1]
		if mt, err := c.Lookup(ctx, chain); err != nil || mt.Len() != len(chain) {
			t.Fatalf("lookup: %d, %v", mt.Len(), err)
		}
		// Another client removed the key meanwhile (the master says
		// nothing of it to this one), and this client puts it again.
		val := bytes.Repeat([]byte{byte(round + 1)}, 4096)
		if err := c.Put(ctx, key, val); err != nil {
			t.Fatal(err)
		}
		c.descs.Wait()
		mt, err := c.Lookup(ctx, []string{key})
		if err != nil || mt.Len() != 1 {
			t.Fatalf("lookup after the put: %d, %v", mt.Len(), err)
		}
		if got, want := mt.Blocks[0].Checksum, Checksum(val); got != want {
			stale++
			t.Logf("round %d: the lookup after this client's own put answered checksum %08x (the cached incarnation), want %08x", round, got, want)
		}
	}
	if stale > 0 {
		t.Fatalf("%d of %d lookups right after the client's own put of the key answered the cached older incarnation", stale, rounds)
	}
}
