package master

import (
	"context"
	"slices"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Re-replication keeps each object on as many nodes as its put asked for.
// The FSM keeps the set of complete objects below that count (FSM.under),
// updated by every change of an object's replicas: a store declared dead,
// a replica found corrupt, a put published on fewer nodes than it was
// placed on. The set and each object's count are replicated state, so a
// new leader carries on where the old one stopped. Each sweep the leader
// copies some of them from a replica on a node that heartbeat recently to
// a node that holds none, through the copy path every tiering move takes
// (stores run copies at the engine's LOW priority).

const (
	// maxRepairPerSweep bounds the re-replication copies one sweep starts.
	maxRepairPerSweep = 256
	// maxRepairing bounds those running at once.
	maxRepairing = 1024
	// repairScan bounds the objects one sweep considers: some may have
	// nowhere to go (no node left without a replica), and those must not
	// stop the rest; the set's random order lets later sweeps see others.
	repairScan = 4096
)

// repairState is what re-replication has left: objects below their
// replica count, and the repair copies running for them.
type repairState struct {
	under, repairing int
}

// repairs reports the re-replication state, in time linear in the copies
// in flight.
func (f *FSM) repairs() repairState {
	f.mu.RLock()
	defer f.mu.RUnlock()
	st := repairState{under: len(f.under)}
	for o := range f.copying {
		for _, c := range f.copies(o) {
			if c.Reason == pb.CopyReason_COPY_REASON_REPAIR {
				st.repairing++
			}
		}
	}
	return st
}

// underReplicated lists up to limit objects below their replica count
// with no copy running, in the set's (random) order.
func (f *FSM) underReplicated(limit int) []evictable {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var out []evictable
	for o := range f.under {
		if len(out) == limit {
			break
		}
		if len(f.copies(o)) > 0 {
			continue
		}
		e := evictable{key: o.key(), size: o.size, putID: o.putID, want: f.want(o)}
		for _, r := range f.exts(o) {
			if s := f.seg(r); s != nil {
				e.segments = append(e.segments, s.id)
			}
		}
		out = append(out, e)
	}
	return out
}

// repair starts copies for objects below their replica count.
func (s *Server) repair(ctx context.Context) {
	st := s.fsm.repairs()
	if st.under == 0 || st.repairing >= maxRepairing {
		return
	}
	limit := min(maxRepairPerSweep, maxRepairing-st.repairing)
	objs := s.fsm.underReplicated(repairScan)
	views, nodeOf := map[string]segmentView{}, map[string]string{}
	for _, v := range s.fsm.segmentViews() {
		views[v.id], nodeOf[v.id] = v, v.node
	}
	var jobs []copyJob
	for _, o := range objs {
		if len(jobs) == limit {
			break
		}
		if j, ok := s.repairJob(o, views, nodeOf); ok {
			jobs = append(jobs, j)
		}
	}
	if len(jobs) == 0 {
		return
	}
	started, noRoom, err := s.startCopies(ctx, jobs)
	if err != nil {
		s.log.Warn("re-replicate", "objects", len(jobs), "err", err)
	}
	s.log.Info("re-replicating objects below their replica count",
		"under_replicated", st.under, "started", started, "no_room", len(noRoom))
}

// repairJob is the copy that gives o one more node: from its replica in
// the fastest tier on a node that heartbeat recently, to a segment of the
// same tier if one has room, else of a colder one, on a node that holds
// none of it. Never to a faster tier: promotion is for reads to earn, and
// a replica demotion dropped must not come back to the tier it left.
func (s *Server) repairJob(o evictable, views map[string]segmentView, nodeOf map[string]string) (copyJob, bool) {
	source := ""
	for _, id := range o.segments {
		if v, ok := views[id]; ok && s.fresh(v.node) && (source == "" || readRank(v.tier) < readRank(views[source].tier)) {
			source = id
		}
	}
	if source == "" {
		return copyJob{}, false // no replica is known to be readable now
	}
	// Nor into a segment the copy would take past where write-back and
	// eviction start: a full pool's tiering would drop it again.
	tier := views[source].tier
	mark := s.cfg.HighWatermark - 2*s.cfg.EvictRatio
	cands := slices.DeleteFunc(s.candidatesBeside(o.size, tier, o.segments, nodeOf), func(id string) bool {
		v := views[id]
		return (v.tier != tier && !colder(v.tier, tier)) || float64(v.used+o.size) > mark*float64(v.capacity)
	})
	if len(cands) == 0 {
		return copyJob{}, false
	}
	return copyJob{key: o.key, putID: o.putID, source: source, candidates: cands, reason: pb.CopyReason_COPY_REASON_REPAIR}, true
}

// nodesOf lists the nodes of the segments named that exist, sorted.
func (f *FSM) nodesOf(segments []string) []string {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var out []string
	for _, id := range segments {
		if s := f.segments[id]; s != nil && !slices.Contains(out, s.node) {
			out = append(out, s.node)
		}
	}
	slices.Sort(out)
	return out
}

// avoid keeps placement off nodes for the node TTL: a client could not
// reach them to write a put. Whether they are dead is for their heartbeats
// to tell.
func (s *Server) avoid(nodes []string) {
	until := s.cfg.Now().Add(s.cfg.NodeTTL)
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, n := range nodes {
		if _, ok := s.mu.lastSeen[n]; ok {
			s.mu.avoided[n] = until
		}
	}
}

// avoided reports the nodes placement avoids now, and forgets the marks
// that ended.
func (s *Server) avoided() map[string]bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.mu.avoided) == 0 {
		return nil
	}
	now := s.cfg.Now()
	var out map[string]bool
	for n, until := range s.mu.avoided {
		if !now.Before(until) {
			delete(s.mu.avoided, n)
			continue
		}
		if out == nil {
			out = map[string]bool{}
		}
		out[n] = true
	}
	return out
}
