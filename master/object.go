package master

import (
	"slices"
	"sync/atomic"
	"unsafe"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// object is one key's record. A master holds millions, and a record the
// garbage collector must scan costs it mark work on every cycle, so a
// record holds no Go pointer: it is one allocation of pointer-free memory,
// these fixed fields followed by the bytes of the key and of the parent
// key. Its first replica is inline, naming its segment by index; the
// fields few objects have (more replicas, pins, copies in flight, a legacy
// put's deadline) live in FSM.rares.
type object struct {
	size    uint64
	created int64
	putID   uint64
	// used is leader-local soft state kept here so that recency costs no
	// map entry per object: the last get or put this node saw while it
	// led (unix nanos; 0: none, the creation counts). Apply never reads
	// it, and it is not in snapshots.
	used atomic.Int64
	// lease is soft state of the same kind: when the last read lease this
	// node granted on the object ends (unix nanos). Kept here, a lookup of
	// N blocks costs N atomic stores rather than N map writes under a lock.
	lease     atomic.Int64
	one       [1]extent // the replica, unless rare.more holds them all
	checksum  uint32
	tenant    uint16 // index in FSM.tenantAt; 0: none, or the rare part's
	keyLen    uint16
	parentLen uint16
	state     uint8 // a pb.ObjectState
	flags     uint8
}

// The flags; gone is set under f.mu when the object leaves the table, so
// a reader holding it rereads.
const (
	flagHard    uint8 = 1 << iota // hard pinned: never evicted
	flagHasRare                   // FSM.rares has its rare part
	flagGone                      // out of the table
	// flagPublishedInTerm: published in the term its put id names (put
	// ids are term<<40 | seq), so no leader of an earlier term saw it
	// complete, nor leased it.
	flagPublishedInTerm
)

// madeIn reports whether the object became complete in raft term term.
func (o *object) madeIn(term uint64) bool {
	return o.flags&flagPublishedInTerm != 0 && o.putID>>40 == term
}

func (o *object) hard() bool    { return o.flags&flagHard != 0 }
func (o *object) hasRare() bool { return o.flags&flagHasRare != 0 }
func (o *object) gone() bool    { return o.flags&flagGone != 0 }

func (o *object) setFlag(f uint8, on bool) {
	if on {
		o.flags |= f
	} else {
		o.flags &^= f
	}
}

func (o *object) is(s pb.ObjectState) bool  { return o.state == uint8(s) }
func (o *object) pbState() pb.ObjectState   { return pb.ObjectState(o.state) }
func (o *object) setState(s pb.ObjectState) { o.state = uint8(s) }

// leaseCached is the low bit of object.lease: set while the lease covers
// one a lookup granted, whose answer its client may cache (see
// FSM.tombs). The end itself is kept even, rounded up, so that it is never
// before the lease's tickets expire.
const leaseCached = 1

// leaseUntil extends the object's read lease, granted at now, to end no
// earlier than exp; cached if a lookup granted it.
func (o *object) leaseUntil(now, exp int64, cached bool) {
	for {
		old := o.lease.Load()
		flag := old & leaseCached
		if old&^leaseCached <= now { // the lease ended, and its mark with it
			flag = 0
		}
		if cached {
			flag = leaseCached
		}
		v := max(old&^leaseCached, exp+exp&leaseCached) | flag
		if v == old || o.lease.CompareAndSwap(old, v) {
			return
		}
	}
}

// cachedUntil is when the object's lease ends if a lookup granted it,
// else 0.
func (o *object) cachedUntil() int64 {
	if l := o.lease.Load(); l&leaseCached != 0 {
		return l &^ leaseCached
	}
	return 0
}

// extent is where one replica of an object lies; its length is the
// object's size. The offset is two 32-bit halves so that an extent packs
// into 12 bytes with no padding, and a record's fixed fields into 64.
type extent struct {
	seg          uint32 // index in FSM.segAt; 0: none
	offLo, offHi uint32
}

func newExtent(off uint64, seg uint32) extent {
	return extent{seg: seg, offLo: uint32(off), offHi: uint32(off >> 32)}
}

func (e extent) offset() uint64 { return uint64(e.offHi)<<32 | uint64(e.offLo) }

// rare holds the fields few objects have.
type rare struct {
	more     []extent // all the replicas, when there are several
	deadline int64    // unix nanos after which a PROCESSING put is revoked
	softPin  int64    // soft pinned until then (unix nanos)
	tenant   string   // a tenant beyond the interned ones
	copies   []*pb.PendingCopy
	want     uint8 // the nodes its put asked for replicas on, if more than one
}

func (r *rare) empty() bool {
	return len(r.more) == 0 && r.deadline == 0 && r.softPin == 0 && r.tenant == "" && len(r.copies) == 0 && r.want == 0
}

// maxWanted bounds the replicas an object may ask for; the gRPC layer
// refuses more.
const maxWanted = 16

// wanted is the want a rare part keeps for a put that asked for n
// replicas: 0 for one (the default, kept in no rare part).
func wanted(n uint32) uint8 {
	if n <= 1 {
		return 0
	}
	return uint8(min(n, maxWanted))
}

// want is how many nodes o's put asked for replicas on (at least 1).
func (f *FSM) want(o *object) int {
	if r := f.rareOf(o); r != nil && r.want > 1 {
		return int(r.want)
	}
	return 1
}

// nodesHolding counts the distinct nodes exts lie on.
func (f *FSM) nodesHolding(exts []extent) int {
	n := 0
	for i, e := range exts {
		s := f.seg(e)
		if s == nil {
			continue
		}
		if !slices.ContainsFunc(exts[:i], func(x extent) bool { p := f.seg(x); return p != nil && p.node == s.node }) {
			n++
		}
	}
	return n
}

const objectHeader = unsafe.Sizeof(object{})

// allocObject allocates a record with room for the key and parent bytes,
// and copies them in. The memory is typed as words without pointers, so
// the collector never scans it; strings the record hands out point into
// it and keep it alive.
func allocObject(key, parent string) *object {
	n := int(objectHeader) + len(key) + len(parent)
	words := make([]uint64, (n+7)/8)
	o := (*object)(unsafe.Pointer(unsafe.SliceData(words)))
	o.keyLen, o.parentLen = uint16(len(key)), uint16(len(parent))
	tail := unsafe.Slice((*byte)(unsafe.Add(unsafe.Pointer(o), objectHeader)), len(key)+len(parent))
	copy(tail, key)
	copy(tail[len(key):], parent)
	return o
}

// recordable reports whether a record can hold key and parent: the
// gRPC layer refuses longer ones, and Apply refuses them from any log.
func recordable(key, parent string) bool {
	return key != "" && len(key) <= MaxKeyLen && len(parent) <= MaxKeyLen
}

// key is the object's key; the string shares the record's bytes.
func (o *object) key() string {
	return unsafe.String((*byte)(unsafe.Add(unsafe.Pointer(o), objectHeader)), int(o.keyLen))
}

// parent is the key of the previous block of the object's chain, if any.
func (o *object) parent() string {
	if o.parentLen == 0 {
		return ""
	}
	return unsafe.String((*byte)(unsafe.Add(unsafe.Pointer(o), objectHeader+uintptr(o.keyLen))), int(o.parentLen))
}

// maxChainWalk bounds the walks up a chain's parent links (those of one
// batch of puts together); a put whose walk does not end within it (a
// chain of a million tokens in blocks of 16) counts as a loop.
const maxChainWalk = 1 << 16

// loopingParents reports, for each item of a batch of puts in order,
// whether its parent would close a loop of parent links: the parent is the
// item itself, or descends from it through the table's links and those of
// the batch's earlier items (an item refused adds none). Only a key that
// some link already names as a parent can be an ancestor, so the blocks of
// a chain put in order walk nothing.
func (f *FSM) loopingParents(n int, item func(int) (key, parent string)) []bool {
	out := make([]bool, n)
	for i := range n {
		if _, p := item(i); p != "" {
			break
		}
		if i == n-1 {
			return out // no item adds a link, so none closes a loop
		}
	}
	// While the accepted items form one chain in order (each the parent of
	// the next), what they name is the first's parent and their own keys:
	// no map needed. A repeated key adds no link (its put fails as in
	// progress, or publishes nothing), so only the first's parent matters.
	chain, accepted := true, 0
	var first, last string
	var local map[string]string // key -> parent of the batch's accepted items
	var named map[string]int    // parents those name
	toMaps := func(upto int) {
		chain = false
		local, named = make(map[string]string, n), make(map[string]int, n)
		for j := range upto {
			if !out[j] {
				kj, pj := item(j)
				local[kj] = pj
				named[pj]++
			}
		}
	}
	parentOf := func(k string) (string, bool) {
		if p, ok := local[k]; ok {
			return p, true
		}
		if o := f.objects.get(k); o != nil {
			return o.parent(), true
		}
		return "", false
	}
	// The walks of one batch share maxChainWalk steps, all under the read
	// lock; puts in chain order spend none.
	budget := maxChainWalk
	f.mu.RLock()
	defer f.mu.RUnlock()
	for i := range out {
		k, p := item(i)
		if chain && accepted > 0 && p != last {
			toMaps(i)
		}
		isNamed := named[k] > 0
		if chain {
			isNamed = accepted > 0 && k == first
		}
		switch {
		case p == "":
		case p == k:
			out[i] = true
		case f.children[k] > 0 || isNamed:
			if chain {
				toMaps(i) // the walk follows the batch's links too
			}
			out[i] = true // unless the walk ends within the batch's budget
			// slow trails at half speed: meeting it means a loop above
			// that k is not on (concurrent puts can make one), not k's.
			for cur, slow := p, p; budget > 0; budget-- {
				steps := maxChainWalk - budget
				next, ok := parentOf(cur)
				if !ok || next == "" {
					out[i] = false
					break
				}
				if next == k {
					break
				}
				if cur = next; steps%2 == 1 {
					slow, _ = parentOf(slow)
				}
				if cur == slow {
					out[i] = false
					break
				}
			}
		}
		if out[i] {
			continue
		}
		if chain {
			if accepted == 0 {
				first = p
			}
			last = k
			accepted++
			continue
		}
		local[k] = p
		named[p]++
	}
	return out
}

// newObject is a complete object of the put described, in the table. It
// keeps the parent link as the log has it, whatever the order objects come
// in (a snapshot restores them in key order): the services refuse puts
// that would close a loop of links, and what reads the links (depth) is
// safe against one that concurrent puts, or an older master, made.
func (f *FSM) newObject(key string, size uint64, checksum uint32, putID uint64, created int64, parent, tenant string, exts []extent) *object {
	o := allocObject(key, parent)
	o.size, o.checksum, o.putID, o.created = size, checksum, putID, created
	o.setState(pb.ObjectState_OBJECT_STATE_COMPLETE)
	if len(exts) == 1 {
		o.one[0] = exts[0]
	}
	t := f.internTenant(tenant)
	o.tenant = t
	if len(exts) > 1 || (t == 0 && tenant != "") {
		f.edit(o, func(r *rare) {
			if len(exts) > 1 {
				r.more = slices.Clone(exts)
			}
			if t == 0 {
				r.tenant = tenant
			}
		})
	}
	f.add(o)
	return o
}

// maxTenants bounds the tenant names interned; objects of further tenants
// keep the name in their rare part.
const maxTenants = 4096

// internTenant returns the index of the tenant name, interning it if
// there is room; 0 for none or no room.
func (f *FSM) internTenant(name string) uint16 {
	if name == "" {
		return 0
	}
	if i, ok := f.tenantIx[name]; ok {
		return i
	}
	if len(f.tenantAt) > maxTenants {
		return 0
	}
	i := uint16(len(f.tenantAt))
	f.tenantAt = append(f.tenantAt, name)
	f.tenantIx[name] = i
	return i
}

// rareOf returns o's rare part, or nil; f.mu must be held.
func (f *FSM) rareOf(o *object) *rare {
	if !o.hasRare() {
		return nil
	}
	return f.rares[o]
}

// exts is o's replicas; the slice must not be kept past f.mu, nor
// written.
func (f *FSM) exts(o *object) []extent {
	if r := f.rareOf(o); r != nil && len(r.more) > 0 {
		return r.more
	}
	if o.one[0].seg == 0 {
		return nil
	}
	return o.one[:]
}

// setExts replaces o's replicas.
func (f *FSM) setExts(o *object, exts []extent) {
	counted := f.objects.get(o.key()) == o
	if counted {
		f.noteChange(o.key())
		f.account(o, -1)
		defer f.account(o, 1)
	}
	if len(exts) == 1 {
		o.one[0] = exts[0]
	} else {
		o.one[0] = extent{}
	}
	f.edit(o, func(r *rare) {
		r.more = nil
		if len(exts) > 1 {
			r.more = slices.Clone(exts)
		}
	})
}

func (f *FSM) deadline(o *object) int64 {
	if r := f.rareOf(o); r != nil {
		return r.deadline
	}
	return 0
}

func (f *FSM) softPin(o *object) int64 {
	if r := f.rareOf(o); r != nil {
		return r.softPin
	}
	return 0
}

func (f *FSM) tenantOf(o *object) string {
	if o.tenant != 0 {
		return f.tenantAt[o.tenant]
	}
	if r := f.rareOf(o); r != nil {
		return r.tenant
	}
	return ""
}

func (f *FSM) copies(o *object) []*pb.PendingCopy {
	if r := f.rareOf(o); r != nil {
		return r.copies
	}
	return nil
}

// edit changes o's rare fields, drops them when none is left set, and
// keeps the sets of objects with a put or copies in flight, so the
// leader's sweeps visit those instead of the whole table. A change of
// o.state is followed by an edit.
func (f *FSM) edit(o *object, fn func(r *rare)) {
	r := rare{}
	if old := f.rareOf(o); old != nil {
		r = *old
	}
	fn(&r)
	if r.empty() {
		delete(f.rares, o)
		o.setFlag(flagHasRare, false)
	} else {
		f.rares[o] = &r
		o.setFlag(flagHasRare, true)
	}
	mark(f.inFlight, o, o.is(pb.ObjectState_OBJECT_STATE_PROCESSING))
	mark(f.copying, o, len(r.copies) > 0)
	if r.want > 1 {
		exts := r.more
		if len(exts) == 0 && o.one[0].seg != 0 {
			exts = o.one[:]
		}
		mark(f.under, o, o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) && f.nodesHolding(exts) < int(r.want))
	} else {
		delete(f.under, o)
	}
}

func mark(set map[*object]struct{}, o *object, in bool) {
	if in {
		set[o] = struct{}{}
	} else {
		delete(set, o)
	}
}

// seg is the segment an extent names, or nil if it is gone.
func (f *FSM) seg(e extent) *segment {
	if int(e.seg) >= len(f.segAt) {
		return nil
	}
	return f.segAt[e.seg]
}

// segID is the id of the segment an extent names ("" if it is gone).
func (f *FSM) segID(e extent) string {
	if s := f.seg(e); s != nil {
		return s.id
	}
	return ""
}

// pbExtent describes a replica of o on the wire and in snapshots.
func (f *FSM) pbExtent(o *object, e extent) *pb.Extent {
	return &pb.Extent{Segment: f.segID(e), Offset: e.offset(), Length: o.size}
}

func (f *FSM) pbExtents(o *object) []*pb.Extent {
	exts := f.exts(o)
	out := make([]*pb.Extent, len(exts))
	for i, e := range exts {
		out[i] = f.pbExtent(o, e)
	}
	return out
}

// onSegment reports whether o has a replica on segment id.
func (f *FSM) onSegment(o *object, id string) bool { return f.replicaOn(o, id) >= 0 }

// extentOn is an extent on segment id at off; its seg is 0 if the
// segment is gone.
func (f *FSM) extentOn(id string, off uint64) extent {
	e := newExtent(off, 0)
	if s := f.segments[id]; s != nil {
		e.seg = s.idx
	}
	return e
}

// replicaOn is the index in f.exts(o) of o's replica on segment id, or -1.
func (f *FSM) replicaOn(o *object, id string) int {
	s := f.segments[id]
	if s == nil {
		return -1
	}
	return slices.IndexFunc(f.exts(o), func(e extent) bool { return e.seg == s.idx })
}
