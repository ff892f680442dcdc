package master

import (
	"context"
	"fmt"
	"slices"
	"time"

	"google.golang.org/protobuf/proto"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Draining takes a node out of the pool without losing what it holds. The
// mark is replicated (DrainCmd), so a new leader carries on; placement
// skips the node at once. Each sweep, the leader drops the node's replicas
// of objects that have another one elsewhere, and copies the rest to other
// nodes (same tier first); once the node holds nothing, it is taken out,
// and its heartbeat is answered FAILED_PRECONDITION so the process stays
// out until restarted.

// maxDrainPerSweep bounds the copies and the drops one sweep starts for one
// node.
const maxDrainPerSweep = 256

// nodeState is a node as draining sees it.
type nodeState struct {
	id       string
	epoch    uint64
	segments []string
	down     bool
	draining bool
	drained  bool
	// What its segments hold: replicas, their bytes, and copies still
	// writing into it.
	objects, bytes uint64
	incoming       int
	// The last lease end of space freed on it: it holds readers till then.
	pendingUntil int64
}

// nodeStates describes the nodes that match, in id order.
// The nodes come under the read lock; their objects in one walk of the
// table (see FSM.walk).
func (f *FSM) nodeStates(match func(*node) bool) []nodeState {
	f.mu.RLock()
	var out []nodeState
	bySeg := map[string]int{} // segment id -> index in out
	for _, id := range sortedKeys(f.nodes) {
		n := f.nodes[id]
		if !match(n) {
			continue
		}
		ns := nodeState{id: id, epoch: n.epoch, segments: slices.Clone(n.segments), down: n.down, draining: n.draining, drained: n.drained}
		for _, p := range f.pending {
			if slices.Contains(n.segments, p.Extent.Segment) {
				ns.pendingUntil = max(ns.pendingUntil, p.AfterUnixNano)
			}
		}
		for _, sid := range n.segments {
			bySeg[sid] = len(out)
		}
		out = append(out, ns)
	}
	f.mu.RUnlock()
	if len(out) == 0 {
		return out
	}
	f.walk(func(o *object) {
		for _, r := range f.exts(o) {
			if i, ok := bySeg[f.segID(r)]; ok {
				out[i].objects++
				out[i].bytes += o.size
			}
		}
		for _, c := range f.copies(o) {
			if i, ok := bySeg[c.Target.Segment]; ok {
				out[i].incoming++
			}
		}
	}, nil)
	return out
}

func (f *FSM) nodeState(id string) (nodeState, bool) {
	ns := f.nodeStates(func(n *node) bool { return n.id == id })
	if len(ns) == 0 {
		return nodeState{}, false
	}
	return ns[0], true
}

// drainNodes moves replicas off every draining node, and takes out those
// that hold nothing any more.
func (s *Server) drainNodes(ctx context.Context) {
	for _, n := range s.fsm.nodeStates(func(n *node) bool { return n.draining && !n.down }) {
		if n.objects == 0 && n.incoming == 0 {
			if s.cfg.Now().UnixNano() <= n.pendingUntil {
				continue // readers may still be reading there; Apply frees it after
			}
			_, err := s.apply(ctx, &pb.Command{Op: &pb.Command_NodeDown{NodeDown: &pb.NodeDownCmd{Node: n.id, Epoch: n.epoch, Drained: true}}})
			if err != nil {
				s.log.Warn("take a drained node out", "node", n.id, "err", err)
				continue
			}
			s.mu.Lock()
			delete(s.mu.lastSeen, n.id) // as for a node that left: its heartbeats are refused now
			delete(s.mu.copyQueue, n.id)
			s.mu.Unlock()
			s.log.Info("node drained and taken out of the pool", "node", n.id, "epoch", n.epoch)
			s.events.add(s.cfg.Now(), "drain", "store %s drained and taken out of the pool", n.id)
			continue
		}
		s.drainStep(ctx, n)
	}
}

// drainStep moves a batch of one draining node's replicas.
func (s *Server) drainStep(ctx context.Context, n nodeState) {
	tiers, nodeOf := map[string]pb.Tier{}, map[string]string{}
	for _, v := range s.fsm.segmentViews() {
		tiers[v.id] = v.tier
		nodeOf[v.id] = v.node
	}
	mine := func(id string) bool { return slices.Contains(n.segments, id) }
	// Another replica counts only on a node that heartbeat recently: one
	// on a silent node may be gone with it.
	others := func(o evictable) int {
		var nodes []string
		for _, id := range o.segments {
			if n := nodeOf[id]; !mine(id) && s.fresh(n) && !slices.Contains(nodes, n) {
				nodes = append(nodes, n)
			}
		}
		return len(nodes)
	}
	var jobs []copyJob
	var drops []drop
	objs := s.fsm.completeObjects(func(string) bool { return true })
	byKey(objs)
	for _, o := range objs {
		i := slices.IndexFunc(o.segments, mine)
		if i < 0 || o.copying {
			continue
		}
		// The replica is dropped if as many nodes as the put asked for keep
		// one, or if some keep one and no other node can take a copy (the
		// object is re-replicated once one can); else it moves.
		kept := others(o)
		var cands []string
		if kept < o.want && len(jobs) < maxDrainPerSweep {
			cands = s.candidatesBeside(o.size, tiers[o.segments[i]], o.segments, nodeOf)
		}
		switch {
		case kept >= o.want || (kept > 0 && len(cands) == 0 && len(jobs) < maxDrainPerSweep):
			if len(drops) < maxDrainPerSweep {
				drops = append(drops, drop{o, o.segments[i]})
			}
		case len(jobs) < maxDrainPerSweep:
			jobs = append(jobs, copyJob{key: o.key, putID: o.putID, source: o.segments[i], reason: pb.CopyReason_COPY_REASON_DRAIN, candidates: cands})
		}
	}
	dropped := s.dropReplicas(ctx, drops, "drain")
	_, noRoom, err := s.startCopies(ctx, jobs)
	if err != nil {
		s.log.Warn("drain", "node", n.id, "err", err)
	}
	s.mu.Lock()
	p := s.drainProgress(n.id)
	p.Dropped += uint64(dropped)
	p.Waiting = uint64(len(noRoom))
	s.mu.Unlock()
}

// drainProgress is the leader's count for a node's drain; s.mu must be held.
func (s *Server) drainProgress(node string) *pb.DrainProgress {
	p := s.mu.drains[node]
	if p == nil {
		p = &pb.DrainProgress{}
		s.mu.drains[node] = p
	}
	return p
}

// drainMoved counts a drain copy that ended well.
func (s *Server) drainMoved(node string) {
	s.mu.Lock()
	s.drainProgress(node).Moved++
	s.mu.Unlock()
}

// Drain marks a node as draining and streams progress until it is out of
// the pool. The drain goes on if the caller goes away.
func (a *adminService) Drain(req *pb.DrainRequest, stream pb.Admin_DrainServer) error {
	return a.s.toStatus(stream.Context(), a.drain(req, stream))
}

func (a *adminService) drain(req *pb.DrainRequest, stream pb.Admin_DrainServer) error {
	s := a.s
	ctx := stream.Context()
	if req.Node == "" {
		return fmt.Errorf("%w: drain needs a node id", ErrInvalidRequest)
	}
	if err := s.leaderOnly(); err != nil {
		return err
	}
	n, ok := s.fsm.nodeState(req.Node)
	switch {
	case !ok:
		return fmt.Errorf("%w: %s", ErrUnknownNode, req.Node)
	case n.drained:
		return stream.Send(&pb.DrainProgress{Done: true})
	case n.down:
		return fmt.Errorf("%w: %s is down", ErrUnknownNode, req.Node)
	}
	if _, err := s.apply(ctx, &pb.Command{Op: &pb.Command_Drain{Drain: &pb.DrainCmd{Node: req.Node, Cancel: req.Cancel}}}); err != nil {
		return err
	}
	if !req.Cancel && !n.draining {
		// A new drain counts from zero, not on from an earlier epoch's.
		s.mu.Lock()
		delete(s.mu.drains, req.Node)
		s.mu.Unlock()
	}
	if req.Cancel {
		s.log.Info("drain canceled", "node", req.Node)
		if n.draining {
			s.events.add(s.cfg.Now(), "drain", "drain of store %s canceled", req.Node)
		}
		return stream.Send(s.progress(req.Node))
	}
	s.log.Info("draining node", "node", req.Node, "objects", n.objects, "bytes", n.bytes)
	if !n.draining {
		s.events.add(s.cfg.Now(), "drain", "draining store %s: %d replicas, %d bytes to move or drop", req.Node, n.objects, n.bytes)
	}
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for {
		p := s.progress(req.Node)
		if err := stream.Send(p); err != nil || p.Done {
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case <-s.stop:
			return ErrNotLeader
		case <-tick.C:
		}
		if err := s.leaderOnly(); err != nil {
			return err
		}
		if n, ok := s.fsm.nodeState(req.Node); !ok || (!n.draining && !n.drained) {
			return fmt.Errorf("%w: %s is no longer draining (canceled, or it restarted)", ErrDraining, req.Node)
		}
	}
}

// progress reports a node's drain: what it still holds from the FSM, what
// moved from this leader's count.
func (s *Server) progress(node string) *pb.DrainProgress {
	n, _ := s.fsm.nodeState(node)
	s.mu.Lock()
	p := proto.Clone(s.drainProgress(node)).(*pb.DrainProgress)
	s.mu.Unlock()
	p.ObjectsLeft, p.BytesLeft, p.Done = n.objects, n.bytes, n.drained
	return p
}
