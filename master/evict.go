package master

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Eviction and pin defaults of the design card.
const (
	DefaultHighWatermark = 0.90
	DefaultEvictRatio    = 0.05
	DefaultSoftPinTTL    = 30 * time.Minute
	MaxSoftPinTTL        = 24 * time.Hour
	// evictBatch bounds the keys of one raft entry.
	evictBatch = 256
)

// The leader evicts on its own in two cases: a segment above the high
// watermark is brought down by the evict ratio (sweep), and a put that
// finds no room makes room first (BatchPutStart). Victims are complete
// objects, least recently used first (recency is leader-local: the last
// get or put this leader saw, else creation), never read-leased or hard
// pinned; soft-pinned ones only when the rest did not free enough.

// touch records an access for recency.
func (s *Server) touch(keys []string, now time.Time) { s.fsm.touch(keys, now.UnixNano()) }

// byRecency sorts objects in the order eviction takes them, and reports
// which were read-leased at now when scanned. The order is a segmented
// LRU's: least recently used first, but objects read since their put (a
// lookup or get leased them) are kept before objects only put, until read
// ones are more than readShare of objs. An engine puts every block it
// computed, and most are never asked for again (one-shot prompts, the
// last turn of a conversation); a block read once is likely read again.
// Replays of traces chose the share (docs/benchmarks.md).
func (s *Server) byRecency(objs []evictable, now time.Time) (leased map[string]bool) {
	leased = map[string]bool{}
	for _, o := range objs {
		if o.lease > now.UnixNano() {
			leased[o.key] = true
		}
	}
	sortEvictables(objs, func(a, b *evictable) int {
		// When recency ties (a chain put or read in one batch), deeper
		// blocks go first, so no block goes before its descendants and
		// what stays is a matchable prefix; at one depth, leaves first.
		// (Children alone would order only the last leaf: the rest of a
		// chain has one child each, and would go in key order.)
		// (cmp.Or would compare the keys of every pair.)
		if c := cmp.Compare(a.lastUseNano(), b.lastUseNano()); c != 0 {
			return c
		}
		if c := cmp.Compare(b.depth, a.depth); c != 0 {
			return c
		}
		if c := cmp.Compare(a.children, b.children); c != 0 {
			return c
		}
		return cmp.Compare(a.key, b.key)
	})
	keepRead(objs)
	return leased
}

// readShare is the share of the objects eviction weighs that those read
// since their put may keep ahead of the others (the protected segment).
const readShare = 0.6

// keepRead reorders objs, least recently used first, into a segmented
// LRU's order of eviction: objects not read since their put first, each
// part least recently used first, except that while the read ones left
// are more than readShare of objs, the oldest of them goes. Read means
// leased by this leader: a new leader starts with plain LRU.
func keepRead(objs []evictable) {
	var read, unread []evictable
	for _, o := range objs {
		if o.lease != 0 {
			read = append(read, o)
		} else {
			unread = append(unread, o)
		}
	}
	if len(read) == 0 || len(unread) == 0 {
		return
	}
	limit := int(readShare * float64(len(objs)))
	r, u := 0, 0
	for i := range objs {
		if u == len(unread) || len(read)-r > limit {
			objs[i] = read[r]
			r++
		} else {
			objs[i] = unread[u]
			u++
		}
	}
}

// pickVictims chooses, least recently used first, objects worth at least
// need bytes, skipping leased and hard-pinned ones; soft-pinned ones join in
// a second pass only if the first fell short. allowSoft reports whether the
// second pass was needed.
func (s *Server) pickVictims(objs []evictable, need uint64, now time.Time) (victims []evictable, allowSoft bool) {
	leased := s.byRecency(objs, now)
	pass := func(soft bool) (out []evictable, freed uint64) {
		for _, o := range objs {
			if freed >= need {
				break
			}
			if o.hard || leased[o.key] || (o.softPin > now.UnixNano() && !soft) {
				continue
			}
			out = append(out, o)
			freed += o.freed
		}
		return out, freed
	}
	victims, freed := pass(false)
	if freed < need {
		victims, _ = pass(true)
		allowSoft = true
	}
	return victims, allowSoft
}

// evictObjects removes victims through raft, in batches, and returns how
// many objects and bytes went. Their space is reused once the last lease
// on them has ended.
// tier labels the metrics: the tier whose room was wanted ("any" for an
// operator's eviction).
func (s *Server) evictObjects(ctx context.Context, victims []evictable, allowSoft bool, reason, tier string) (n int, bytes uint64, err error) {
	sizes := map[string]evictable{}
	for _, v := range victims {
		sizes[v.key] = v
	}
	now := s.cfg.Now()
	for batch := range slices.Chunk(victims, evictBatch) {
		keys := make([]string, len(batch))
		for i, v := range batch {
			keys[i] = v.key
		}
		freeAfter, done := s.startRemove(keys)
		out, err := s.apply(ctx, &pb.Command{Op: &pb.Command_Evict{Evict: &pb.EvictCmd{
			Keys: keys, FreeAfterUnixNano: freeAfter.UnixNano(), AllowSoftPinned: allowSoft,
			CachedUntilUnixNano: s.cachedEnds(keys),
		}}})
		done()
		if err != nil {
			return n, bytes, err
		}
		for i, e := range out.([]error) {
			if e != nil {
				continue
			}
			v := sizes[keys[i]]
			n++
			bytes += v.size
			s.metrics.evicted(v.tenant, reason, tier, v.size, now.Sub(v.lastUse()))
		}
	}
	return n, bytes, nil
}

// free gives up victims' room on one segment: an object that keeps its
// replica count without this replica loses only this one (an SSD copy of
// a DRAM object on its node, a replica beyond the count), the rest are
// evicted whole: dropping below the count would only start a repair copy
// into the room just freed. It returns what was evicted.
func (s *Server) free(ctx context.Context, seg segmentView, victims []evictable, allowSoft bool, reason string) (n int, bytes uint64, err error) {
	only := victims[:0:0]
	var drops []drop
	nodeOf := s.segmentNodes()
	for _, o := range victims {
		if s.keepsCount(o, seg.id, nodeOf) {
			drops = append(drops, drop{o, seg.id})
			continue
		}
		only = append(only, o)
	}
	s.dropReplicas(ctx, drops, reason)
	return s.evictObjects(ctx, only, allowSoft, reason, seg.tier.Name())
}

// onSegment matches objects with a replica on the segment.
func onSegment(id string) func(evictable) bool {
	return func(o evictable) bool { return slices.Contains(o.segments, id) }
}

func filterObjects(objs []evictable, keep func(evictable) bool) []evictable {
	return slices.DeleteFunc(objs, func(o evictable) bool { return !keep(o) })
}

// segmentPick is what one segment gives up to come down to a watermark.
type segmentPick struct {
	view      segmentView
	victims   []evictable
	allowSoft bool
}

// toWatermark picks, per segment (of tier, if set) fuller than above, the
// victims that bring it to at most mark of its capacity. An object is
// picked once, for the first segment; objects being copied are left out,
// and so are the bytes their moves will free (inflight, by segment).
func (s *Server) toWatermark(mark, above float64, tier pb.Tier, now time.Time, inflight map[string]uint64) []segmentPick {
	all := s.fsm.completeObjects(func(string) bool { return true })
	chosen := map[string]bool{}
	var picks []segmentPick
	for _, v := range s.fsm.segmentViews() {
		if tier != pb.Tier_TIER_UNSPECIFIED && v.tier != tier {
			continue
		}
		limit := uint64(mark * float64(v.capacity))
		if v.used <= limit || float64(v.used) <= above*float64(v.capacity) || v.used-limit <= inflight[v.id] {
			continue
		}
		objs := filterObjects(slices.Clone(all), func(o evictable) bool { return onSegment(v.id)(o) && !chosen[o.key] && !o.copying })
		vs, soft := s.pickVictims(objs, v.used-limit-inflight[v.id], now)
		for _, o := range vs {
			chosen[o.key] = true
		}
		if len(vs) > 0 {
			picks = append(picks, segmentPick{view: v, victims: vs, allowSoft: soft})
		}
	}
	return picks
}

// evictToWatermark is the sweep's eviction: segments above the high
// watermark come down by the evict ratio. A fast tier's objects are demoted
// to a slower tier with room, the slowest tier's are evicted; the slowest
// segments go first, so demotions find room.
func (s *Server) evictToWatermark(ctx context.Context, now time.Time) {
	if now.Before(s.evictableFrom()) {
		return
	}
	high := s.cfg.HighWatermark
	over := false
	for _, v := range s.fsm.segmentViews() {
		over = over || float64(v.used) > high*float64(v.capacity)
	}
	if !over {
		return
	}
	// Only the segments above the high watermark: one between it and the
	// target has not crossed it and keeps its objects.
	picks := s.toWatermark(high-s.cfg.EvictRatio, high, pb.Tier_TIER_UNSPECIFIED, now, s.fsm.movingBytes())
	slices.SortStableFunc(picks, func(a, b segmentPick) int { return cmp.Compare(readRank(b.view.tier), readRank(a.view.tier)) })
	for _, p := range picks {
		victims := p.victims
		if s.hasSlowerTier(p.view.tier) {
			victims = s.demote(ctx, p.view, victims)
		}
		if len(victims) == 0 {
			continue
		}
		n, bytes, err := s.free(ctx, p.view, victims, p.allowSoft, "watermark")
		if err != nil {
			s.log.Warn("evict to the watermark", "segment", p.view.id, "err", err)
			return
		}
		s.log.Info("evicted to the watermark", "segment", p.view.id, "objects", n, "bytes", bytes)
		s.events.evicted(s.cfg.Now(), p.view.id, uint64(n), bytes)
	}
}

// evictableFrom is when this leader may evict: one lease TTL after it took
// over, so no lease an earlier leader granted is broken.
func (s *Server) evictableFrom() time.Time { return s.leadership().evictable }

// leadershipState is this node's leadership as eviction needs it.
type leadershipState struct {
	leading bool // a caught-up leader
	term    uint64
	// evictable is the end of its first lease TTL: until then an object
	// an earlier leader saw complete may be leased by it, and only one
	// made in this term (object.madeIn) is known to be leased by none but
	// this leader.
	evictable time.Time
}

func (s *Server) leadership() leadershipState {
	s.mu.Lock()
	defer s.mu.Unlock()
	return leadershipState{s.mu.leader, s.mu.leaderTerm, s.mu.leaderSince.Add(s.cfg.LeaseTTL + stepDownLag)}
}

// leaderLeaseTimeout is raft's: a leader that has not heard from a quorum
// for this long steps down. It checks every leaderLeaseTimeout, so an old
// leader cut off from the others may go on granting read leases for up to
// stepDownLag after its last contact, which is about when the others may
// elect a new one: a new leader counts its first lease TTL from that much
// later.
const (
	leaderLeaseTimeout = 250 * time.Millisecond
	stepDownLag        = 2 * leaderLeaseTimeout
)

// awaitEvictable waits, for a put that found no room, until this leader
// may evict what an earlier one may have leased, if the put then still has
// at least half its write time. It reports whether it waited (false at
// once if the leader may evict already).
func (s *Server) awaitEvictable(ctx context.Context, deadline time.Time) bool {
	l := s.leadership()
	now := s.cfg.Now()
	if !l.leading || !now.Before(l.evictable) || deadline.Sub(l.evictable) < s.cfg.PutTimeout/2 {
		return false
	}
	return s.sleep(ctx, l.evictable.Sub(now)) == nil
}

// makeRoom evicts from the best segment for an object of size bytes until
// it has a free range that large. It reports whether it made room.
func (s *Server) makeRoom(ctx context.Context, size uint64, tier pb.Tier, host string) bool {
	now := s.cfg.Now()
	// The pool forgets only in its slowest tier (faster ones demote into
	// it), so room is made there first; the put then lands there.
	ids := s.candidates(size, tier, host)
	rank := map[string]int{}
	for _, v := range s.fsm.segmentViews() {
		rank[v.id] = readRank(v.tier)
	}
	slices.SortStableFunc(ids, func(a, b string) int { return cmp.Compare(rank[b], rank[a]) })
	for _, id := range ids {
		if s.roomIn(ctx, id, size, now, "allocation") {
			return true
		}
	}
	return false
}

// roomIn evicts from one segment, least recently used first, until it has
// a free range of size bytes. It reports whether it has.
func (s *Server) roomIn(ctx context.Context, id string, size uint64, now time.Time, reason string) bool {
	for round := 0; round < 4; round++ {
		view, ok := s.segmentView(id)
		if !ok {
			return false
		}
		if view.largestFree >= size {
			return true
		}
		objs := s.fsm.completeOn(id)
		if l := s.leadership(); !l.leading {
			return false
		} else if now.Before(l.evictable) {
			// Only what no earlier leader can have leased.
			objs = filterObjects(objs, func(o evictable) bool { return o.madeIn(l.term) })
		}
		need := size - view.largestFree
		if round > 0 {
			need = size << round // fragmentation: free more each round
		}
		// A full segment stays full under a stream of puts: free down to
		// the sweep's target at once, so the next puts find room without a
		// scan of the object table each.
		if target := uint64((s.cfg.HighWatermark - s.cfg.EvictRatio) * float64(view.capacity)); view.used > target {
			need = max(need, view.used-target)
		}
		victims, soft := s.pickVictims(objs, need, now)
		if len(victims) == 0 {
			return false
		}
		if _, _, err := s.free(ctx, view, victims, soft, reason); err != nil {
			s.log.Warn("evict to make room", "segment", id, "err", err)
			return false
		}
	}
	return false
}

func (s *Server) segmentView(id string) (segmentView, bool) {
	for _, v := range s.fsm.segmentViews() {
		if v.id == id {
			return v, true
		}
	}
	return segmentView{}, false
}

// adminVictims selects what `tidepool admin evict` removes. Key, prefix and
// age filters evict every match, soft pins included (an operator asked),
// but never hard-pinned objects; a watermark evicts as the sweep does.
func (s *Server) adminVictims(req *pb.EvictRequest, now time.Time) (victims []evictable, allowSoft bool, skipped int, err error) {
	if req.OlderThanMs > uint64(100*365*24*time.Hour/time.Millisecond) {
		return nil, false, 0, fmt.Errorf("%w: an age of %d ms is out of range", ErrInvalidRequest, req.OlderThanMs)
	}
	if req.Key == "" && req.Prefix == "" && req.Tenant == "" && req.OlderThanMs == 0 && req.ToWatermark == 0 {
		return nil, false, 0, fmt.Errorf("%w: evict needs a key, a prefix, a tenant, an age or a watermark", ErrInvalidRequest)
	}
	if !(req.ToWatermark >= 0 && req.ToWatermark < 1) { // NaN too: it is not 0, so it would match every object
		return nil, false, 0, fmt.Errorf("%w: watermark %v is not in [0, 1)", ErrInvalidRequest, req.ToWatermark)
	}
	if req.ToWatermark > 0 {
		if req.Key != "" || req.Prefix != "" || req.Tenant != "" || req.OlderThanMs != 0 {
			return nil, false, 0, fmt.Errorf("%w: a watermark eviction takes no key, prefix, tenant or age", ErrInvalidRequest)
		}
		for _, p := range s.toWatermark(req.ToWatermark, req.ToWatermark, req.Tier, now, nil) {
			victims = append(victims, p.victims...)
			allowSoft = allowSoft || p.allowSoft
		}
		return victims, allowSoft, 0, nil
	}
	objs := s.fsm.completeObjects(func(k string) bool {
		return (req.Key == "" || k == req.Key) && strings.HasPrefix(k, req.Prefix)
	})
	segTier := map[string]pb.Tier{}
	for _, v := range s.fsm.segmentViews() {
		segTier[v.id] = v.tier
	}
	cutoff := now.Add(-time.Duration(req.OlderThanMs) * time.Millisecond)
	s.byRecency(objs, now)
	victims = objs[:0] // filtered in place
	for _, o := range objs {
		if (req.OlderThanMs > 0 && o.lastUse().After(cutoff)) || (req.Tenant != "" && o.tenant != req.Tenant) {
			continue
		}
		if req.Tier != pb.Tier_TIER_UNSPECIFIED && !slices.ContainsFunc(o.segments, func(id string) bool { return segTier[id] == req.Tier }) {
			continue
		}
		if o.hard {
			skipped++
			continue
		}
		victims = append(victims, o)
	}
	return victims, true, skipped, nil
}
