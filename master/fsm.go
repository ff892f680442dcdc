package master

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"unsafe"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
	"github.com/tidepool-kv/tidepool/ticket"
)

// FSM is the master's replicated state machine: the object table, the
// store nodes with their segments and allocators, and the master members.
//
// Apply is deterministic: it reads the time only from the command and never
// depends on map iteration order, so every replica reaches the same state.
type FSM struct {
	mu       sync.RWMutex
	objects  *objectTable
	counts   objectCounts // of the table, kept as it changes
	nodes    map[string]*node
	segments map[string]*segment  // by segment id
	members  map[string]string    // raft server id -> gRPC address
	pending  pendingFrees         // removed ranges still covered by read leases
	tombs    tombs                // removed keys clients may still answer from lookup caches
	children map[string]int       // key -> objects naming it as their parent
	inFlight map[*object]struct{} // objects of puts started by a PutStartCmd, not ended
	copying  map[*object]struct{} // objects with copies in flight
	under    map[*object]struct{} // complete objects on fewer nodes than their put asked for
	rares    map[*object]*rare    // the rare fields of the objects that have any
	segAt    []*segment           // by segment index (nil: gone; 0 is never used)
	tenantIx map[string]uint16    // interned tenant names, by index
	tenantAt []string             // tenant names by index (0: none)
	tierAt   []pb.Tier            // segments' tiers by index, kept after a segment goes (see account)
	use      map[quotaKey]tenantUse
	quotas   map[quotaKey]tenantUse // limits set by SetQuota
	// The watcher, and the keys the entry being applied changed (see
	// noteChange); not state.
	watcher Watcher
	changed map[string]struct{}
	changes []tierChange
	// proposed are commands this master proposed as leader and waits
	// for, by the first byte of their encoding (*byte to *pb.Command), so
	// that applying one does not decode what was just encoded (see
	// Server.apply); not state.
	proposed sync.Map
}

type node struct {
	id       string
	endpoint string
	epoch    uint64
	down     bool
	draining bool
	drained  bool
	adopting bool // more kept objects to adopt: not placed on yet
	specs    []*pb.SegmentSpec
	segments []string // ids of the current epoch's segments
	// ticketKey is the epoch's key for its segments' tickets; nil: its
	// store checks none.
	ticketKey []byte
	failed    []string // names of this epoch's segments whose I/O failed
}

type segment struct {
	id       string
	idx      uint32 // its index in FSM.segAt, which extents name
	node     string
	name     string
	tier     pb.Tier
	endpoint string
	epoch    uint64
	alloc    *allocator
	objects  int
	resv     []*reservation // sorted by id
	key      *ticket.Key    // signs the segment's tickets; nil: its store checks none
}

// NewFSM returns an empty state machine.
func NewFSM() *FSM {
	f := &FSM{}
	f.reset()
	return f
}

func (f *FSM) reset() {
	f.objects = newObjectTable()
	f.counts = objectCounts{}
	f.nodes = map[string]*node{}
	f.segments = map[string]*segment{}
	f.members = map[string]string{}
	f.pending = nil
	f.tombs = newTombs()
	f.children = map[string]int{}
	f.inFlight = map[*object]struct{}{}
	f.copying = map[*object]struct{}{}
	f.under = map[*object]struct{}{}
	f.rares = map[*object]*rare{}
	f.segAt = []*segment{nil}
	f.tierAt = []pb.Tier{pb.Tier_TIER_UNSPECIFIED}
	f.use = map[quotaKey]tenantUse{}
	f.quotas = map[quotaKey]tenantUse{}
	f.tenantIx = map[string]uint16{}
	f.tenantAt = []string{""}
}

// SegmentID names a segment of one node epoch; it is the engine segment name.
func SegmentID(nodeID, name string, epoch uint64) string {
	return fmt.Sprintf("%s/%s@%d", nodeID, name, epoch)
}

// alignment is the allocation unit per tier; SSD needs O_DIRECT alignment.
func alignment(t pb.Tier) uint64 {
	if t == pb.Tier_TIER_SSD {
		return 4096
	}
	return 64
}

// PutStartResult is what Apply returns per item of a PutStartCmd.
type PutStartResult struct {
	Err      error
	Exists   bool
	Replicas []*pb.Extent
	PutID    uint64
	// Written-back replicas dropped to make room for it.
	Reclaimed int
}

// RegisterResult is what Apply returns for a RegisterCmd.
type RegisterResult struct {
	Epoch      uint64
	SegmentIDs []string
	Adopted    int
}

// CopyStartResult is what Apply returns per item of a CopyStartCmd.
type CopyStartResult struct {
	Err  error
	Copy *pb.PendingCopy
}

// CopyEndResult is what Apply returns per item of a CopyEndCmd.
type CopyEndResult struct {
	Err    error
	Reason pb.CopyReason
	Size   uint64
	Node   string // the source's node
	// The copy ended well and, for a move, its source was dropped.
	Done bool
}

// command decodes l's command, or finds it among those proposed.
func (f *FSM) command(l *raft.Log) (*pb.Command, error) {
	if len(l.Data) > 0 {
		if c, ok := f.proposed.Load(unsafe.SliceData(l.Data)); ok {
			return c.(*pb.Command), nil
		}
	}
	cmd := &pb.Command{}
	if err := proto.Unmarshal(l.Data, cmd); err != nil {
		return nil, fmt.Errorf("%w: undecodable command at index %d: %v", ErrInvalidRequest, l.Index, err)
	}
	return cmd, nil
}

// Apply implements raft.FSM. It returns []PutStartResult, []error (one per
// key), []CopyStartResult, []CopyEndResult, RegisterResult or error, by
// command.
func (f *FSM) Apply(l *raft.Log) any {
	cmd, err := f.command(l)
	if err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	now := cmd.NowUnixNano
	defer f.flushChanges(now)
	f.releasePending(now)
	f.tombs.expire(now)
	switch op := cmd.Op.(type) {
	case *pb.Command_PutStart:
		if len(op.PutStart.Items) > maxCommandItems {
			return fmt.Errorf("%w: %d items in one command", ErrInvalidRequest, len(op.PutStart.Items))
		}
		res := make([]PutStartResult, len(op.PutStart.Items))
		reclaim := op.PutStart.Reclaim
		for i, it := range op.PutStart.Items {
			n := 0
			if len(it.Candidates) > 0 && f.allocates(it, now) {
				n, reclaim = f.reclaim(it.Candidates[0], it.Size, reclaim, now)
			}
			res[i] = f.putStart(it, now, l.Index<<16|uint64(i))
			res[i].Reclaimed = n
		}
		return res
	case *pb.Command_PutEnd:
		return f.eachPut(op.PutEnd, func(k string, id uint64) error { return f.putEnd(k, id, now) })
	case *pb.Command_PutRevoke:
		return f.eachPut(op.PutRevoke, func(k string, id uint64) error { return f.putRevoke(k, id, op.PutRevoke.OnlyExpired, now) })
	case *pb.Command_Remove:
		c := op.Remove
		return f.eachKey(c.Keys, func(i int, k string) error {
			return f.remove(k, c.FreeAfterUnixNano, at(c.CachedUntilUnixNano, i), now)
		})
	case *pb.Command_Register:
		return f.register(op.Register, now)
	case *pb.Command_NodeDown:
		n := f.nodes[op.NodeDown.Node]
		if n == nil || n.down || n.epoch != op.NodeDown.Epoch {
			return ErrUnknownNode
		}
		if op.NodeDown.Drained && (!n.draining || f.holds(n)) {
			return fmt.Errorf("%w: node %s still holds objects", ErrDraining, n.id)
		}
		f.dropSegments(n)
		n.down, n.drained = true, op.NodeDown.Drained
		return nil
	case *pb.Command_Adopt:
		return f.adoptPage(op.Adopt, now)
	case *pb.Command_SegmentFail:
		return f.failSegment(op.SegmentFail)
	case *pb.Command_SetQuota:
		if len(f.quotas) >= maxQuotas && f.quotas[quotaKey{op.SetQuota.Tenant, op.SetQuota.Tier}].zero() {
			return fmt.Errorf("%w: %d quotas already, the most a pool keeps", ErrInvalidRequest, maxQuotas)
		}
		return f.setQuota(op.SetQuota)
	case *pb.Command_Drain:
		n := f.nodes[op.Drain.Node]
		if n == nil || n.down {
			return fmt.Errorf("%w: %s", ErrUnknownNode, op.Drain.Node)
		}
		n.draining = !op.Drain.Cancel
		return nil
	case *pb.Command_CopyStart:
		if len(op.CopyStart.Items) > maxCommandItems {
			return fmt.Errorf("%w: %d items in one command", ErrInvalidRequest, len(op.CopyStart.Items))
		}
		res := make([]CopyStartResult, len(op.CopyStart.Items))
		for i, it := range op.CopyStart.Items {
			res[i] = f.copyStart(it, l.Index<<16|uint64(i))
		}
		return res
	case *pb.Command_CopyEnd:
		c := op.CopyEnd
		res := make([]CopyEndResult, len(c.Items))
		for i, it := range c.Items {
			res[i] = f.copyEnd(it, c.FreeAfterUnixNano, now)
		}
		return res
	case *pb.Command_Reserve:
		return f.reserve(op.Reserve, l.Index, now)
	case *pb.Command_Publish:
		if len(op.Publish.Items) > MaxBatchKeys {
			return fmt.Errorf("%w: %d items in one command", ErrInvalidRequest, len(op.Publish.Items))
		}
		errs := make([]error, len(op.Publish.Items))
		var buf [4]placedReplica
		for i, it := range op.Publish.Items {
			p := publicationOf(it, buf[:])
			errs[i] = f.publish(&p, now, l.Term)
		}
		return errs
	case *pb.Command_PublishColumns:
		return f.publishColumns(op.PublishColumns, now, l.Term)
	case *pb.Command_Release:
		return f.release(op.Release, now)
	case *pb.Command_Member:
		f.members[op.Member.Id] = op.Member.Address
		return nil
	case *pb.Command_Pin:
		return []error{f.pin(op.Pin)}
	case *pb.Command_DropReplica:
		return f.dropReplica(op.DropReplica, now)
	case *pb.Command_DropReplicas:
		out := make([]bool, len(op.DropReplicas.Items))
		for i, c := range op.DropReplicas.Items {
			out[i] = f.dropReplica(c, now)
		}
		return out
	case *pb.Command_Evict:
		c := op.Evict
		return f.eachKey(c.Keys, func(i int, k string) error {
			return f.evict(k, c.FreeAfterUnixNano, at(c.CachedUntilUnixNano, i), c.AllowSoftPinned, now)
		})
	}
	return fmt.Errorf("%w: empty command at index %d", ErrInvalidRequest, l.Index)
}

// eachKey applies fn to every key, after warming their table slots.
func (f *FSM) eachKey(keys []string, fn func(i int, key string) error) []error {
	if len(keys) > 1 {
		f.objects.warm(len(keys), func(i int) string { return keys[i] })
	}
	errs := make([]error, len(keys))
	for i, k := range keys {
		errs[i] = fn(i, k)
	}
	return errs
}

// at is s[i], or 0 past its end.
func at(s []int64, i int) int64 {
	if i < len(s) {
		return s[i]
	}
	return 0
}

// eachPut applies fn to every key of c with the put id meant for it (0:
// any put of the key).
func (f *FSM) eachPut(c *pb.KeysCmd, fn func(key string, putID uint64) error) []error {
	errs := make([]error, len(c.Keys))
	for i, k := range c.Keys {
		var id uint64
		if i < len(c.PutIds) {
			id = c.PutIds[i]
		}
		errs[i] = fn(k, id)
	}
	return errs
}

// lateWriteGrace is how long the space of an expired put stays reserved
// after its deadline: its writer stops at the deadline, but bytes already
// on the wire may still land.
const lateWriteGrace = int64(5e9)

func (f *FSM) putStart(it *pb.PutStartItem, now int64, putID uint64) PutStartResult {
	if o := f.objects.get(it.Key); o != nil {
		if o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) {
			return PutStartResult{Exists: true}
		}
		if now <= f.deadline(o) {
			return PutStartResult{Err: ErrPutInProgress}
		}
		f.retire(o, now+lateWriteGrace) // an abandoned put: the new one takes its place
	}
	if it.Size == 0 || !recordable(it.Key, it.Parent) {
		return PutStartResult{Err: fmt.Errorf("%w: zero-length value, or key or parent key too long", ErrInvalidRequest)}
	}
	// Replicas go to the first candidates with room, one per node.
	want := max(int(it.Replicas), 1)
	var exts []extent
	nodes := map[string]bool{}
	for _, id := range it.Candidates {
		s := f.segments[id]
		if s == nil || nodes[s.node] {
			continue
		}
		off, ok := s.alloc.alloc(it.Size)
		if !ok {
			continue
		}
		s.objects++
		nodes[s.node] = true
		exts = append(exts, newExtent(off, s.idx))
		if len(exts) == want {
			break
		}
	}
	if len(exts) > 0 {
		o := f.newObject(it.Key, it.Size, it.Checksum, putID, now, it.Parent, it.Tenant, exts)
		f.setState(o, pb.ObjectState_OBJECT_STATE_PROCESSING)
		f.edit(o, func(r *rare) { r.deadline, r.want = it.DeadlineUnixNano, wanted(it.Replicas) })
		return PutStartResult{Replicas: f.pbExtents(o), PutID: putID}
	}
	if len(f.segments) == 0 {
		return PutStartResult{Err: ErrNoSegments}
	}
	var largest uint64
	for _, s := range f.segments {
		largest = max(largest, s.alloc.capacity)
	}
	if it.Size > largest {
		return PutStartResult{Err: fmt.Errorf("%w: %d bytes, largest segment holds %d", ErrTooLarge, it.Size, largest)}
	}
	return PutStartResult{Err: fmt.Errorf("%w for %d bytes", ErrNoSpace, it.Size)}
}

// maxCommandItems bounds the items of one PutStart or CopyStart: item i
// of the entry at raft index x is named x<<16|i, unique only below 1<<16.
const maxCommandItems = 1 << 16

// allocates reports whether a put start would allocate: its key is new, or
// an abandoned put of it is replaced. An existing or in-progress key does
// not, and must not cost any reclaimed replica.
func (f *FSM) allocates(it *pb.PutStartItem, now int64) bool {
	o := f.objects.get(it.Key)
	return it.Size > 0 && recordable(it.Key, it.Parent) && (o == nil || (!o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) && now > f.deadline(o)))
}

// reclaim drops written-back replicas on segment, in the leader's order,
// until it has a free range of size bytes, and returns how many it dropped
// and the entries it did not use. A replica is dropped only if its object
// keeps another one and is not being copied from it.
func (f *FSM) reclaim(segment string, size uint64, cands []*pb.Reclaimable, now int64) (int, []*pb.Reclaimable) {
	s := f.segments[segment]
	if s == nil {
		return 0, cands
	}
	n := 0
	rest := cands[:0:0]
	for i, c := range cands {
		if s.alloc.largestFree() >= size {
			return n, append(rest, cands[i:]...)
		}
		if c.Segment != segment {
			rest = append(rest, c)
			continue
		}
		o := f.objects.get(c.Key)
		if o == nil || !o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) || len(f.exts(o)) < 2 ||
			slices.ContainsFunc(f.copies(o), func(p *pb.PendingCopy) bool { return p.Source == segment }) {
			continue
		}
		if j := f.replicaOn(o, segment); j >= 0 {
			f.dropExtent(o, j, 0, now)
			n++
		}
	}
	return n, rest
}

func (f *FSM) putEnd(key string, putID uint64, now int64) error {
	o := f.objects.get(key)
	switch {
	case o == nil:
		return fmt.Errorf("%w: %q (revoked or never started)", ErrNotInProgress, key)
	case putID != 0 && o.putID != putID:
		return fmt.Errorf("%w: %q (revoked, and the key was put again since)", ErrNotInProgress, key)
	case o.is(pb.ObjectState_OBJECT_STATE_COMPLETE):
		return nil
	case now > f.deadline(o):
		// Its writes may have been cut short at the deadline; the sweep
		// revokes it.
		return fmt.Errorf("%w: %q (expired before it ended)", ErrNotInProgress, key)
	}
	f.setState(o, pb.ObjectState_OBJECT_STATE_COMPLETE)
	f.edit(o, func(r *rare) { r.deadline = 0 })
	return nil
}

// putRevoke abandons a put. The client revokes only once its writes have
// ended, so the space is free at once; the leader's sweep (onlyExpired)
// cannot know, so it keeps the space for lateWriteGrace.
func (f *FSM) putRevoke(key string, putID uint64, onlyExpired bool, now int64) error {
	o := f.objects.get(key)
	if o == nil || !o.is(pb.ObjectState_OBJECT_STATE_PROCESSING) || (putID != 0 && o.putID != putID) || (onlyExpired && f.deadline(o) >= now) {
		return fmt.Errorf("%w: %q", ErrNotInProgress, key)
	}
	if onlyExpired {
		f.retire(o, now+lateWriteGrace)
	} else {
		f.drop(o)
	}
	return nil
}

func (f *FSM) remove(key string, freeAfter, cachedUntil, now int64) error {
	o := f.objects.get(key)
	switch {
	case o == nil:
		return fmt.Errorf("%w: %q", ErrNotFound, key)
	case !o.is(pb.ObjectState_OBJECT_STATE_COMPLETE):
		return fmt.Errorf("%w: %q", ErrPutInProgress, key)
	}
	f.retireAfter(o, freeAfter, now)
	f.tombs.add(key, cachedUntil, now)
	return nil
}

func (f *FSM) pin(c *pb.PinCmd) error {
	o := f.objects.get(c.Key)
	if o == nil || !o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) {
		return fmt.Errorf("%w: %q", ErrNotFound, c.Key)
	}
	switch {
	case c.Unpin:
		o.setFlag(flagHard, false)
		f.edit(o, func(r *rare) { r.softPin = 0 })
	case c.Hard:
		o.setFlag(flagHard, true)
	default:
		f.edit(o, func(r *rare) { r.softPin = max(r.softPin, c.SoftUntilUnixNano) })
	}
	return nil
}

// evict removes an object the leader chose to make room, unless it has
// become protected since the leader looked.
func (f *FSM) evict(key string, freeAfter, cachedUntil int64, allowSoft bool, now int64) error {
	o := f.objects.get(key)
	switch {
	case o == nil || !o.is(pb.ObjectState_OBJECT_STATE_COMPLETE):
		return fmt.Errorf("%w: %q", ErrNotFound, key)
	case o.hard():
		return fmt.Errorf("%w: %q is hard pinned", ErrPinned, key)
	case f.softPin(o) > now && !allowSoft:
		return fmt.Errorf("%w: %q is soft pinned", ErrPinned, key)
	}
	f.retireAfter(o, freeAfter, now)
	f.tombs.add(key, cachedUntil, now)
	return nil
}

// dropReplica removes a replica a reader found corrupt; an object left
// without a replica is forgotten. It reports whether it dropped one.
func (f *FSM) dropReplica(c *pb.DropReplicaCmd, now int64) bool {
	o := f.objects.get(c.Key)
	if o == nil || !o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) || o.checksum != c.Checksum {
		return false
	}
	i := f.replicaOn(o, c.Segment)
	if i < 0 {
		return false
	}
	if len(f.exts(o)) == 1 {
		if c.KeepLast {
			return false
		}
		f.retireAfter(o, c.FreeAfterUnixNano, now)
		f.tombs.add(c.Key, c.CachedUntilUnixNano, now)
		return true
	}
	f.dropExtent(o, i, c.FreeAfterUnixNano, now)
	return true
}

// dropExtent removes o's replica i, which is not its last; the space is
// reused from freeAfter on.
func (f *FSM) dropExtent(o *object, i int, freeAfter, now int64) {
	exts := f.exts(o)
	r := exts[i]
	f.setExts(o, slices.Delete(slices.Clone(exts), i, i+1))
	if s := f.seg(r); s != nil {
		s.objects--
		if freeAfter <= now {
			freeAfter = 0
		}
		f.free(s.id, r.offset(), o.size, freeAfter)
	}
}

// retireAfter deletes an object whose space is free from freeAfter on, at
// once if that has passed.
func (f *FSM) retireAfter(o *object, freeAfter, now int64) {
	if freeAfter > now {
		f.retire(o, freeAfter)
	} else {
		f.drop(o)
	}
}

// drop deletes an object and frees its space at once.
func (f *FSM) drop(o *object) { f.retire(o, 0) }

// objectCounts is the table's objects by state, and the bytes of the
// complete ones, so a status or a scrape costs no walk of the table.
type objectCounts struct {
	processing, complete int
	completeBytes        uint64
}

func (c *objectCounts) count(o *object, n int) {
	if o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) {
		c.complete += n
		c.completeBytes += uint64(n) * o.size // wraps back for n = -1
	} else {
		c.processing += n
	}
}

// setState changes the state of an object in the table.
func (f *FSM) setState(o *object, s pb.ObjectState) {
	f.noteChange(o.key())
	f.counts.count(o, -1)
	o.setState(s)
	f.counts.count(o, 1)
}

// add puts an object in the table, in place of any of its key.
func (f *FSM) add(o *object) {
	f.noteChange(o.key())
	if old := f.objects.get(o.key()); old != nil {
		f.counts.count(old, -1)
		f.account(old, -1)
	}
	f.objects.put(o)
	f.counts.count(o, 1)
	f.account(o, 1)
	if p := o.parent(); p != "" {
		f.children[p]++
	}
}

// forget takes an object out of the table; its space is the caller's.
func (f *FSM) forget(o *object) {
	f.noteChange(o.key())
	f.objects.remove(o.key())
	f.counts.count(o, -1)
	f.account(o, -1)
	o.setFlag(flagGone, true)
	delete(f.inFlight, o)
	delete(f.copying, o)
	delete(f.under, o)
	if p := o.parent(); p != "" {
		if f.children[p]--; f.children[p] <= 0 {
			delete(f.children, p)
		}
	}
}

// retire deletes an object; its space is reused only from time after on
// (the end of its read leases, or of its writer's late bytes).
func (f *FSM) retire(o *object, after int64) {
	f.forget(o)
	for _, r := range f.exts(o) {
		if s := f.seg(r); s != nil {
			s.objects--
			f.free(s.id, r.offset(), o.size, after)
		}
	}
	for _, c := range f.copies(o) {
		// A copier may still be writing: keep the room until it reports,
		// or else until it must have stopped.
		f.pending.add(&pb.PendingFree{Extent: c.Target, AfterUnixNano: c.DeadlineUnixNano + lateWriteGrace, CopyId: c.Id})
	}
	delete(f.rares, o)
	o.setFlag(flagHasRare, false)
}

// free releases an extent, at once or from time after on.
func (f *FSM) free(segment string, offset, length uint64, after int64) {
	s := f.segments[segment]
	switch {
	case s == nil:
	case after > 0:
		f.pending.add(&pb.PendingFree{Extent: &pb.Extent{Segment: segment, Offset: offset, Length: length}, AfterUnixNano: after})
	default:
		s.alloc.release(offset, length)
	}
}

func (f *FSM) freeExtent(e *pb.Extent, after int64) { f.free(e.Segment, e.Offset, e.Length, after) }

func (f *FSM) releasePending(now int64) {
	for p := f.pending.due(now); p != nil; p = f.pending.due(now) {
		if s := f.segments[p.Extent.Segment]; s != nil {
			s.alloc.release(p.Extent.Offset, p.Extent.Length)
		}
	}
}

func (f *FSM) register(c *pb.RegisterCmd, now int64) any {
	n := f.nodes[c.Node]
	// The handler refuses names that could collide; this guards entries
	// an older master accepted: never two allocators for one id.
	epoch := uint64(1)
	if n != nil {
		epoch = n.epoch + 1
	}
	ids := map[string]bool{}
	for _, spec := range c.Segments {
		id := SegmentID(c.Node, spec.Name, epoch)
		if s := f.segments[id]; ids[id] || (s != nil && s.node != c.Node) {
			return fmt.Errorf("%w: segment id %q of node %q is taken", ErrInvalidRequest, id, c.Node)
		}
		ids[id] = true
	}
	if n == nil {
		n = &node{id: c.Node}
		f.nodes[c.Node] = n
	} else {
		// A new epoch: whatever the old process held is gone (DRAM) or will
		// be re-adopted explicitly (SSD, later), so drop its replicas now.
		f.dropSegments(n)
	}
	n.epoch++
	n.down, n.draining, n.drained = false, false, false
	n.failed = nil // a new process: its disks get another chance
	n.adopting = c.AdoptMore
	n.endpoint = c.Endpoint
	n.specs = c.Segments
	n.ticketKey = c.TicketKey
	f.addSegments(n)
	adopted := 0
	for _, a := range c.Adopt {
		if f.adopt(n, a, now) {
			adopted++
		}
	}
	return RegisterResult{Epoch: n.epoch, SegmentIDs: slices.Clone(n.segments), Adopted: adopted}
}

// adoptPage adopts a further page of a registering node's kept objects,
// in the epoch it registered; the last page opens the node to placement.
// A page applied twice adopts nothing the second time.
func (f *FSM) adoptPage(c *pb.AdoptCmd, now int64) any {
	n := f.nodes[c.Node]
	if n == nil || n.down || n.epoch != c.Epoch {
		return fmt.Errorf("%w: %s@%d", ErrUnknownNode, c.Node, c.Epoch)
	}
	adopted := 0
	for _, a := range c.Objects {
		if f.adopt(n, a, now) {
			adopted++
		}
	}
	if c.Done {
		n.adopting = false
	}
	return adopted
}

// adopt takes back an object a restarted node kept, at the same place in
// the new epoch's segment, with the pins, parent key and tenant it had. A
// key that exists elsewhere with the same size and checksum gains a replica
// and keeps its own metadata, except that it takes the stronger of the two
// pins; one that differs keeps its value and the kept bytes are dropped. A
// parent key or tenant too long to be valid is left out, not the object.
func (f *FSM) adopt(n *node, a *pb.AdoptedObject, now int64) bool {
	id := SegmentID(n.id, a.Segment, n.epoch)
	s := f.segments[id]
	// Only a persistent tier keeps bytes across a restart, and only an
	// aligned range inside the segment can be taken back.
	if s == nil || s.tier != pb.Tier_TIER_SSD || a.Key == "" || len(a.Key) > MaxKeyLen || a.Size == 0 ||
		a.Offset%s.alloc.align != 0 || a.Size > s.alloc.capacity || a.Offset > s.alloc.capacity-a.Size {
		return false
	}
	o := f.objects.get(a.Key)
	if o != nil && (!o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) || o.size != a.Size || o.checksum != a.Checksum) {
		return false
	}
	if o != nil {
		for _, r := range f.exts(o) {
			if seg := f.seg(r); seg != nil && seg.node == n.id {
				return false
			}
		}
	}
	if s.alloc.reserve(a.Offset, a.Size) != nil {
		return false
	}
	s.objects++
	ext := newExtent(a.Offset, s.idx)
	if o == nil {
		var parent, tenant string
		if len(a.Parent) <= MaxKeyLen {
			parent = a.Parent
		}
		if len(a.Tenant) <= MaxKeyLen {
			tenant = a.Tenant
		}
		o = f.newObject(a.Key, a.Size, a.Checksum, 0, now, parent, tenant, []extent{ext}) // counts the parent's children
	} else {
		f.setExts(o, append(slices.Clone(f.exts(o)), ext))
	}
	o.setFlag(flagHard, o.hard() || a.HardPinned)
	f.edit(o, func(r *rare) { r.softPin = max(r.softPin, a.SoftPinUntilUnixNano) })
	return true
}

func (f *FSM) addSegments(n *node) {
	n.segments = n.segments[:0]
	for _, spec := range n.specs {
		if slices.Contains(n.failed, spec.Name) {
			continue
		}
		id := SegmentID(n.id, spec.Name, n.epoch)
		s := &segment{
			id: id, node: n.id, name: spec.Name, tier: spec.Tier,
			endpoint: n.endpoint, epoch: n.epoch,
			alloc: newAllocator(spec.Capacity, alignment(spec.Tier)),
		}
		if n.ticketKey != nil {
			// Register checked the key's length, the one way this fails.
			s.key, _ = ticket.SegmentKey(n.ticketKey, id)
		}
		if old := f.segments[id]; old != nil {
			s.idx = old.idx // extents name it by index, as they did the one it replaces
		} else {
			s.idx = uint32(len(f.segAt))
			f.segAt = append(f.segAt, nil)
			f.tierAt = append(f.tierAt, s.tier)
		}
		f.segAt[s.idx] = s
		f.tierAt[s.idx] = s.tier
		f.segments[id] = s
		n.segments = append(n.segments, id)
	}
}

// failSegment takes a segment whose I/O failed out of its node.
func (f *FSM) failSegment(c *pb.SegmentFailCmd) error {
	n := f.nodes[c.Node]
	if n == nil || n.down || n.epoch != c.Epoch {
		return fmt.Errorf("%w: %s@%d", ErrUnknownNode, c.Node, c.Epoch)
	}
	id := SegmentID(n.id, c.Name, n.epoch)
	if !slices.Contains(n.segments, id) {
		return fmt.Errorf("%w: segment %s", ErrNotFound, id)
	}
	n.failed = append(n.failed, c.Name)
	f.dropSegmentIDs(n, []string{id})
	return nil
}

// dropSegments forgets a node's segments and every replica on them; objects
// left without a replica are lost.
func (f *FSM) dropSegments(n *node) { f.dropSegmentIDs(n, slices.Clone(n.segments)) }

// dropSegmentIDs forgets some of a node's segments, as dropSegments does.
func (f *FSM) dropSegmentIDs(n *node, ids []string) {
	gone := map[string]bool{}
	for _, id := range ids {
		gone[id] = true
		if s := f.segments[id]; s != nil {
			f.segAt[s.idx] = nil
		}
		delete(f.segments, id)
	}
	n.segments = slices.DeleteFunc(n.segments, func(id string) bool { return gone[id] })
	for _, key := range f.objects.sortedKeys() { // retire appends to pending: keep the order deterministic
		o := f.objects.get(key)
		lost := func(e extent) bool { return f.seg(e) == nil }
		if slices.ContainsFunc(f.exts(o), lost) {
			f.setExts(o, slices.DeleteFunc(slices.Clone(f.exts(o)), lost))
		}
		if slices.ContainsFunc(f.copies(o), func(c *pb.PendingCopy) bool { return gone[c.Target.Segment] }) {
			f.edit(o, func(r *rare) {
				r.copies = slices.DeleteFunc(slices.Clone(r.copies), func(c *pb.PendingCopy) bool { return gone[c.Target.Segment] })
			})
		}
		if len(f.exts(o)) == 0 {
			f.retire(o, 0)
		}
	}
	f.pending.filter(func(p *pb.PendingFree) bool { return !gone[p.Extent.Segment] })
}

// Snapshot implements raft.FSM.
func (f *FSM) Snapshot() (raft.FSMSnapshot, error) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	snap := &pb.Snapshot{PendingFrees: f.pending, Tombs: f.tombs.snapshot(), Quotas: f.snapshotQuotas()}
	for _, k := range f.objects.sortedKeys() {
		o := f.objects.get(k)
		snap.Objects = append(snap.Objects, &pb.Object{
			Key: k, Size: o.size, Checksum: o.checksum, State: o.pbState(),
			CreatedUnixNano: o.created, DeadlineUnixNano: f.deadline(o), Replicas: f.pbExtents(o), PutId: o.putID,
			HardPinned: o.hard(), SoftPinUntilUnixNano: f.softPin(o),
			Copies: f.copies(o), Parent: o.parent(), Tenant: f.tenantOf(o), ReplicasWanted: uint32(f.want(o)),
		})
	}
	for _, id := range sortedKeys(f.nodes) {
		n := f.nodes[id]
		snap.Nodes = append(snap.Nodes, &pb.Node{Id: n.id, Endpoint: n.endpoint, Epoch: n.epoch, Segments: n.specs,
			Down: n.down, Draining: n.draining, Drained: n.drained, Adopting: n.adopting, TicketKey: n.ticketKey, Failed: n.failed})
	}
	for _, id := range sortedKeys(f.segments) {
		for _, r := range f.segments[id].resv {
			pr := &pb.Reservation{Id: r.id, Segment: id, AllocUntilUnixNano: r.allocUntil, ReleaseAfterUnixNano: r.releaseAfter}
			for _, sp := range r.spans {
				pr.Spans = append(pr.Spans, &pb.FreeSpan{Offset: sp.off, Length: sp.len})
			}
			snap.Reservations = append(snap.Reservations, pr)
		}
	}
	for _, id := range sortedKeys(f.members) {
		snap.Members = append(snap.Members, &pb.MemberCmd{Id: id, Address: f.members[id]})
	}
	data, err := proto.MarshalOptions{Deterministic: true}.Marshal(snap)
	if err != nil {
		return nil, fmt.Errorf("encode snapshot: %w", err)
	}
	return snapshot(data), nil
}

// Restore implements raft.FSM.
func (f *FSM) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	data, err := io.ReadAll(rc)
	if err != nil {
		return fmt.Errorf("read snapshot: %w", err)
	}
	var snap pb.Snapshot
	if err := proto.Unmarshal(data, &snap); err != nil {
		return fmt.Errorf("decode snapshot: %w", err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, o := range f.objects.all() {
		o.setFlag(flagGone, true) // a lookup holding one rereads it
	}
	f.reset()
	// The watcher hears the restored table once, after, not key by key.
	w := f.watcher
	f.watcher = nil
	defer func() {
		f.watcher = w
		f.restored(0)
	}()
	for _, m := range snap.Members {
		f.members[m.Id] = m.Address
	}
	for _, pn := range snap.Nodes {
		n := &node{id: pn.Id, endpoint: pn.Endpoint, epoch: pn.Epoch, specs: pn.Segments, down: pn.Down, draining: pn.Draining, drained: pn.Drained, adopting: pn.Adopting, ticketKey: pn.TicketKey, failed: pn.Failed}
		f.nodes[n.id] = n
		if !n.down {
			f.addSegments(n)
		}
	}
	var errs []error
	reserve := func(e *pb.Extent) bool {
		s := f.segments[e.Segment]
		if s == nil {
			return false
		}
		if err := s.alloc.reserve(e.Offset, e.Length); err != nil {
			errs = append(errs, fmt.Errorf("segment %s: %w", e.Segment, err))
			return false
		}
		return true
	}
	for _, po := range snap.Objects {
		if !recordable(po.Key, po.Parent) {
			errs = append(errs, fmt.Errorf("object %q: key or parent key too long", po.Key))
			continue
		}
		var exts []extent
		for _, r := range po.Replicas {
			// A replica's length is its object's size.
			if r.Length == po.Size && reserve(r) {
				s := f.segments[r.Segment]
				s.objects++
				exts = append(exts, newExtent(r.Offset, s.idx))
			}
		}
		var copies []*pb.PendingCopy
		for _, c := range po.Copies {
			if reserve(c.Target) {
				copies = append(copies, c)
			}
		}
		if len(exts) == 0 {
			for _, c := range copies {
				f.freeExtent(c.Target, 0)
			}
			continue
		}
		o := f.newObject(po.Key, po.Size, po.Checksum, po.PutId, po.CreatedUnixNano, po.Parent, po.Tenant, exts)
		f.setState(o, po.State)
		o.setFlag(flagHard, po.HardPinned)
		f.edit(o, func(r *rare) {
			r.softPin, r.copies, r.want = po.SoftPinUntilUnixNano, copies, wanted(po.ReplicasWanted)
			if o.is(pb.ObjectState_OBJECT_STATE_PROCESSING) { // older snapshots kept it on complete objects too
				r.deadline = po.DeadlineUnixNano
			}
		})
	}
	for _, p := range snap.PendingFrees {
		if reserve(p.Extent) {
			f.pending.add(p)
		}
	}
	for _, t := range snap.Tombs {
		f.tombs.add(t.Key, t.UntilUnixNano, 0)
	}
	for _, q := range snap.Quotas {
		if err := f.setQuota(q); err != nil {
			errs = append(errs, err)
		}
	}
	for _, pr := range snap.Reservations {
		r := &reservation{id: pr.Id, allocUntil: pr.AllocUntilUnixNano, releaseAfter: pr.ReleaseAfterUnixNano}
		for _, sp := range pr.Spans {
			if reserve(&pb.Extent{Segment: pr.Segment, Offset: sp.Offset, Length: sp.Length}) {
				r.spans = append(r.spans, span{sp.Offset, sp.Length})
			}
		}
		if s := f.segments[pr.Segment]; s != nil {
			s.resv = append(s.resv, r)
		}
	}
	return errors.Join(errs...)
}

type snapshot []byte

func (s snapshot) Persist(sink raft.SnapshotSink) error {
	if _, err := sink.Write(s); err != nil {
		sink.Cancel()
		return fmt.Errorf("write snapshot: %w", err)
	}
	return sink.Close()
}

func (s snapshot) Release() {}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
