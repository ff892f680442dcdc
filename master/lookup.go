package master

import (
	"context"
	"slices"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Lookup answers an engine's first question, "how many blocks of this
// chain do you have?", and leases the answer in the same step: between a
// separate exists and get, blocks could be evicted and the engine would
// stall on a miss it was promised was a hit.
//
// The prefix is read, leased, then read again: a removal that finished
// before the lease shows in the second read, one in flight refuses the
// lease, one that starts later sees it. Either way the answer shrinks
// rather than promise a block whose space may be reused.
func (m *masterService) Lookup(ctx context.Context, req *pb.LookupRequest) (*pb.LookupResponse, error) {
	if err := validKeys(req.Keys); err != nil {
		return nil, err
	}
	if err := m.s.leaderOnly(); err != nil {
		return nil, err
	}
	n := m.s.fsm.prefix(req.Keys)
	if req.CountOnly {
		return &pb.LookupResponse{Matched: uint32(n)}, nil
	}
	if refused := m.s.lease(req.Keys[:n]); len(refused) > 0 {
		n = slices.IndexFunc(req.Keys[:n], func(k string) bool { return refused[k] })
	}
	resp := m.s.fsm.lookup(req.Keys[:n], m.s.cfg.Now().UnixNano())
	resp.LeaseTtlMs = uint64(m.s.cfg.LeaseTTL.Milliseconds())
	m.s.noteLookup(req.Keys[:resp.Matched], resp)
	return resp, nil
}

// Children lists the complete objects that name key as their parent, in
// key order. It scans the object table: it serves tools, not the read path.
func (m *masterService) Children(ctx context.Context, req *pb.ChildrenRequest) (*pb.ListResponse, error) {
	if err := validKey(req.Key); err != nil {
		return nil, err
	}
	if err := m.s.leaderOnly(); err != nil {
		return nil, err
	}
	limit := int(req.Limit)
	if limit <= 0 || limit > MaxBatchKeys {
		limit = defaultList
	}
	objs, truncated := m.s.fsm.childrenOf(req.Key, limit)
	return &pb.ListResponse{Objects: objs, Truncated: truncated}, nil
}

// prefix counts the leading keys whose objects are complete.
func (f *FSM) prefix(keys []string) int {
	f.mu.RLock()
	defer f.mu.RUnlock()
	for i, k := range keys {
		if o := f.objects[k]; o == nil || o.state != pb.ObjectState_OBJECT_STATE_COMPLETE {
			return i
		}
	}
	return len(keys)
}

// lookup describes the leading complete objects of keys, column by column,
// recording the read at now (unix nanos) for recency; it stops at the first
// key that is missing or has no live replica.
func (f *FSM) lookup(keys []string, now int64) *pb.LookupResponse {
	f.mu.RLock()
	defer f.mu.RUnlock()
	resp := &pb.LookupResponse{
		Sizes:          make([]uint64, 0, len(keys)),
		Checksums:      make([]uint32, 0, len(keys)),
		ReplicaCounts:  make([]uint32, 0, len(keys)),
		ReplicaOffsets: make([]uint64, 0, len(keys)),
	}
	// Each segment of the answer once: its index in resp.Segments and its
	// read rank, so a replica costs one map lookup.
	type segRef struct {
		i    uint32
		rank int
		ok   bool
	}
	refs := map[string]segRef{}
	ref := func(id string) segRef {
		if r, seen := refs[id]; seen {
			return r
		}
		var r segRef
		if s := f.segments[id]; s != nil {
			r = segRef{i: uint32(len(resp.Segments)), rank: readRank(s.tier), ok: true}
			resp.Segments = append(resp.Segments, &pb.Replica{Segment: id, Node: s.node, Endpoint: s.endpoint, Tier: s.tier})
		}
		refs[id] = r
		return r
	}
	for _, k := range keys {
		o := f.objects[k]
		if o == nil || o.state != pb.ObjectState_OBJECT_STATE_COMPLETE {
			break
		}
		count := uint32(0)
		var mine [4]segRef // an object has few replicas
		rs := mine[:0]
		for _, r := range o.replicas {
			rs = append(rs, ref(r.Segment))
		}
		for rank := range 3 { // fastest tier first
			for j, r := range o.replicas {
				if !rs[j].ok || rs[j].rank != rank {
					continue
				}
				resp.ReplicaSegments = append(resp.ReplicaSegments, rs[j].i)
				resp.ReplicaOffsets = append(resp.ReplicaOffsets, r.Offset)
				count++
			}
		}
		if count == 0 {
			break
		}
		o.used.Store(now)
		resp.Sizes = append(resp.Sizes, o.size)
		resp.Checksums = append(resp.Checksums, o.checksum)
		resp.ReplicaCounts = append(resp.ReplicaCounts, count)
		resp.Matched++
	}
	return resp
}

// childrenOf lists up to limit complete objects whose parent is key.
func (f *FSM) childrenOf(key string, limit int) ([]*pb.ObjectInfo, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var keys []string
	if f.children[key] > 0 {
		for k, o := range f.objects {
			if o.parent == key && o.state == pb.ObjectState_OBJECT_STATE_COMPLETE {
				keys = append(keys, k)
			}
		}
	}
	return f.page(keys, limit)
}

// noteLookup counts a lookup's matched blocks served from SSD alone
// towards their promotion, as a get of them would.
func (s *Server) noteLookup(keys []string, resp *pb.LookupResponse) {
	var slow []string
	at := 0
	for i, n := range resp.ReplicaCounts {
		if resp.Segments[resp.ReplicaSegments[at]].Tier == pb.Tier_TIER_SSD {
			slow = append(slow, keys[i])
		}
		at += int(n)
	}
	s.slowReads(slow)
}
