package client

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/engine"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// review23Master places every put in its own 64 KiB slot of one engine
// segment and answers grant asks as runs: each ask in order, whole, but
// for the ask at index short (if >= 0), of which it answers one grant
// less and then stops (a prefix of the asks). It remembers the size each
// put id was placed for, and fails a PutEnd whose size differs. It
// answers granted puts of even id as unplaced (as a new leader does), and
// checks the replicas they are sent again with.
type review23Master struct {
	pb.UnimplementedMasterServer
	endpoint string
	short    int
	mu       sync.Mutex
	next     uint64            // next free slot
	sizes    map[uint64]uint64 // put id -> size placed for
	offs     map[uint64]uint64 // put id -> offset
	ended    map[string]uint64 // key -> put id
	asked    int               // grant asks seen
	granted  map[uint64]bool   // put ids answered as grants
	used     int               // PutEnds of granted put ids
	resent   int               // PutEnd items sent again with their replicas
}

const review23Slot = 64 << 10

func (m *review23Master) place(size uint64) (id, off uint64) {
	m.next++
	id, off = m.next, m.next*review23Slot
	m.sizes[id], m.offs[id] = size, off
	return id, off
}

func (m *review23Master) BatchPutStart(ctx context.Context, req *pb.BatchPutStartRequest) (*pb.BatchPutStartResponse, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	resp := &pb.BatchPutStartResponse{}
	for _, it := range req.Items {
		id, off := m.place(it.Size)
		resp.Results = append(resp.Results, &pb.PutStartResult{Status: &pb.ItemStatus{}, PutId: id, WriteTimeoutMs: 10_000,
			Replicas: []*pb.Replica{{Segment: "seg", Node: "s0", Endpoint: m.endpoint, Offset: off, Length: it.Size, Tier: pb.Tier_TIER_DRAM}}})
	}
	return resp, nil
}

func (m *review23Master) BatchPutEnd(ctx context.Context, req *pb.BatchPutEndRequest) (*pb.BatchPutEndResponse, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	resp := &pb.BatchPutEndResponse{}
	for i, it := range req.Items {
		st := &pb.ItemStatus{}
		if len(it.Replicas) == 0 && m.granted[it.PutId] && it.PutId%2 == 0 {
			// As a leader that did not place it: sent again with its replicas.
			resp.Unplaced = append(resp.Unplaced, uint32(i))
			resp.Results = append(resp.Results, st)
			continue
		}
		if len(it.Replicas) > 0 {
			m.resent++
			if r := it.Replicas[0]; len(it.Replicas) != 1 || r.Offset != m.offs[it.PutId] || r.Length != m.sizes[it.PutId] || !slices.Equal(it.Reservations, []uint64{1}) {
				resp.Results = append(resp.Results, &pb.ItemStatus{Code: 9, Message: fmt.Sprintf("put %d sent again with replica %v and reservations %v, placed at %d for %d bytes in reservation 1", it.PutId, r, it.Reservations, m.offs[it.PutId], m.sizes[it.PutId])})
				continue
			}
		}
		if size, ok := m.sizes[it.PutId]; !ok || size != it.Size {
			st = &pb.ItemStatus{Code: 9, Message: fmt.Sprintf("put %d of %d bytes was placed for %d", it.PutId, it.Size, size)}
		} else {
			m.ended[it.Key] = it.PutId
			if m.granted[it.PutId] {
				m.used++
			}
		}
		resp.Results = append(resp.Results, st)
	}
	for i, a := range req.GrantAsks {
		m.asked++
		n := a.Count
		if i == m.short {
			n--
		}
		if n > 0 {
			// One run: consecutive slots, the stride one slot.
			first, off := m.place(a.Size)
			m.granted[first] = true
			for range n - 1 {
				id, _ := m.place(a.Size)
				m.granted[id] = true
			}
			resp.Grants = append(resp.Grants, &pb.GrantRun{FirstPutId: first, Count: n, Stride: review23Slot, WriteTimeoutMs: 10_000,
				Replicas:     []*pb.Replica{{Segment: "seg", Node: "s0", Endpoint: m.endpoint, Offset: off, Length: a.Size, Tier: pb.Tier_TIER_DRAM}},
				Reservations: []uint64{1}})
		}
		if i == m.short {
			break
		}
	}
	return resp, nil
}

func (m *review23Master) PutRevoke(ctx context.Context, req *pb.KeysRequest) (*pb.ItemsResponse, error) {
	resp := &pb.ItemsResponse{}
	for range req.PutIds {
		resp.Results = append(resp.Results, &pb.ItemStatus{})
	}
	return resp, nil
}

// TestReview23GrantAsksMapToShapes: puts of several shapes ask for grants
// by shape; the runs the master answers (a prefix of the asks, the last
// one short) are pooled under the shape of their ask, so each later put
// writes into space placed for its own size, at the offset of its own
// grant, and the master publishes it; half the granted puts are answered
// unplaced, and sent again with their own grant's replicas.
func TestReview23GrantAsksMapToShapes(t *testing.T) {
	mem := engine.NewMemSegment("seg", make([]byte, 512*review23Slot))
	addr := servePeer(t, mem)
	for _, short := range []int{-1, 0, 1, 2} {
		t.Run(fmt.Sprint("short", short), func(t *testing.T) {
			m := &review23Master{endpoint: addr, short: short, sizes: map[uint64]uint64{}, offs: map[uint64]uint64{}, ended: map[string]uint64{}, granted: map[uint64]bool{}}
			c := fakeMasterClient(t, m)
			c.setWriteTimeout(10 * time.Second)
			ctx := context.Background()
			sizes := []int{1000, 3000, 5000}
			for round := range 6 {
				var keys []string
				var vals [][]byte
				for j, size := range sizes {
					for k := range 3 {
						keys = append(keys, fmt.Sprintf("r23/%d/%d/%d", round, j, k))
						vals = append(vals, bytes.Repeat([]byte{byte(round*16 + j*4 + k + 1)}, size))
					}
				}
				for i, err := range c.BatchPut(ctx, keys, vals) {
					if err != nil {
						t.Fatalf("round %d: put %q: %v", round, keys[i], err)
					}
				}
				m.mu.Lock()
				for i, k := range keys {
					id := m.ended[k]
					off := m.offs[id]
					if got := mem.Bytes()[off : off+uint64(len(vals[i]))]; !bytes.Equal(got, vals[i]) {
						t.Errorf("round %d: %q (put %d at %d) does not hold its value", round, k, id, off)
					}
				}
				m.mu.Unlock()
			}
			m.mu.Lock()
			defer m.mu.Unlock()
			if m.asked == 0 || m.used == 0 || m.resent == 0 {
				t.Fatalf("%d grant asks, %d puts through grants, %d sent again", m.asked, m.used, m.resent)
			}
		})
	}
}
