package master

import (
	"context"
	"fmt"
	"slices"
	"strings"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
	"github.com/tidepool-kv/tidepool/ticket"
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
	keys, err := req.ChainKeys(MaxBatchKeys)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidRequest, err)
	}
	if err := validKeys(keys); err != nil {
		return nil, err
	}
	if err := m.s.leaderOnly(); err != nil {
		return nil, err
	}
	objs := m.s.fsm.prefix(keys)
	if req.CountOnly {
		m.s.metrics.looked(callerTenant(ctx), len(keys), len(objs), nil)
		return &pb.LookupResponse{Matched: uint32(len(objs))}, nil
	}
	probed := len(keys)
	keys = keys[:len(objs)]
	now := m.s.cfg.Now()
	exp := now.Add(m.s.cfg.LeaseTTL).UnixNano()
	// Cached unless the client keeps no cache: it may answer these keys
	// from its descriptor cache until the lease ends (see FSM.tombs).
	if refused := m.s.lease(keys, objs, now.UnixNano(), exp, !req.Uncached); len(refused) > 0 {
		n := slices.IndexFunc(keys, func(k string) bool { return refused[k] })
		keys, objs = keys[:n], objs[:n]
	}
	resp := m.s.fsm.lookup(objs, now.UnixNano(), exp)
	if resp.Matched > 0 {
		// The chain may start below blocks a client answered from its
		// cache: they are used as much as what they lead to.
		m.s.fsm.touch(keys[:1], now.UnixNano())
	}
	resp.LeaseTtlMs = uint64(m.s.cfg.LeaseTTL.Milliseconds())
	m.s.noteLookup(callerTenant(ctx), probed, keys[:resp.Matched], resp)
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

// prefix returns the objects of the leading keys that are complete.
func (f *FSM) prefix(keys []string) []*object {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make([]*object, 0, len(keys))
	for _, k := range keys {
		o := f.objects.get(k)
		if o == nil || !o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) {
			break
		}
		out = append(out, o)
	}
	return out
}

// lookup describes the leading objects that are still complete and in the
// table, column by column, with read tickets until expiry, recording the
// read at now (unix nanos) for recency; it stops at the first that is not
// or has no live replica.
func (f *FSM) lookup(objs []*object, now, expiry int64) *pb.LookupResponse {
	f.mu.RLock()
	defer f.mu.RUnlock()
	resp := &pb.LookupResponse{
		Sizes:          make([]uint64, 0, len(objs)),
		Checksums:      make([]uint32, 0, len(objs)),
		ReplicaCounts:  make([]uint32, 0, len(objs)),
		ReplicaOffsets: make([]uint64, 0, len(objs)),
	}
	// Each segment of the answer once: its index in resp.Segments and its
	// read rank. A chain's blocks mostly share a segment, so the last one
	// found is tried before the map.
	type segRef struct {
		seg  uint32
		i    uint32
		rank int
		ok   bool
		s    *segment
	}
	// One ticket per run of replicas that follow each other in a segment
	// (a gap under the tier's alignment is the previous block's padding):
	// a chain put in one batch costs a ticket per segment, and its blocks'
	// reads can still travel as one request.
	type run struct {
		s        *segment
		off, end uint64
	}
	var runs []run
	var open []int // per index of resp.Segments: its latest run, -1 if none
	refs := map[uint32]segRef{}
	last := segRef{seg: ^uint32(0)}
	ref := func(e extent) segRef {
		if last.seg == e.seg {
			return last
		}
		r, seen := refs[e.seg]
		if !seen {
			r.seg = e.seg
			if s := f.seg(e); s != nil {
				r.i, r.rank, r.ok, r.s = uint32(len(resp.Segments)), readRank(s.tier), true, s
				resp.Segments = append(resp.Segments, &pb.Replica{Segment: s.id, Node: s.node, Endpoint: s.endpoint, Tier: s.tier})
				open = append(open, -1)
			}
			refs[e.seg] = r
		}
		last = r
		return r
	}
	for _, o := range objs {
		if o.gone() || !o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) {
			break
		}
		count := uint32(0)
		var mine [4]segRef // an object has few replicas
		rs := mine[:0]
		exts := f.exts(o)
		for _, r := range exts {
			rs = append(rs, ref(r))
		}
		for rank := range 3 { // fastest tier first
			for j, r := range exts {
				if !rs[j].ok || rs[j].rank != rank {
					continue
				}
				resp.ReplicaSegments = append(resp.ReplicaSegments, rs[j].i)
				resp.ReplicaOffsets = append(resp.ReplicaOffsets, r.offset())
				count++
				s, off := rs[j].s, r.offset()
				if s.key == nil {
					resp.ReplicaTickets = append(resp.ReplicaTickets, pb.NoTicket)
					continue
				}
				k := open[rs[j].i]
				if k < 0 || off < runs[k].end || off-runs[k].end >= alignment(s.tier) {
					k = len(runs)
					runs = append(runs, run{s: s, off: off})
					open[rs[j].i] = k
				}
				runs[k].end = off + o.size
				resp.ReplicaTickets = append(resp.ReplicaTickets, uint32(k))
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
	if len(runs) == 0 {
		resp.ReplicaTickets = nil // no store checks tickets
		return resp
	}
	resp.Tickets = make([]byte, 0, len(runs)*ticket.Size)
	for _, r := range runs {
		resp.Tickets = r.s.key.Append(resp.Tickets, ticket.Ticket{Op: ticket.Read, Off: r.off, Len: r.end - r.off, Expiry: expiry})
	}
	return resp
}

// childrenOf lists up to limit complete objects whose parent is key.
func (f *FSM) childrenOf(key string, limit int) ([]*pb.ObjectInfo, bool) {
	f.mu.RLock()
	n := f.children[key]
	f.mu.RUnlock()
	if n == 0 {
		return nil, false
	}
	var keys, shard []string
	f.walk(func(o *object) {
		if o.parent() == key && o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) {
			shard = append(shard, o.key())
		}
	}, func() { keys, shard = append(keys, shard...), shard[:0] })
	slices.Sort(keys)
	truncated := len(keys) > limit
	if truncated {
		keys = keys[:limit]
	}
	return f.infos(keys), truncated
}

// noteLookup counts a lookup of probed keys in the metrics, by the tier of
// each matched block's fastest replica, and its matched blocks served from
// SSD alone towards their promotion, as a get of them would.
func (s *Server) noteLookup(tenant string, probed int, keys []string, resp *pb.LookupResponse) {
	var slow []string
	var byTier [pb.Tier_TIER_SSD + 1]int
	at := 0
	for i, n := range resp.ReplicaCounts {
		t := resp.Segments[resp.ReplicaSegments[at]].Tier
		if int(t) < len(byTier) {
			byTier[t]++
		}
		if t == pb.Tier_TIER_SSD {
			// Kept past the request: not a view of its packed keys.
			slow = append(slow, strings.Clone(keys[i]))
		}
		at += int(n)
	}
	s.metrics.looked(tenant, probed, 0, byTier[:])
	s.slowReads(slow)
}
