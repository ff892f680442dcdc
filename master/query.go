package master

import (
	"cmp"
	"slices"
	"strings"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
	"github.com/tidepool-kv/tidepool/ticket"
)

// Read-only views of the FSM for the services. They take the read lock and
// return copies, so callers never race with Apply.

// replicas describes keys' replicas with tickets for a, recording the read
// at now (unix nanos) for recency.
func (f *FSM) replicas(keys []string, objs []*object, now int64, a access) []*pb.ObjectReplicas {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make([]*pb.ObjectReplicas, len(keys))
	for i, k := range keys {
		o := objs[i]
		if o == nil || o.gone() || !o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) {
			out[i] = &pb.ObjectReplicas{Status: itemStatus(errorf(ErrNotFound, k))}
			continue
		}
		o.used.Store(now)
		f.touchAncestors(o, now)
		out[i] = &pb.ObjectReplicas{Status: itemStatus(nil), Size: o.size, Checksum: o.checksum, Replicas: f.describe(o.size, f.exts(o), a)}
	}
	return out
}

// complete returns the objects of keys that are complete, nil for the
// others.
func (f *FSM) complete(keys []string) []*object {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make([]*object, len(keys))
	for i, k := range keys {
		if o := f.objects.get(k); o != nil && o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) {
			out[i] = o
		}
	}
	return out
}

// leaseEnd is when the last read lease this leader granted on the objects
// of keys ends (unix nanos; 0: none).
func (f *FSM) leaseEnd(keys []string) int64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var end int64
	for _, k := range keys {
		if o := f.objects.get(k); o != nil {
			end = max(end, o.lease.Load())
		}
	}
	return end
}

// madeIn reports whether every object of keys that is there became
// complete in raft term term.
func (f *FSM) madeIn(keys []string, term uint64) bool {
	f.mu.RLock()
	defer f.mu.RUnlock()
	for _, k := range keys {
		if o := f.objects.get(k); o != nil && !o.madeIn(term) {
			return false
		}
	}
	return true
}

// leasedAt reports which of keys have objects read-leased at now.
func (f *FSM) leasedAt(keys []string, now int64) map[string]bool {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := map[string]bool{}
	for _, k := range keys {
		if o := f.objects.get(k); o != nil && o.lease.Load() > now {
			out[k] = true
		}
	}
	return out
}

// access is what a descriptor's ticket allows: op (none if 0) on its
// extent until expiry (unix nanos), for the put or copy id.
type access struct {
	op     ticket.Op
	id     uint64
	expiry int64
}

// ticket signs a for the n bytes at off of s: nil if a allows nothing or
// s's store checks no tickets.
func (s *segment) ticket(a access, off, n uint64) []byte {
	if a.op == 0 || s.key == nil {
		return nil
	}
	return s.key.Sign(ticket.Ticket{Op: a.op, ID: a.id, Off: off, Len: n, Expiry: a.expiry})
}

// describe turns extents of size bytes into replica descriptors with
// tickets for a, fastest tier first (readers try them in order); f.mu must
// be held.
func (f *FSM) describe(size uint64, exts []extent, a access) []*pb.Replica {
	out := make([]*pb.Replica, 0, len(exts))
	for _, e := range exts {
		s := f.seg(e)
		if s == nil {
			continue
		}
		r := new(pb.Replica)
		s.describe(r, e.offset(), size, a)
		out = append(out, r)
	}
	slices.SortStableFunc(out, func(a, b *pb.Replica) int { return cmp.Compare(readRank(a.Tier), readRank(b.Tier)) })
	return out
}

// describe fills r with the descriptor of the size bytes at off of s,
// with a ticket for a.
func (s *segment) describe(r *pb.Replica, off, size uint64, a access) {
	r.Segment, r.Node, r.Endpoint, r.Offset, r.Length, r.Tier = s.id, s.node, s.endpoint, off, size, s.tier
	r.Ticket = s.ticket(a, off, size)
}

// describePlaced is describe for the extents of one put, as placed. A put
// of one replica (rec not nil) is described in rec.
func (f *FSM) describePlaced(exts []*pb.Extent, a access, rec *putRecord) []*pb.Replica {
	if len(exts) == 0 {
		return nil
	}
	if len(exts) == 1 && rec != nil {
		e := f.extentOn(exts[0].Segment, exts[0].Offset)
		s := f.seg(e)
		if s == nil {
			return nil
		}
		s.describe(&rec.replica, e.offset(), exts[0].Length, a)
		rec.reps[0] = &rec.replica
		return rec.reps[:]
	}
	es := make([]extent, len(exts))
	for i, e := range exts {
		es[i] = f.extentOn(e.Segment, e.Offset)
	}
	return f.describe(exts[0].Length, es, a)
}

// readRank orders tiers by how fast a host reader gets their bytes: DRAM
// (a memcpy or one socket copy), HBM (staged through host memory), SSD.
func readRank(t pb.Tier) int {
	switch t {
	case pb.Tier_TIER_DRAM:
		return 0
	case pb.Tier_TIER_HBM:
		return 1
	}
	return 2
}

func (f *FSM) exists(keys []string) []bool {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make([]bool, len(keys))
	for i, k := range keys {
		o := f.objects.get(k)
		out[i] = o != nil && o.is(pb.ObjectState_OBJECT_STATE_COMPLETE)
	}
	return out
}

// list returns up to limit objects with the prefix, in key order, after the
// given key, and whether more follow. It takes the table a shard at a time
// under the read lock, keeping only the limit smallest keys that qualify
// (a heap): a page costs a pass over the keys, never a sort of them, and
// Apply waits for one shard at most. An object put or removed meanwhile
// may be in the page or not.
func (f *FSM) list(prefix, after string, limit int) ([]*pb.ObjectInfo, bool) {
	for {
		h := &keyHeap{}
		for si := range tableShards {
			f.mu.RLock()
			f.objects.inShard(si, func(o *object) bool {
				if k := o.key(); k > after && strings.HasPrefix(k, prefix) {
					h.offer(k, limit+1)
				}
				return true
			})
			f.mu.RUnlock()
		}
		keys := h.keys
		slices.Sort(keys)
		truncated := len(keys) > limit
		if truncated {
			keys = keys[:limit]
		}
		// Keys removed since the pass leave the page short; a page left
		// empty but truncated would give the caller no key to go on
		// after, so the pass goes on from the last key it found.
		if out := f.infos(keys); len(out) > 0 || !truncated {
			return out, truncated
		}
		after = keys[len(keys)-1]
	}
}

// keyHeap keeps the smallest keys offered, at most some number of them: a
// max-heap, so the largest kept is the one a smaller key replaces.
type keyHeap struct{ keys []string }

func (h *keyHeap) offer(k string, most int) {
	if len(h.keys) < most {
		h.keys = append(h.keys, k)
		for i := len(h.keys) - 1; i > 0; {
			p := (i - 1) / 2
			if h.keys[p] >= h.keys[i] {
				break
			}
			h.keys[p], h.keys[i] = h.keys[i], h.keys[p]
			i = p
		}
		return
	}
	if k >= h.keys[0] {
		return
	}
	h.keys[0] = k
	for i := 0; ; {
		l, r, big := 2*i+1, 2*i+2, i
		if l < len(h.keys) && h.keys[l] > h.keys[big] {
			big = l
		}
		if r < len(h.keys) && h.keys[r] > h.keys[big] {
			big = r
		}
		if big == i {
			return
		}
		h.keys[i], h.keys[big] = h.keys[big], h.keys[i]
		i = big
	}
}

// segmentView is a snapshot of one segment for placement and status.
type segmentView struct {
	id, node, endpoint string
	tier               pb.Tier
	epoch              uint64
	capacity, used     uint64
	largestFree        uint64
	reserved           uint64 // set aside for puts, not in used
	objects            int
	draining           bool // its node is being drained
	adopting           bool // its node is re-adopting kept objects
}

// closed reports whether placement must skip the segment: its node is
// draining, or still re-adopting what it kept across a restart.
func (v segmentView) closed() bool { return v.draining || v.adopting }

func (f *FSM) segmentViews() []segmentView {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make([]segmentView, 0, len(f.segments))
	for _, s := range f.segments {
		out = append(out, segmentView{
			id: s.id, node: s.node, endpoint: s.endpoint, tier: s.tier, epoch: s.epoch,
			capacity: s.alloc.capacity, used: s.alloc.used - s.reserved(), reserved: s.reserved(), largestFree: s.alloc.largestFree(), objects: s.objects,
			draining: f.nodes[s.node] != nil && f.nodes[s.node].draining,
			adopting: f.nodes[s.node] != nil && f.nodes[s.node].adopting,
		})
	}
	slices.SortFunc(out, func(a, b segmentView) int { return cmp.Compare(a.id, b.id) })
	return out
}

// segmentName is segment id's node, epoch and name on the node, if it
// exists.
func (f *FSM) segmentName(id string) (node string, epoch uint64, name string, ok bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	s := f.segments[id]
	if s == nil {
		return "", 0, "", false
	}
	return s.node, s.epoch, s.name, true
}

// warm reads ahead the table slots of n keys' lookups (objectTable.warm).
func (f *FSM) warm(n int, key func(int) string) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	f.objects.warm(n, key)
}

// putState is what a put of key finds: COMPLETE (nothing to write),
// PROCESSING (a put started by an older master's PutStartCmd, not yet
// expired) or UNSPECIFIED.
func (f *FSM) putState(key string, now int64) pb.ObjectState {
	f.mu.RLock()
	defer f.mu.RUnlock()
	o := f.objects.get(key)
	switch {
	case o == nil:
		return pb.ObjectState_OBJECT_STATE_UNSPECIFIED
	case o.is(pb.ObjectState_OBJECT_STATE_COMPLETE):
		return o.pbState()
	case now <= f.deadline(o):
		return pb.ObjectState_OBJECT_STATE_PROCESSING
	}
	return pb.ObjectState_OBJECT_STATE_UNSPECIFIED
}

// objectStats counts objects and the bytes of complete ones.
func (f *FSM) objectStats() (processing, complete int, completeBytes uint64) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.counts.processing, f.counts.complete, f.counts.completeBytes
}

// walk calls visit for every object, a shard of the table at a time under
// the read lock: Apply, and so every put, waits for one shard at most, not
// for the table. An object added or removed meanwhile may be visited or
// not; visit runs under the read lock, and shardDone (if not nil) after
// each shard, without it: what visit gathers into a buffer of one shard
// goes to a result that grows with the table there, so no growth of that
// (a copy of all gathered so far) holds the lock.
func (f *FSM) walk(visit func(*object), shardDone func()) {
	for si := range tableShards {
		f.mu.RLock()
		f.objects.inShard(si, func(o *object) bool {
			visit(o)
			return true
		})
		f.mu.RUnlock()
		if shardDone != nil {
			shardDone()
		}
	}
}

// expiredPuts lists PROCESSING objects whose deadline is before now.
func (f *FSM) expiredPuts(now int64) []string {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var keys []string
	for o := range f.inFlight {
		if o.is(pb.ObjectState_OBJECT_STATE_PROCESSING) && f.deadline(o) < now {
			keys = append(keys, o.key())
		}
	}
	slices.Sort(keys)
	return keys
}

// liveNodes returns the epoch of every node that is not down.
func (f *FSM) liveNodes() map[string]uint64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := map[string]uint64{}
	for id, n := range f.nodes {
		if !n.down {
			out[id] = n.epoch
		}
	}
	return out
}

func (f *FSM) member(id string) string {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.members[id]
}

// info describes an object; f.mu must be held.
func (f *FSM) info(o *object) *pb.ObjectInfo {
	return &pb.ObjectInfo{
		Key: o.key(), Size: o.size, State: o.pbState(), Checksum: o.checksum,
		CreatedUnixMs: o.created / 1e6, Replicas: f.describe(o.size, f.exts(o), access{}),
		HardPinned: o.hard(), SoftPinUntilUnixMs: f.softPin(o) / 1e6, Parent: o.parent(), Tenant: f.tenantOf(o),
	}
}

// evictable is a complete object as eviction sees it.
type evictable struct {
	key      string
	size     uint64
	freed    uint64 // allocated bytes its replicas hold (sizes rounded up per segment)
	created  int64
	hard     bool
	softPin  int64
	segments []string
	checksum uint32
	putID    uint64
	copying  bool // a copy of it is in progress
	children int  // objects that name it as their parent
	depth    int  // its ancestors in the table, by parent keys: 0 for a chain's root
	tenant   string
	used     int64 // the object's used, when scanned
	lease    int64 // the end of its read lease, when scanned
	inTerm   bool  // published in the term its put id names (see object.madeIn)
	want     int   // the nodes its put asked for replicas on
}

// madeIn reports whether the object became complete in raft term term.
func (o evictable) madeIn(term uint64) bool { return o.inTerm && o.putID>>40 == term }

// lastUse is an object's recency: the last access this leader saw, else
// its creation.
func (o evictable) lastUse() time.Time { return time.Unix(0, o.lastUseNano()) }

func (o evictable) lastUseNano() int64 {
	if o.used > 0 {
		return o.used
	}
	return o.created
}

// touch records an access of keys at now (unix nanos), for recency, and
// of their ancestors: a block is worth nothing without its prefix, so no
// block is less recent than its descendants, and eviction (deeper first
// among equals) keeps what stays of a chain matchable. The walk up stops
// at an ancestor this or a later access touched already, so a chain put
// in one batch walks its chain once; all walks of a call share
// maxChainWalk steps.
func (f *FSM) touch(keys []string, now int64) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	for _, k := range keys {
		if o := f.objects.get(k); o != nil {
			o.used.Store(now)
			f.touchAncestors(o, now)
		}
	}
}

// touchAncestors records an access of o's ancestors at now, up to one
// touched as late (so a chain read or put in one call walks once) and at
// most maxChainWalk of them. f.mu is held (read or write).
func (f *FSM) touchAncestors(o *object, now int64) {
	for range maxChainWalk {
		if o = f.objects.get(o.parent()); o == nil || o.used.Load() >= now {
			return
		}
		o.used.Store(now)
	}
}

// completeObjects lists the complete objects that match, in no order.
func (f *FSM) completeObjects(match func(key string) bool) []evictable {
	return f.scan(func(o *object) bool { return match(o.key()) })
}

// scanTenant lists tenant's complete objects, in no order.
func (f *FSM) scanTenant(tenant string) []evictable {
	return f.scan(func(o *object) bool { return f.tenantOf(o) == tenant })
}

// completeOn lists the complete objects with a replica on segment id, in
// no order; it builds nothing for the others.
func (f *FSM) completeOn(id string) []evictable {
	return f.scan(func(o *object) bool {
		return f.onSegment(o, id)
	})
}

// scan lists the complete objects keep accepts, in no order (its callers
// sort by recency, or by key: see byKey), in a walk of the table (see
// walk). keep runs under the read lock.
func (f *FSM) scan(keep func(*object) bool) []evictable {
	var chunks [][]evictable
	var shard []evictable
	depths := map[*object]int{}
	f.walk(func(o *object) {
		if !o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) || !keep(o) {
			return
		}
		e := evictable{
			key: o.key(), size: o.size, created: o.created, hard: o.hard(), softPin: f.softPin(o), checksum: o.checksum,
			putID: o.putID, copying: len(f.copies(o)) > 0, children: f.children[o.key()], tenant: f.tenantOf(o),
			depth: f.depth(o, depths), used: o.used.Load(), lease: o.lease.Load(), inTerm: o.flags&flagPublishedInTerm != 0,
			want: f.want(o),
		}
		for _, r := range f.exts(o) {
			if s := f.seg(r); s != nil {
				e.segments = append(e.segments, s.id)
				e.freed = max(e.freed, s.alloc.rounded(o.size))
			}
		}
		shard = append(shard, e)
	}, func() {
		if len(shard) > 0 {
			chunks, shard = append(chunks, shard), nil
		}
	})
	return slices.Concat(chunks...) // one copy, not one per growth
}

// byKey orders objects by key.
func byKey(objs []evictable) {
	sortEvictables(objs, func(a, b *evictable) int { return cmp.Compare(a.key, b.key) })
}

// sortEvictables sorts objs by cmp, a total order. It sorts indices and
// moves each record once: an evictable is large, and sorting the records
// themselves spent most of a scan of 100,000 objects moving them.
func sortEvictables(objs []evictable, cmp func(a, b *evictable) int) {
	idx := make([]int32, len(objs))
	for i := range idx {
		idx[i] = int32(i)
	}
	slices.SortFunc(idx, func(i, j int32) int { return cmp(&objs[i], &objs[j]) })
	sorted := make([]evictable, len(objs))
	for j, i := range idx {
		sorted[j] = objs[i]
	}
	copy(objs, sorted)
}

// infoChunk is how many objects infos describes under one hold of the
// read lock: about a millisecond of work.
const infoChunk = 1024

// depth counts o's ancestors in the table, following parent keys up to
// the first one missing; memo keeps the depths found below the roots, so a
// scan of the table walks each chain once. A loop of links (the services
// refuse them, but two concurrent puts can make one) ends the walk as a
// missing parent would, and so does a walk of maxChainWalk links. f.mu
// must be held.
func (f *FSM) depth(o *object, memo map[*object]int) int {
	if o.parent() == "" {
		return 0
	}
	if d, ok := memo[o]; ok && d != onPath {
		return d
	}
	var buf [32]*object
	path := append(buf[:0], o)
	memo[o] = onPath
	base := -1 // depth of the ancestor the walk stopped at; -1: none
	for len(path) < maxChainWalk {
		k := path[len(path)-1].parent()
		if k == "" {
			break
		}
		p := f.objects.get(k)
		if p == nil {
			break
		}
		if d, ok := memo[p]; ok {
			if d != onPath {
				base = d
			}
			break
		}
		path = append(path, p)
		memo[p] = onPath
	}
	if path[len(path)-1].parent() == "" {
		// The walk ended at a root, which memo leaves out.
		delete(memo, path[len(path)-1])
		path, base = path[:len(path)-1], 0
	}
	for i := len(path) - 1; i >= 0; i-- {
		base++
		memo[path[i]] = base
	}
	return base
}

// onPath marks in depth's memo a key on the walk in progress.
const onPath = -1

// infos describes the named objects that exist.
// It holds the read lock for a chunk of keys at a time.
func (f *FSM) infos(keys []string) []*pb.ObjectInfo {
	var out []*pb.ObjectInfo
	for len(keys) > 0 {
		chunk := keys[:min(len(keys), infoChunk)]
		keys = keys[len(chunk):]
		f.mu.RLock()
		for _, k := range chunk {
			if o := f.objects.get(k); o != nil {
				out = append(out, f.info(o))
			}
		}
		f.mu.RUnlock()
	}
	return out
}

// maxPageBytes bounds a page of a segment's objects, well under the 64 MiB
// gRPC message limit.
const maxPageBytes = 8 << 20

// segmentObjects lists, in key order, up to limit complete objects with a
// replica on segment id and a key after the given one, as the node sees
// them (its segment name), and whether more follow. It copies what it
// needs in one pass under the read lock and sorts after releasing it, so
// Apply waits only for the pass.
func (f *FSM) segmentObjects(id, name, after string, limit int) ([]*pb.AdoptedObject, bool) {
	type kept struct {
		key, parent, tenant string
		offset, size        uint64
		checksum            uint32
		hard                bool
		softPin             int64
	}
	var all, shard []kept
	f.walk(func(o *object) {
		if k := o.key(); k > after && o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) {
			for _, r := range f.exts(o) {
				if f.segID(r) == id {
					shard = append(shard, kept{k, o.parent(), f.tenantOf(o), r.offset(), o.size, o.checksum, o.hard(), f.softPin(o)})
				}
			}
		}
	}, func() { all, shard = append(all, shard...), shard[:0] })
	byKey := func(a, b kept) int { return strings.Compare(a.key, b.key) }
	more := len(all) > limit
	if more { // only the page's objects need sorting
		selectSmallest(all, limit, byKey)
		all = all[:limit]
	}
	slices.SortFunc(all, byKey)
	// At most limit objects and about maxPageBytes encoded: keys, parents
	// and tenants may each be 4 KiB.
	n, bytes := 0, 0
	for n < len(all) && n < limit {
		bytes += len(all[n].key) + len(all[n].parent) + len(all[n].tenant) + len(name) + 48
		if n > 0 && bytes > maxPageBytes {
			break
		}
		n++
	}
	more = more || n < len(all)
	all = all[:n]
	out := make([]*pb.AdoptedObject, len(all))
	for i, o := range all {
		out[i] = &pb.AdoptedObject{
			Key: o.key, Segment: name, Offset: o.offset, Size: o.size, Checksum: o.checksum,
			HardPinned: o.hard, SoftPinUntilUnixNano: o.softPin, Parent: o.parent, Tenant: o.tenant,
		}
	}
	return out, more
}

// movingBytes sums, by source segment, the sizes of objects being moved
// off it (demoted or drained): room that is on its way.
func (f *FSM) movingBytes() map[string]uint64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := map[string]uint64{}
	for o := range f.copying {
		for _, c := range f.copies(o) {
			if moves(c.Reason) {
				out[c.Source] += o.size
			}
		}
	}
	return out
}

// drained reports whether node was drained in epoch.
func (f *FSM) drained(node string, epoch uint64) bool {
	f.mu.RLock()
	defer f.mu.RUnlock()
	n := f.nodes[node]
	return n != nil && n.drained && n.epoch == epoch
}

// selectSmallest moves the k smallest elements of s (by cmp) to its front,
// in no particular order: a quickselect, linear on average, so a page of a
// large table does not cost a sort of the whole table.
func selectSmallest[T any](s []T, k int, cmp func(a, b T) int) {
	lo, hi := 0, len(s)-1
	for lo < hi {
		// Median of three for the pivot, moved to hi.
		mid := lo + (hi-lo)/2
		if cmp(s[mid], s[lo]) < 0 {
			s[mid], s[lo] = s[lo], s[mid]
		}
		if cmp(s[hi], s[lo]) < 0 {
			s[hi], s[lo] = s[lo], s[hi]
		}
		if cmp(s[mid], s[hi]) < 0 {
			s[mid], s[hi] = s[hi], s[mid]
		}
		p := lo
		for i := lo; i < hi; i++ {
			if cmp(s[i], s[hi]) < 0 {
				s[i], s[p] = s[p], s[i]
				p++
			}
		}
		s[p], s[hi] = s[hi], s[p]
		switch {
		case p == k:
			return
		case p < k:
			lo = p + 1
		default:
			hi = p - 1
		}
	}
}

// cachedUntil is, per key, when the last lookup lease this leader granted
// on it ends, and, for an object not made in term, no earlier than from
// (unix nanos; 0: none). Nil if every one is 0.
func (f *FSM) cachedUntil(keys []string, term uint64, from int64) []int64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var out []int64
	for i, k := range keys {
		var end int64
		if o := f.objects.get(k); o != nil {
			end = o.cachedUntil()
			if !o.madeIn(term) {
				end = max(end, from)
			}
		}
		if end != 0 && out == nil {
			out = make([]int64, len(keys))
		}
		if out != nil {
			out[i] = end
		}
	}
	return out
}

// tombUntil is until when a client may answer one of keys from its lookup
// cache with an incarnation removed before (unix nanos; 0: none may).
func (f *FSM) tombUntil(keys []string) int64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.tombs.latest(keys)
}

// tombsOf is tombUntil of each of n keys, key(i) the i-th; nil if none
// has a tomb.
func (f *FSM) tombsOf(n int, key func(int) string) []int64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if len(f.tombs.until) == 0 {
		return nil
	}
	out := make([]int64, n)
	for i := range out {
		out[i] = f.tombs.until[key(i)]
	}
	return out
}

// unchanged reports whether o, scanned earlier, is still in the table as
// it was: the same put, complete, on the same segments, not used, pinned
// or copied since.
func (f *FSM) unchanged(o evictable) bool {
	f.mu.RLock()
	defer f.mu.RUnlock()
	cur := f.objects.get(o.key)
	if cur == nil || cur.putID != o.putID || !cur.is(pb.ObjectState_OBJECT_STATE_COMPLETE) || cur.hard() ||
		f.softPin(cur) != o.softPin || cur.used.Load() != o.used || len(f.copies(cur)) > 0 {
		return false
	}
	exts := f.exts(cur)
	if len(exts) != len(o.segments) {
		return false
	}
	for i, r := range exts {
		if f.segID(r) != o.segments[i] {
			return false
		}
	}
	return true
}
