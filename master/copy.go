package master

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/codes"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
	"github.com/tidepool-kv/tidepool/ticket"
)

// Copies move an object's bytes between segments without a client: a
// demotion to a slower tier, a promotion to a faster one, a drain off a
// node. The leader allocates the new replica through raft (CopyStart), the
// store holding the source makes the copy, which the leader hands it on its
// next heartbeat, and reports back on the one after; the leader then
// publishes the replica (CopyEnd), dropping the source for a move. A copy
// that is not reported by its deadline is ended by the sweep, so a store
// that dies mid-copy leaks nothing.

// copyStart allocates the target of a copy; id (the raft position of the
// command) names it. At most one copy of an object runs at a time, and the
// target is a segment that holds no replica of it yet.
func (f *FSM) copyStart(it *pb.CopyStartItem, id uint64) CopyStartResult {
	o := f.objects.get(it.Key)
	switch {
	case o == nil || !o.is(pb.ObjectState_OBJECT_STATE_COMPLETE) || (it.PutId != 0 && o.putID != it.PutId):
		return CopyStartResult{Err: errorf(ErrNotFound, it.Key)}
	case len(f.copies(o)) > 0:
		return CopyStartResult{Err: errorf(ErrCopyInProgress, it.Key)}
	case !f.onSegment(o, it.Source):
		return CopyStartResult{Err: fmt.Errorf("%w: %q has no replica on %s", ErrNotFound, it.Key, it.Source)}
	}
	for _, segID := range it.Candidates {
		s := f.segments[segID]
		if s == nil || f.onSegment(o, segID) {
			continue
		}
		off, ok := s.alloc.alloc(o.size)
		if !ok {
			continue
		}
		c := &pb.PendingCopy{
			Id: id, Target: &pb.Extent{Segment: s.id, Offset: off, Length: o.size}, Source: it.Source,
			DeadlineUnixNano: it.DeadlineUnixNano, Reason: it.Reason,
		}
		f.edit(o, func(r *rare) { r.copies = append(slices.Clone(r.copies), c) })
		return CopyStartResult{Copy: c}
	}
	return CopyStartResult{Err: fmt.Errorf("%w to copy %q (%d bytes)", ErrNoSpace, it.Key, o.size)}
}

// copyEnd publishes or abandons a copy. A move (demotion, drain) drops its
// source once the copy is a replica; that space is reused from freeAfter on.
func (f *FSM) copyEnd(it *pb.CopyEndItem, freeAfter, now int64) CopyEndResult {
	o := f.objects.get(it.Key)
	i := -1
	if o != nil {
		i = slices.IndexFunc(f.copies(o), func(c *pb.PendingCopy) bool { return c.Id == it.CopyId })
	}
	if i < 0 {
		if !it.OnlyExpired {
			f.copyReported(it.CopyId)
		}
		return CopyEndResult{Err: fmt.Errorf("%w: copy %d of %q", ErrNotInProgress, it.CopyId, it.Key)}
	}
	c := f.copies(o)[i]
	if it.OnlyExpired && c.DeadlineUnixNano >= now {
		return CopyEndResult{Err: fmt.Errorf("%w: copy %d of %q has not expired", ErrNotInProgress, it.CopyId, it.Key)}
	}
	f.edit(o, func(r *rare) { r.copies = slices.Delete(slices.Clone(r.copies), i, i+1) })
	res := CopyEndResult{Reason: c.Reason, Size: o.size}
	if src := f.segments[c.Source]; src != nil {
		res.Node = src.node
	}
	switch {
	case it.OnlyExpired, now > c.DeadlineUnixNano:
		// The copier stops at the deadline, but its bytes may still land.
		f.freeExtent(c.Target, now+lateWriteGrace)
		res.Err = fmt.Errorf("%w: copy %d of %q expired", ErrNotInProgress, it.CopyId, it.Key)
	case it.Failed:
		f.freeExtent(c.Target, 0)
	default:
		f.setExts(o, append(slices.Clone(f.exts(o)), f.extentOn(c.Target.Segment, c.Target.Offset)))
		if s := f.segments[c.Target.Segment]; s != nil {
			s.objects++
		}
		if moves(c.Reason) {
			if j := f.replicaOn(o, c.Source); j >= 0 {
				f.dropExtent(o, j, freeAfter, now)
			}
		}
		res.Done = true
	}
	return res
}

// copyReported frees at once the target of a copy whose object went
// while it ran: its store has reported, so no more bytes will land.
func (f *FSM) copyReported(id uint64) {
	for i, p := range f.pending {
		if p.CopyId == id {
			if s := f.segments[p.Extent.Segment]; s != nil {
				s.alloc.release(p.Extent.Offset, p.Extent.Length)
			}
			f.pending.remove(i)
			return
		}
	}
}

// holds reports whether any of a node's segments holds a replica, the
// target of a copy, or space whose read leases have not ended; f.mu must
// be held.
func (f *FSM) holds(n *node) bool {
	for _, id := range n.segments {
		if s := f.segments[id]; s != nil && s.objects > 0 {
			return true
		}
	}
	mine := func(e *pb.Extent) bool { return slices.Contains(n.segments, e.Segment) }
	// Space freed but still under a read lease: a reader may still be
	// reading there, so the node's bytes must stay reachable.
	if slices.ContainsFunc(f.pending, func(p *pb.PendingFree) bool { return mine(p.Extent) }) {
		return true
	}
	for o := range f.copying {
		for _, c := range f.copies(o) {
			if mine(c.Target) {
				return true
			}
		}
	}
	return false
}

// expiredCopies lists copies past their deadline, by key.
func (f *FSM) expiredCopies(now int64) []*pb.CopyEndItem {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var out []*pb.CopyEndItem
	for o := range f.copying {
		for _, c := range f.copies(o) {
			if c.DeadlineUnixNano < now {
				out = append(out, &pb.CopyEndItem{Key: o.key(), CopyId: c.Id, OnlyExpired: true})
			}
		}
	}
	slices.SortFunc(out, func(a, b *pb.CopyEndItem) int { return strings.Compare(a.Key, b.Key) })
	return out
}

// copyJob is a copy for the leader to start: the object, the replica to
// read, and where the new one may go, best first.
type copyJob struct {
	key        string
	putID      uint64
	source     string
	candidates []string
	reason     pb.CopyReason
}

// startCopies allocates the targets of jobs through raft and queues each
// started copy for the store that holds its source. It returns how many
// started, and the keys of those that found no room.
func (s *Server) startCopies(ctx context.Context, jobs []copyJob) (started int, noRoom []string, err error) {
	// A few thousand per raft entry: each item carries its candidates.
	for chunk := range slices.Chunk(jobs, copyBatch) {
		n, nr, err := s.startCopyBatch(ctx, chunk)
		started, noRoom = started+n, append(noRoom, nr...)
		if err != nil {
			return started, noRoom, err
		}
	}
	return started, noRoom, nil
}

// copyBatch bounds the copies one CopyStart command starts.
const copyBatch = 1024

func (s *Server) startCopyBatch(ctx context.Context, jobs []copyJob) (started int, noRoom []string, err error) {
	deadline := s.cfg.Now().Add(s.cfg.PutTimeout)
	cmd := &pb.CopyStartCmd{}
	for _, j := range jobs {
		cmd.Items = append(cmd.Items, &pb.CopyStartItem{
			Key: j.key, PutId: j.putID, Source: j.source, Candidates: j.candidates,
			DeadlineUnixNano: deadline.UnixNano(), Reason: j.reason,
		})
	}
	out, err := s.apply(ctx, &pb.Command{Op: &pb.Command_CopyStart{CopyStart: cmd}})
	if err != nil {
		return 0, nil, err
	}
	for i, r := range out.([]CopyStartResult) {
		if errors.Is(r.Err, ErrNoSpace) {
			noRoom = append(noRoom, cmd.Items[i].Key)
		}
		if r.Err != nil {
			continue
		}
		task, node, ok := s.fsm.copyTask(cmd.Items[i].Key, r.Copy, deadline)
		if !ok {
			continue // the object or a segment went away; the sweep ends the copy
		}
		s.mu.Lock()
		s.mu.copyQueue[node] = append(s.mu.copyQueue[node], queuedCopy{task: task, deadline: deadline})
		s.mu.Unlock()
		started++
	}
	return started, noRoom, nil
}

// copyTask describes a started copy for the store that makes it.
func (f *FSM) copyTask(key string, c *pb.PendingCopy, deadline time.Time) (*pb.CopyTask, string, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	o := f.objects.get(key)
	src := f.segments[c.Source]
	if o == nil || src == nil {
		return nil, "", false
	}
	i := f.replicaOn(o, c.Source)
	if i < 0 { // dropped since the copy started (found corrupt)
		return nil, "", false
	}
	reps := f.describe(o.size, []extent{f.exts(o)[i], f.extentOn(c.Target.Segment, c.Target.Offset)}, access{})
	if len(reps) != 2 {
		return nil, "", false
	}
	source, target := reps[0], reps[1]
	if source.Segment != c.Source { // describe orders by tier
		source, target = target, source
	}
	// The copying store reads the source and writes the target through
	// their engines, so each needs its ticket until the copy's deadline.
	until := deadline.UnixNano()
	source.Ticket = src.ticket(access{op: ticket.Read, expiry: until}, source.Offset, o.size)
	if dst := f.segments[target.Segment]; dst != nil {
		target.Ticket = dst.ticket(access{op: ticket.Write, id: c.Id, expiry: until}, target.Offset, o.size)
	}
	return &pb.CopyTask{Id: c.Id, Key: key, Size: o.size, Checksum: o.checksum, Source: source, Target: target}, src.node, true
}

// queuedCopy is a copy waiting for its store's next heartbeat.
type queuedCopy struct {
	task     *pb.CopyTask
	deadline time.Time
}

// takeCopies hands a heartbeating store up to slots of its queued copies,
// dropping those too close to their deadline to be made (the sweep ends
// them). A task's timeout is what is left until its deadline, not the full
// put timeout: the store stops writing by then, which is what the target's
// late-write grace after the deadline assumes, however long the task queued.
func (s *Server) takeCopies(node string, slots int) []*pb.CopyTask {
	now := s.cfg.Now()
	// Not worth starting with less left than this; with a short put
	// timeout, a fixed second would hand out nothing at all.
	margin := min(time.Second, s.cfg.PutTimeout/4)
	s.mu.Lock()
	defer s.mu.Unlock()
	q := s.mu.copyQueue[node]
	var out []*pb.CopyTask
	for len(q) > 0 && len(out) < slots {
		if left := q[0].deadline.Sub(now); left > margin && left.Milliseconds() > 0 {
			task := q[0].task
			task.TimeoutMs = uint64(left.Milliseconds())
			out = append(out, task)
		}
		q = q[1:]
	}
	if len(q) == 0 {
		delete(s.mu.copyQueue, node)
	} else {
		s.mu.copyQueue[node] = q
	}
	return out
}

// endCopies publishes the copies a store reports.
func (s *Server) endCopies(ctx context.Context, results []*pb.CopyResult) error {
	if len(results) == 0 {
		return nil
	}
	cmd := &pb.CopyEndCmd{}
	var keys []string
	for _, r := range results {
		failed := r.Status != nil && r.Status.Code != int32(codes.OK)
		if failed {
			s.log.Warn("copy failed", "key", r.Key, "copy", r.Id, "err", r.Status.Message)
		}
		cmd.Items = append(cmd.Items, &pb.CopyEndItem{Key: r.Key, CopyId: r.Id, Failed: failed})
		keys = append(keys, r.Key)
	}
	cmd.FreeAfterUnixNano = s.leaseEnd(keys).UnixNano()
	out, err := s.apply(ctx, &pb.Command{Op: &pb.Command_CopyEnd{CopyEnd: cmd}})
	if err != nil {
		return err
	}
	s.copiesEnded(out.([]CopyEndResult))
	return nil
}

// copiesEnded counts ended copies in the metrics and drain progress. A
// copy the FSM did not know (reported twice, or ended by the sweep first)
// is not counted again.
func (s *Server) copiesEnded(res []CopyEndResult) {
	for _, r := range res {
		if r.Reason == pb.CopyReason_COPY_REASON_UNSPECIFIED {
			continue
		}
		result := "ok"
		if !r.Done {
			result = "failed"
		}
		s.metrics.copied(r.Reason, result, r.Size)
		if r.Done && r.Reason == pb.CopyReason_COPY_REASON_DRAIN {
			s.drainMoved(r.Node)
		}
	}
}

// endExpiredCopies ends the copies no store reported in time.
func (s *Server) endExpiredCopies(ctx context.Context, now time.Time) {
	items := s.fsm.expiredCopies(now.UnixNano())
	if len(items) == 0 {
		return
	}
	out, err := s.apply(ctx, &pb.Command{Op: &pb.Command_CopyEnd{CopyEnd: &pb.CopyEndCmd{Items: items}}})
	if err != nil {
		s.log.Warn("end expired copies", "copies", len(items), "err", err)
		return
	}
	s.log.Warn("copies expired before their store reported them", "copies", len(items))
	for _, r := range out.([]CopyEndResult) {
		if r.Reason != pb.CopyReason_COPY_REASON_UNSPECIFIED { // else its store reported it meanwhile
			s.metrics.copied(r.Reason, "expired", r.Size)
		}
	}
}

// leaseEnd is when the last read lease this leader (or, to be safe, an
// earlier one) granted on keys ends. A replica dropped while its key stays
// readable is freed then; a read leased in the instant between this and the
// drop's commit may still see the old replica, and its checksum check
// sends it to the next one if the space was reused.
func (s *Server) leaseEnd(keys []string) time.Time {
	t := time.Unix(0, s.fsm.leaseEnd(keys))
	// An earlier leader may have leased what was made before this one took
	// over, to the end of its first lease TTL.
	if l := s.leadership(); l.evictable.After(t) && !(l.leading && s.fsm.madeIn(keys, l.term)) {
		t = l.evictable
	}
	return t
}

// cachedEnds are, per key, until when a client may answer it from its
// lookup cache (unix nanos): when the last lookup lease this leader granted
// on it ends, or, in its first lease TTL, the end of any an earlier leader
// may have granted on an object made before it took over. Nil if no key
// may be cached.
func (s *Server) cachedEnds(keys []string) []int64 {
	l := s.leadership()
	var until int64 // no earlier leader's lease is left
	if l.evictable.After(s.cfg.Now()) {
		until = l.evictable.UnixNano()
	}
	term := l.term
	if !l.leading {
		term = 0 // no term's objects are known to be this node's
	}
	return s.fsm.cachedUntil(keys, term, until)
}

// moves reports whether a copy for reason replaces its source (demotion,
// drain) rather than adding a replica (promotion, write-back).
func moves(r pb.CopyReason) bool {
	return r == pb.CopyReason_COPY_REASON_DEMOTE || r == pb.CopyReason_COPY_REASON_DRAIN
}
