package master

import (
	"cmp"
	"context"
	"slices"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Tiering keeps hot objects in fast tiers and cold ones in slow tiers.
//
// Demotion: when a DRAM (or HBM) segment crosses the high watermark, its
// least recently used objects are copied to a slower tier with room (SSD),
// at the engine's LOW priority, and their fast replica is dropped once the
// copy is a replica. An object that already has a slower replica just
// loses its fast one. Only without room in a slower tier is an object of a
// fast tier evicted outright.
//
// Promotion: an object read from a slow tier only, Config.PromoteAfter times,
// gains a DRAM replica, if DRAM has room below the high watermark; its SSD
// replica stays, so demoting it again costs nothing.

// DefaultPromoteAfter is how many reads served from a slow tier only make
// an object hot enough to promote (admission by frequency).
const DefaultPromoteAfter = 2

// Bounds on the leader's promotion bookkeeping and work per sweep.
const (
	// maxCopiesPerRound bounds the copies one segment's demotion or
	// write-back starts in one sweep.
	maxCopiesPerRound  = 4096
	maxSlowReads       = 1 << 17
	maxPromotePerSweep = 256
)

// colder reports whether tier u takes the cold objects of tier t: SSD
// takes those of DRAM and HBM. A host reads HBM slower than DRAM
// (readRank), but GPU memory is no place for cold objects.
func colder(u, t pb.Tier) bool {
	return readRank(u) > readRank(t) && u != pb.Tier_TIER_HBM
}

// hasSlowerTier reports whether the pool has a segment of a tier colder
// than t that placement may use.
func (s *Server) hasSlowerTier(t pb.Tier) bool {
	for _, v := range s.fsm.segmentViews() {
		if colder(v.tier, t) && !v.closed() && s.alive(v.node) {
			return true
		}
	}
	return false
}

// slowerSegments orders the live segments of tiers colder than t that
// have a free range of size bytes: the same node as near first (a local
// file write), then the freer.
func (s *Server) slowerSegments(t pb.Tier, size uint64, near string) []string {
	views := slices.DeleteFunc(s.fsm.segmentViews(), func(v segmentView) bool {
		return !colder(v.tier, t) || v.closed() || !s.alive(v.node) || v.largestFree < size
	})
	slices.SortStableFunc(views, func(a, b segmentView) int {
		if (a.node == near) != (b.node == near) {
			if a.node == near {
				return -1
			}
			return 1
		}
		return cmp.Or(cmp.Compare(readRank(a.tier), readRank(b.tier)), freerFirst(a, b))
	})
	ids := make([]string, len(views))
	for i, v := range views {
		ids[i] = v.id
	}
	return ids
}

// demote moves victims off the fast segment from, and returns those it
// could not place in a slower tier: the caller evicts them.
func (s *Server) demote(ctx context.Context, from segmentView, victims []evictable) (unplaced []evictable) {
	tiers, nodeOf := s.segmentTiers(), s.segmentNodes()
	var jobs []copyJob
	var drops []drop
	byKey := map[string]evictable{}
	// A replica goes to a slower tier of its own node, or of one holding
	// none: moved onto another node that holds the object, it would leave
	// the object on fewer nodes than its put asked for.
	slowerBeside := func(o evictable) []string {
		return slices.DeleteFunc(s.slowerSegments(from.tier, o.size, from.node), func(id string) bool {
			return nodeOf[id] != from.node && slices.ContainsFunc(o.segments, func(held string) bool { return nodeOf[held] == nodeOf[id] })
		})
	}
	for _, o := range victims {
		slower := slices.ContainsFunc(o.segments, func(id string) bool { return colder(tiers[id], from.tier) && s.fresh(nodeOf[id]) })
		var cands []string
		if slower && !s.keepsCount(o, from.id, nodeOf) && len(jobs) < maxCopiesPerRound {
			cands = slowerBeside(o)
		}
		if slower && len(cands) == 0 {
			// If the colder replica went meanwhile, the next sweep copies.
			// Below the count only if nowhere else can take it: the
			// object keeps its colder replica rather than go whole.
			drops = append(drops, drop{o, from.id})
			continue
		}
		if len(jobs) == maxCopiesPerRound {
			continue // the next round demotes the rest
		}
		if len(cands) == 0 {
			cands = slowerBeside(o)
		}
		if len(cands) == 0 && s.roomForDemotion(ctx, from, o.size) {
			cands = slowerBeside(o)
		}
		if len(cands) == 0 {
			unplaced = append(unplaced, o)
			continue
		}
		byKey[o.key] = o
		jobs = append(jobs, copyJob{key: o.key, putID: o.putID, source: from.id, candidates: cands, reason: pb.CopyReason_COPY_REASON_DEMOTE})
	}
	s.dropReplicas(ctx, drops, "demote")
	started, failed, err := s.startCopies(ctx, jobs)
	if err != nil {
		s.log.Warn("demote", "segment", from.id, "err", err)
		return unplaced
	}
	for _, k := range failed {
		unplaced = append(unplaced, byKey[k])
	}
	if started > 0 {
		s.log.Debug("demoting", "segment", from.id, "objects", started)
	}
	return unplaced
}

// roomForDemotion evicts from a colder segment (the same node first) until
// it can take an object of size bytes: only the coldest tier forgets, so a
// demotion makes room there rather than evict the object it demotes.
func (s *Server) roomForDemotion(ctx context.Context, from segmentView, size uint64) bool {
	views := slices.DeleteFunc(s.fsm.segmentViews(), func(v segmentView) bool {
		return !colder(v.tier, from.tier) || v.closed() || !s.alive(v.node) || v.capacity < size
	})
	slices.SortStableFunc(views, func(a, b segmentView) int {
		return cmp.Compare(btoi(a.node != from.node), btoi(b.node != from.node))
	})
	now := s.cfg.Now()
	for _, v := range views {
		if s.roomIn(ctx, v.id, size, now, "demotion") {
			return true
		}
	}
	return false
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// drop is a replica to drop: the object's replica on segment.
type drop struct {
	o       evictable
	segment string
}

// dropReplicas drops replicas that are not their object's last, in raft
// entries of evictBatch, each freed when the leases on its key end. It
// returns how many went.
func (s *Server) dropReplicas(ctx context.Context, drops []drop, reason string) int {
	n := 0
	for batch := range slices.Chunk(drops, evictBatch) {
		cmd := &pb.DropReplicasCmd{}
		for _, d := range batch {
			cmd.Items = append(cmd.Items, &pb.DropReplicaCmd{
				Key: d.o.key, Segment: d.segment, Checksum: d.o.checksum, KeepLast: true,
				FreeAfterUnixNano: s.leaseEnd([]string{d.o.key}).UnixNano(),
			})
		}
		out, err := s.apply(ctx, &pb.Command{Op: &pb.Command_DropReplicas{DropReplicas: cmd}})
		if err != nil {
			s.log.Warn("drop replicas", "reason", reason, "replicas", len(batch), "err", err)
			return n
		}
		for _, ok := range out.([]bool) {
			if ok {
				n++
				s.metrics.dropped(reason)
			}
		}
	}
	return n
}

// noteReads counts the reads of a GetReplicas answer served from SSD
// alone towards promotion.
func (s *Server) noteReads(keys []string, res []*pb.ObjectReplicas) {
	var slow []string
	for i, r := range res {
		if len(r.Replicas) > 0 && r.Replicas[0].Tier == pb.Tier_TIER_SSD {
			slow = append(slow, keys[i])
		}
	}
	s.slowReads(slow)
}

// slowReads counts reads of objects whose fastest replica is on SSD; those
// read Config.PromoteAfter times are queued for promotion.
func (s *Server) slowReads(keys []string) {
	if s.cfg.PromoteAfter < 0 || len(keys) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, k := range keys {
		if len(s.mu.slowReads) >= maxSlowReads {
			clear(s.mu.slowReads) // forget old counts rather than grow without bound
		}
		s.mu.slowReads[k]++
		if s.mu.slowReads[k] >= s.cfg.PromoteAfter && len(s.mu.promote) < maxSlowReads {
			s.mu.promote[k] = true
			delete(s.mu.slowReads, k)
		}
	}
}

// promote copies the objects queued for promotion into DRAM segments that
// have room below the high watermark.
func (s *Server) promote(ctx context.Context) {
	s.mu.Lock()
	keys := make([]string, 0, min(len(s.mu.promote), maxPromotePerSweep))
	for k := range s.mu.promote {
		if len(keys) == maxPromotePerSweep {
			break
		}
		keys = append(keys, k)
		delete(s.mu.promote, k)
	}
	s.mu.Unlock()
	if len(keys) == 0 {
		return
	}
	slices.Sort(keys)
	views := slices.DeleteFunc(s.fsm.segmentViews(), func(v segmentView) bool {
		return v.tier != pb.Tier_TIER_DRAM || v.closed() || !s.alive(v.node)
	})
	slices.SortStableFunc(views, freerFirst)
	tiers := s.segmentTiers()
	room := map[string]uint64{} // what each DRAM segment may still take
	for _, v := range views {
		if limit := uint64(s.cfg.HighWatermark * float64(v.capacity)); v.used < limit {
			room[v.id] = min(limit-v.used, v.largestFree)
		}
	}
	var jobs []copyJob
	objs := s.fsm.completeObjects(func(k string) bool { _, ok := slices.BinarySearch(keys, k); return ok })
	byKey(objs)
	for _, o := range objs {
		if o.copying || slices.ContainsFunc(o.segments, func(id string) bool { return readRank(tiers[id]) <= readRank(pb.Tier_TIER_DRAM) }) {
			continue
		}
		var cands []string
		for _, v := range views {
			if room[v.id] >= o.size {
				cands = append(cands, v.id)
			}
		}
		if len(cands) == 0 {
			continue
		}
		room[cands[0]] -= o.size
		jobs = append(jobs, copyJob{key: o.key, putID: o.putID, source: o.segments[0], candidates: cands, reason: pb.CopyReason_COPY_REASON_PROMOTE})
	}
	if _, _, err := s.startCopies(ctx, jobs); err != nil {
		s.log.Warn("promote", "objects", len(jobs), "err", err)
	}
}

// Write-back keeps cold DRAM objects on SSD ahead of need: above
// writeBackMark (the high watermark less twice the evict ratio), the least
// recently used objects of a DRAM segment, as many bytes as it is above
// the mark, get an SSD replica and keep their DRAM one. A put that finds
// its DRAM segment full then reclaims those replicas in the same raft
// command (PutStartCmd.reclaim), instead of spilling to SSD while DRAM
// holds colder objects; and demoting them later is a drop.

// maxReclaim bounds the reclaimable replicas one PutStart command carries.
const maxReclaim = 256

// writeBack starts write-back copies for the DRAM segments above the mark.
func (s *Server) writeBack(ctx context.Context, now time.Time) {
	if s.cfg.NoWriteBack {
		return
	}
	mark := s.cfg.HighWatermark - 2*s.cfg.EvictRatio
	tiers := s.segmentTiers()
	for _, v := range s.fsm.segmentViews() {
		if v.tier != pb.Tier_TIER_DRAM || v.closed() || !s.alive(v.node) || float64(v.used) <= mark*float64(v.capacity) || !s.hasSlowerTier(v.tier) {
			continue
		}
		want := v.used - uint64(mark*float64(v.capacity))
		objs := s.fsm.completeOn(v.id)
		s.byRecency(objs, now)
		var jobs []copyJob
		var covered uint64
		for _, o := range objs {
			if covered >= want {
				break
			}
			if o.hard || o.softPin > now.UnixNano() {
				continue
			}
			covered += o.freed
			if o.copying || slices.ContainsFunc(o.segments, func(id string) bool { return colder(tiers[id], v.tier) }) {
				continue
			}
			cands := s.slowerSegments(v.tier, o.size, v.node)
			if len(cands) == 0 || len(jobs) == maxCopiesPerRound {
				break // no room below (the watermark sweep makes it), or enough for one round
			}
			jobs = append(jobs, copyJob{key: o.key, putID: o.putID, source: v.id, candidates: cands, reason: pb.CopyReason_COPY_REASON_WRITEBACK})
		}
		if _, _, err := s.startCopies(ctx, jobs); err != nil {
			s.log.Warn("write back", "segment", v.id, "err", err)
			return
		}
	}
}

// reclaimFor lists, for the puts of cmd whose first candidate lacks room,
// the written-back replicas on that segment that Apply may drop: unleased,
// unpinned, least recently used first. A get leased between this check
// and the command's commit may still be sent to the dropped replica; its
// checksum check sends it on to the written-back one, which stays.
func (s *Server) reclaimFor(items []*pb.PutStartItem) []*pb.Reclaimable {
	need := map[string]uint64{}
	for _, it := range items {
		if len(it.Candidates) > 0 {
			need[it.Candidates[0]] += it.Size
		}
	}
	var short []segmentView
	for _, v := range s.fsm.segmentViews() {
		if n, ok := need[v.id]; ok && v.largestFree < n && s.hasSlowerTier(v.tier) {
			short = append(short, v)
		}
	}
	now := s.cfg.Now()
	// A new leader does not know the leases its predecessor granted.
	if len(short) == 0 || now.Before(s.evictableFrom()) {
		return nil
	}
	var out []*pb.Reclaimable
	for _, v := range short {
		out = append(out, s.reclaimable(v, need[v.id], now)...)
	}
	// The list may be up to reclaimTTL old: leave out keys leased since.
	keys := make([]string, len(out))
	for i, r := range out {
		keys[i] = r.Key
	}
	leased := s.fsm.leasedAt(keys, now.UnixNano())
	return slices.DeleteFunc(out, func(r *pb.Reclaimable) bool { return leased[r.Key] })
}

// reclaimable lists the written-back replicas on segment v worth twice
// need (free ranges are not contiguous) or a twentieth of the segment,
// whichever is more. A list is reused for reclaimTTL: a stream of puts
// into a full segment then costs one scan of its objects per round, not
// one per put; Apply skips entries that have gone stale.
func (s *Server) reclaimable(v segmentView, need uint64, now time.Time) []*pb.Reclaimable {
	s.mu.Lock()
	c, ok := s.mu.reclaim[v.id]
	s.mu.Unlock()
	if ok && now.Sub(c.at) < reclaimTTL {
		return c.items
	}
	tiers, nodeOf := s.segmentTiers(), s.segmentNodes()
	objs := filterObjects(s.fsm.completeOn(v.id), func(o evictable) bool {
		return !o.copying && !o.hard && o.softPin <= now.UnixNano() &&
			slices.ContainsFunc(o.segments, func(id string) bool { return colder(tiers[id], v.tier) && s.fresh(nodeOf[id]) })
	})
	leased := s.byRecency(objs, now)
	want := max(2*need, v.capacity/20)
	var items []*pb.Reclaimable
	var freed uint64
	for _, o := range objs {
		if freed >= want || len(items) == maxReclaim {
			break
		}
		if !leased[o.key] {
			items = append(items, &pb.Reclaimable{Key: o.key, Segment: v.id})
			freed += o.freed
		}
	}
	s.mu.Lock()
	s.mu.reclaim[v.id] = reclaimList{at: now, items: items}
	s.mu.Unlock()
	return items
}

// reclaimTTL is how long a list of reclaimable replicas is reused.
const reclaimTTL = 100 * time.Millisecond

type reclaimList struct {
	at    time.Time
	items []*pb.Reclaimable
}

// segmentTiers maps segment ids to their tiers.
func (s *Server) segmentTiers() map[string]pb.Tier {
	tiers := map[string]pb.Tier{}
	for _, v := range s.fsm.segmentViews() {
		tiers[v.id] = v.tier
	}
	return tiers
}
