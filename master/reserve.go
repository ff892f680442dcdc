package master

import (
	"fmt"
	"slices"
	"sort"
	"unsafe"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// reservation is free space of a segment set aside for the leader that
// asked for it (ReserveCmd): the leader places puts in it from memory,
// and each put's Publish carves its extent out. What is never published
// goes back to the segment's free list at release.
type reservation struct {
	id           uint64 // the raft index of its ReserveCmd
	spans        []span // not yet published, sorted by offset
	allocUntil   int64
	releaseAfter int64
}

// ReserveResult is what Apply returns for a ReserveCmd.
type ReserveResult struct {
	Err   error
	ID    uint64
	Spans []span
	// Written-back replicas dropped to make room for it.
	Reclaimed int
}

// reserve takes up to c.Bytes of free ranges of at least c.MinSpan each,
// first fit by offset, the last one cut to size.
func (f *FSM) reserve(c *pb.ReserveCmd, id uint64, now int64) ReserveResult {
	s := f.segments[c.Segment]
	if s == nil {
		return ReserveResult{Err: fmt.Errorf("%w: segment %s", ErrStoreGone, c.Segment)}
	}
	if c.MinSpan == 0 || c.Bytes < c.MinSpan {
		return ReserveResult{Err: fmt.Errorf("%w: reserve %d bytes in spans of %d", ErrInvalidRequest, c.Bytes, c.MinSpan)}
	}
	if c.MinSpan > s.alloc.capacity {
		return ReserveResult{Err: fmt.Errorf("%w: %d bytes, segment %s holds %d", ErrTooLarge, c.MinSpan, s.id, s.alloc.capacity)}
	}
	n, _ := f.reclaim(s.id, c.MinSpan, c.Reclaim, now)
	minSpan := s.alloc.rounded(c.MinSpan)
	want := max(s.alloc.rounded(c.Bytes), minSpan)
	var got []span
	var total uint64
	for _, fr := range slices.Clone(s.alloc.free) {
		if total >= want {
			break
		}
		if fr.len < minSpan {
			continue
		}
		take := max(min(fr.len, want-total), minSpan) // never shorter than one put
		if err := s.alloc.reserve(fr.off, take); err != nil {
			break // cannot happen: the range was free
		}
		got = append(got, span{fr.off, take})
		total += take
	}
	if len(got) == 0 {
		return ReserveResult{Err: fmt.Errorf("%w for %d bytes", ErrNoSpace, c.MinSpan), Reclaimed: n}
	}
	s.resv = append(s.resv, &reservation{id: id, spans: slices.Clone(got), allocUntil: c.AllocUntilUnixNano, releaseAfter: c.ReleaseAfterUnixNano})
	return ReserveResult{ID: id, Spans: got, Reclaimed: n}
}

// reserved is the space of s set aside for puts and not published: free
// for the watermarks, though not for the allocator.
func (s *segment) reserved() uint64 {
	var n uint64
	for _, r := range s.resv {
		for _, sp := range r.spans {
			n += sp.len
		}
	}
	return n
}

// carve takes [off, off+n) out of reservation id of s, if it still holds
// all of it unpublished.
func (s *segment) carve(id, off, n uint64) bool {
	for _, r := range s.resv {
		if r.id != id {
			continue
		}
		i := sort.Search(len(r.spans), func(i int) bool { return r.spans[i].off+r.spans[i].len > off })
		if i == len(r.spans) || r.spans[i].off > off || off+n > r.spans[i].off+r.spans[i].len {
			continue
		}
		// In place: puts of a run publish in order, each from the front
		// of what is left, so most carves shorten a span and allocate
		// nothing.
		sp := r.spans[i]
		end := sp.off + sp.len
		switch {
		case off == sp.off && off+n == end:
			r.spans = slices.Delete(r.spans, i, i+1)
		case off == sp.off:
			r.spans[i] = span{off + n, end - off - n}
		case off+n == end:
			r.spans[i].len = off - sp.off
		default:
			r.spans[i].len = off - sp.off
			r.spans = slices.Insert(r.spans, i+1, span{off + n, end - off - n})
		}
		return true
	}
	return false
}

// publication is one put to publish: a PublishItem, or an item of a
// PublishColumnsCmd.
type publication struct {
	key, parent, tenant string
	size                uint64
	checksum            uint32
	putID               uint64
	want                uint32
	replicas            []placedReplica
	reservations        int // how many came with the replicas: one each
}

// placedReplica is where a put wrote one replica: an extent of a segment
// in a reservation.
type placedReplica struct {
	segment     string
	offset      uint64
	reservation uint64
}

// publicationOf is it as a publication; replicas, if big enough, holds
// the replicas.
func publicationOf(it *pb.PublishItem, replicas []placedReplica) publication {
	p := publication{
		key: it.Key, parent: it.Parent, tenant: it.Tenant, size: it.Size, checksum: it.Checksum,
		putID: it.PutId, want: it.ReplicasWanted, replicas: replicas[:0], reservations: len(it.Reservations),
	}
	for i, e := range it.Replicas {
		r := placedReplica{segment: e.Segment, offset: e.Offset}
		if i < len(it.Reservations) {
			r.reservation = it.Reservations[i]
		}
		p.replicas = append(p.replicas, r)
	}
	return p
}

// publishColumns publishes each item of c, or refuses the whole command
// if its columns do not line up.
func (f *FSM) publishColumns(c *pb.PublishColumnsCmd, now int64, term uint64) any {
	n := len(c.KeyLengths)
	listed := n == 0 && len(c.KeyList) > 0 // an earlier leader's form
	if listed {
		n = len(c.KeyList)
	}
	reps := 0
	for _, k := range c.ReplicaCounts {
		reps += int(k)
	}
	switch {
	case n > MaxBatchKeys:
		return fmt.Errorf("%w: %d items in one command", ErrInvalidRequest, n)
	case len(c.Sizes) != n || len(c.Checksums) != n || len(c.PutIds) != n || len(c.ReplicasWanted) != n || len(c.ReplicaCounts) != n,
		!packed(c.Keys, c.KeyLengths), !packed(c.Parents, c.ParentLengths),
		len(c.ParentLengths) != 0 && len(c.ParentLengths) != n, len(c.ParentList) != 0 && len(c.ParentList) != n,
		listed && len(c.ParentLengths) != 0, !listed && len(c.KeyList)+len(c.ParentList) != 0,
		len(c.Tenants) != 0 && len(c.Tenants) != n,
		len(c.Segments) != reps || len(c.Offsets) != reps || len(c.Reservations) != reps,
		slices.ContainsFunc(c.Tenants, func(t uint32) bool { return int(t) >= len(c.TenantNames) }),
		slices.ContainsFunc(c.Segments, func(s uint32) bool { return int(s) >= len(c.SegmentNames) }):
		return fmt.Errorf("%w: the columns of a publish of %d items do not line up", ErrInvalidRequest, n)
	}
	if !listed {
		at := 0
		f.objects.warm(n, func(i int) string { return unpack(c.Keys, &at, c.KeyLengths[i]) })
	}
	errs := make([]error, n)
	var buf [4]placedReplica
	next, keyAt, parentAt := 0, 0, 0
	for i := range n {
		p := publication{
			size: c.Sizes[i], checksum: c.Checksums[i], putID: c.PutIds[i], want: c.ReplicasWanted[i],
			replicas: buf[:0], reservations: int(c.ReplicaCounts[i]),
		}
		switch {
		case listed:
			p.key = c.KeyList[i]
			if len(c.ParentList) > 0 {
				p.parent = c.ParentList[i]
			}
		default:
			p.key = unpack(c.Keys, &keyAt, c.KeyLengths[i])
			if len(c.ParentLengths) > 0 {
				p.parent = unpack(c.Parents, &parentAt, c.ParentLengths[i])
			}
		}
		if len(c.Tenants) > 0 {
			p.tenant = c.TenantNames[c.Tenants[i]]
		}
		for j := next; j < next+p.reservations; j++ {
			p.replicas = append(p.replicas, placedReplica{c.SegmentNames[c.Segments[j]], c.Offsets[j], c.Reservations[j]})
		}
		next += p.reservations
		errs[i] = f.publish(&p, now, term)
	}
	return errs
}

// columnsOf is the items in columns (see PublishColumnsCmd). Each item
// must have one reservation per replica (BatchPutEnd refuses others).
func columnsOf(items []*pb.PublishItem) *pb.PublishColumnsCmd {
	n := len(items)
	keys, parents := 0, 0
	for _, it := range items {
		keys, parents = keys+len(it.Key), parents+len(it.Parent)
	}
	c := &pb.PublishColumnsCmd{
		Keys: make([]byte, 0, keys), KeyLengths: make([]uint32, n), Sizes: make([]uint64, n), Checksums: make([]uint32, n), PutIds: make([]uint64, n),
		ReplicasWanted: make([]uint32, n), ReplicaCounts: make([]uint32, n),
	}
	if parents > 0 {
		c.Parents, c.ParentLengths = make([]byte, 0, parents), make([]uint32, n)
	}
	for i, it := range items {
		c.Keys, c.KeyLengths[i] = append(c.Keys, it.Key...), uint32(len(it.Key))
		c.Sizes[i], c.Checksums[i], c.PutIds[i] = it.Size, it.Checksum, it.PutId
		c.ReplicasWanted[i], c.ReplicaCounts[i] = it.ReplicasWanted, uint32(len(it.Replicas))
		if parents > 0 {
			c.Parents, c.ParentLengths[i] = append(c.Parents, it.Parent...), uint32(len(it.Parent))
		}
		if it.Tenant != "" && c.Tenants == nil {
			c.Tenants, c.TenantNames = make([]uint32, n), []string{""}
		}
		if c.Tenants != nil {
			c.Tenants[i], c.TenantNames = intern(c.TenantNames, it.Tenant)
		}
		for j, e := range it.Replicas {
			var seg uint32
			seg, c.SegmentNames = intern(c.SegmentNames, e.Segment)
			c.Segments, c.Offsets = append(c.Segments, seg), append(c.Offsets, e.Offset)
			var resv uint64
			if j < len(it.Reservations) {
				resv = it.Reservations[j]
			}
			c.Reservations = append(c.Reservations, resv)
		}
	}
	return c
}

// packed reports whether lengths cut b into strings with nothing left.
func packed(b []byte, lengths []uint32) bool {
	var n uint64 // no wrap, even where int is 32 bits
	for _, l := range lengths {
		n += uint64(l)
	}
	return n == uint64(len(b))
}

// unpack returns the next string of packed bytes b, of length l, at *at,
// and moves *at past it. The string shares b's bytes, which no one
// writes: a decoded command is not changed, and publish copies the key
// into its record.
func unpack(b []byte, at *int, l uint32) string {
	if l == 0 {
		return ""
	}
	s := unsafe.String(&b[*at], int(l))
	*at += int(l)
	return s
}

// intern returns the index of name in names, appending it if missing: a
// batch names few segments and tenants.
func intern(names []string, name string) (uint32, []string) {
	if i := slices.Index(names, name); i >= 0 {
		return uint32(i), names
	}
	return uint32(len(names)), append(names, name)
}

// publish makes a put COMPLETE with the replicas it can carve out of
// reservations. A key that is already complete is left as it is (objects
// are immutable) and succeeds; its reserved space goes back at release.
func (f *FSM) publish(p *publication, now int64, term uint64) error {
	if o := f.objects.get(p.key); o != nil {
		if o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) {
			return nil
		}
		if now <= f.deadline(o) {
			return fmt.Errorf("%w: %q", ErrPutInProgress, p.key)
		}
		f.retire(o, now+lateWriteGrace) // an abandoned put of an earlier version
	}
	if p.size == 0 || !recordable(p.key, p.parent) {
		return fmt.Errorf("%w: zero-length value, or key or parent key too long", ErrInvalidRequest)
	}
	if p.reservations != len(p.replicas) {
		return fmt.Errorf("%w: %d replicas and %d reservations for %q", ErrInvalidRequest, len(p.replicas), p.reservations, p.key)
	}
	var buf [4]extent // newObject copies them
	exts := buf[:0]
	for _, r := range p.replicas {
		s := f.segments[r.segment]
		if s == nil || slices.ContainsFunc(exts, func(x extent) bool { return f.seg(x).node == s.node }) {
			continue
		}
		if r.offset%s.alloc.align != 0 || p.size > s.alloc.capacity || !s.carve(r.reservation, r.offset, s.alloc.rounded(p.size)) {
			continue
		}
		s.objects++
		exts = append(exts, newExtent(r.offset, s.idx))
	}
	if len(exts) == 0 {
		if slices.ContainsFunc(p.replicas, func(r placedReplica) bool { return f.segments[r.segment] == nil }) {
			return fmt.Errorf("%w while writing %q; retry", ErrStoreGone, p.key)
		}
		return fmt.Errorf("%w: %q (its space was released: the put expired)", ErrNotInProgress, p.key)
	}
	o := f.newObject(p.key, p.size, p.checksum, p.putID, now, p.parent, p.tenant, exts)
	o.setFlag(flagPublishedInTerm, p.putID>>40 == term)
	if w := wanted(p.want); w > 0 {
		f.edit(o, func(r *rare) { r.want = w })
	}
	return nil
}

// release frees the unpublished space of reservations of c.Segment.
func (f *FSM) release(c *pb.ReleaseCmd, now int64) int {
	s := f.segments[c.Segment]
	if s == nil {
		return 0
	}
	n := 0
	s.resv = slices.DeleteFunc(s.resv, func(r *reservation) bool {
		if !slices.Contains(c.Ids, r.id) || (c.OnlyExpired && now < r.releaseAfter) {
			return false
		}
		for _, sp := range r.spans {
			s.alloc.release(sp.off, sp.len)
		}
		n++
		return true
	})
	return n
}

// expiredReservations lists, per segment, reservations past their
// release_after, so a leader can free what earlier leaders set aside.
func (f *FSM) expiredReservations(now int64) map[string][]uint64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var out map[string][]uint64
	for id, s := range f.segments {
		for _, r := range s.resv {
			if now >= r.releaseAfter {
				if out == nil {
					out = map[string][]uint64{}
				}
				out[id] = append(out[id], r.id)
			}
		}
	}
	return out
}
