package master

import (
	"fmt"
	"slices"
	"sort"

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
		sp := r.spans[i]
		var parts []span
		if off > sp.off {
			parts = append(parts, span{sp.off, off - sp.off})
		}
		if end := sp.off + sp.len; off+n < end {
			parts = append(parts, span{off + n, end - off - n})
		}
		r.spans = slices.Replace(r.spans, i, i+1, parts...)
		return true
	}
	return false
}

// publish makes a put COMPLETE with the replicas it can carve out of
// reservations. A key that is already complete is left as it is (objects
// are immutable) and succeeds; its reserved space goes back at release.
func (f *FSM) publish(it *pb.PublishItem, now int64, term uint64) error {
	if o := f.objects.get(it.Key); o != nil {
		if o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) {
			return nil
		}
		if now <= f.deadline(o) {
			return fmt.Errorf("%w: %q", ErrPutInProgress, it.Key)
		}
		f.retire(o, now+lateWriteGrace) // an abandoned put of an earlier version
	}
	if it.Size == 0 || !recordable(it.Key, it.Parent) {
		return fmt.Errorf("%w: zero-length value, or key or parent key too long", ErrInvalidRequest)
	}
	if len(it.Reservations) != len(it.Replicas) {
		return fmt.Errorf("%w: %d replicas and %d reservations for %q", ErrInvalidRequest, len(it.Replicas), len(it.Reservations), it.Key)
	}
	var buf [4]extent // newObject copies them
	exts := buf[:0]
	for i, e := range it.Replicas {
		s := f.segments[e.Segment]
		if s == nil || slices.ContainsFunc(exts, func(x extent) bool { return f.seg(x).node == s.node }) {
			continue
		}
		if e.Offset%s.alloc.align != 0 || it.Size > s.alloc.capacity || !s.carve(it.Reservations[i], e.Offset, s.alloc.rounded(it.Size)) {
			continue
		}
		s.objects++
		exts = append(exts, newExtent(e.Offset, s.idx))
	}
	if len(exts) == 0 {
		if slices.ContainsFunc(it.Replicas, func(e *pb.Extent) bool { return f.segments[e.Segment] == nil }) {
			return fmt.Errorf("%w while writing %q; retry", ErrStoreGone, it.Key)
		}
		return fmt.Errorf("%w: %q (its space was released: the put expired)", ErrNotInProgress, it.Key)
	}
	o := f.newObject(it.Key, it.Size, it.Checksum, it.PutId, now, it.Parent, it.Tenant, exts)
	o.setFlag(flagPublishedInTerm, it.PutId>>40 == term)
	if w := wanted(it.ReplicasWanted); w > 0 {
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
