package master

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
	"github.com/tidepool-kv/tidepool/ticket"
)

// The put path costs one raft entry per put batch, its Publish. The leader
// places puts from memory, in space it reserved through raft ahead of need
// (ReserveCmd), so a put start needs no commit, and concurrent puts share
// the commits of their Publishes (raft writes queued entries with one
// fsync). Reservations fence failover: a new leader never places puts in
// an earlier leader's reservations, and frees their unpublished space only
// when every put placed there is past its deadline and late-write grace.
const (
	// maxReserve bounds one reservation; below it, it is a 64th of its
	// segment (what a failover may hold back for a while, and copies
	// cannot use meanwhile), and never less than the put that asks for it.
	maxReserve = 64 << 20
	// idleReservation: a reservation no put was placed in for this long is
	// closed, so its space is not held from copies while puts pause.
	idleReservation = time.Second
)

// putTable is the leader's soft state of the put path: puts placed and not
// yet published or revoked, and the reservations it places them in. A
// leader change clears it: puts in flight then publish through the next
// leader with what their start answered (BatchPutEnd), and the FSM checks
// their space is still reserved.
type putTable struct {
	mu        sync.Mutex
	gen       uint64 // bumped at every reset: late reservations of an old term are dropped
	term      uint64
	seq       uint64
	pending   map[uint64]*pendingPut
	byKey     map[string]uint64
	resv      map[string][]*openResv  // segment -> this leader's reservations, oldest first
	reserving map[string]*reserveCall // segment -> its ReserveCmd in flight
	kick      chan struct{}           // a reservation is closed and done: release it
}

type pendingPut struct {
	id       uint64
	item     *pb.PublishItem
	grant    bool // placed ahead for a key not known yet
	resv     []*openResv
	deadline time.Time
	gen      uint64 // the table's, when it was added
}

// openResv is the leader's view of one of its reservations: what it has
// not handed out yet, and how many puts placed in it are still open.
type openResv struct {
	id         uint64
	segment    string
	spans      []span // not handed out yet
	left       uint64
	size       uint64
	allocUntil time.Time
	lastUse    time.Time // of its last put; an idle one is closed
	inflight   int
	closed     bool // no more puts placed in it; released once inflight is 0
}

func newPutTable() *putTable {
	t := &putTable{kick: make(chan struct{}, 1)}
	t.reset(0)
	return t
}

// reset forgets every put and reservation, for a new leader term.
func (t *putTable) reset(term uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.gen++
	t.term, t.seq = term, 0
	t.pending = map[uint64]*pendingPut{}
	t.byKey = map[string]uint64{}
	t.resv = map[string][]*openResv{}
	t.reserving = map[string]*reserveCall{} // their goroutines end the old ones
}

// open counts the puts placed and not yet ended.
func (t *putTable) open() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.pending)
}

// take hands out n bytes (already aligned) of an open reservation of
// segment, first fit, or reports that none has them.
func (t *putTable) take(segment string, n uint64, now time.Time) (*openResv, uint64, bool) {
	for _, r := range t.resv[segment] {
		if r.closed {
			continue
		}
		if !now.Before(r.allocUntil) {
			r.closed = true
			continue
		}
		if r, off, ok := t.takeFrom(r, n); ok {
			return r, off, true
		}
		// Puts of one size fill a reservation exactly; what is left of one
		// too small for this put goes back with it.
		r.closed = true
		t.kickIfDone(r)
	}
	return nil, 0, false
}

// takeFrom hands out n bytes of r, first fit.
func (t *putTable) takeFrom(r *openResv, n uint64) (*openResv, uint64, bool) {
	for i, sp := range r.spans {
		if sp.len < n {
			continue
		}
		if sp.len == n {
			r.spans = append(r.spans[:i], r.spans[i+1:]...)
		} else {
			r.spans[i] = span{sp.off + n, sp.len - n}
		}
		r.left -= n
		r.inflight++
		r.lastUse = time.Now()
		return r, sp.off, true
	}
	return nil, 0, false
}

// kickIfDone asks the leader loop to release r if nothing placed in it is
// open any more.
func (t *putTable) kickIfDone(r *openResv) {
	if r.closed && r.inflight == 0 {
		select {
		case t.kick <- struct{}{}:
		default:
		}
	}
}

// low reports whether segment's open reservations are running out, so the
// next one should be asked for before a put must wait for it.
func (t *putTable) low(segment string, now time.Time, window time.Duration) bool {
	for _, r := range t.resv[segment] {
		if !r.closed && now.Before(r.allocUntil.Add(-window/4)) && r.left >= r.size/2 {
			return false
		}
	}
	return true
}

// done ends a put placed by this leader: published or revoked after its
// writes ended. It reports whether the put was still open here.
func (t *putTable) done(id uint64) bool {
	p := t.pending[id]
	if p == nil {
		return false
	}
	delete(t.pending, id)
	if t.byKey[p.item.Key] == id {
		delete(t.byKey, p.item.Key)
	}
	for _, r := range p.resv {
		r.inflight--
		t.kickIfDone(r)
	}
	return true
}

// add numbers p and claims its key, if any.
func (t *putTable) add(p *pendingPut) {
	t.seq++
	p.id = t.term<<40 | t.seq
	p.item.PutId = p.id
	p.gen = t.gen
	t.pending[p.id] = p
	if p.item.Key != "" {
		t.byKey[p.item.Key] = p.id
	}
}

// unclaim gives back pieces taken for a put that is not handed out: they
// stay unused in their reservations (released with them).
func (t *putTable) unclaim(used []*openResv) {
	for _, r := range used {
		r.inflight--
		t.kickIfDone(r)
	}
}

func resvIDs(rs []*openResv) []uint64 {
	ids := make([]uint64, len(rs))
	for i, r := range rs {
		ids[i] = r.id
	}
	return ids
}

// inProgress reports whether a put of key placed by this leader is open.
func (t *putTable) inProgress(key string, now time.Time) bool {
	id, ok := t.byKey[key]
	return ok && now.Before(t.pending[id].deadline)
}

// place finds room for one put: one extent on each of the first
// candidates with room, on distinct nodes, up to want. It reserves space
// through raft when no reservation of a candidate holds the put, and asks
// for the next reservation ahead of need.
//
// A put outside its preferred tier (a spill while that tier is full)
// reserves only its own size, and nothing ahead: demotions into that tier
// need the room.
//
// The first extent, and the slices' first element, live in rec.
func (s *Server) place(ctx context.Context, it *pb.PublishItem, want int, tier pb.Tier, candidates []string, views map[string]segmentView, rec *putRecord) ([]*pb.Extent, []*openResv, error) {
	t := s.puts
	exts, used := rec.exts[:0:1], rec.used[:0:1]
	nodes := map[string]bool{}
	var firstErr error
	for _, seg := range candidates {
		if len(exts) == want {
			break
		}
		v, ok := views[seg]
		if !ok || nodes[v.node] {
			continue
		}
		a := alignment(v.tier)
		n := (it.Size + a - 1) / a * a
		size := n
		if v.tier == orDRAM(tier) {
			size = reserveSize(v.capacity, n)
		}
		now := s.cfg.Now()
		t.mu.Lock()
		r, off, ok := t.take(seg, n, now)
		low := ok && size > n && t.low(seg, now, s.cfg.ReserveWindow)
		t.mu.Unlock()
		if low {
			s.reserveAhead(seg, size, n)
		}
		if !ok {
			var err error
			if r, off, err = s.reserveFor(ctx, seg, size, n); err != nil {
				if ctx.Err() != nil {
					t.mu.Lock()
					t.unclaim(used)
					t.mu.Unlock()
					return nil, nil, ctx.Err()
				}
				if firstErr == nil || !errors.Is(err, ErrNoSpace) {
					firstErr = err
				}
				continue
			}
		}
		nodes[v.node] = true
		e := &rec.ext
		if len(exts) > 0 {
			e = new(pb.Extent)
		}
		e.Segment, e.Offset, e.Length = seg, off, it.Size
		exts = append(exts, e)
		used = append(used, r)
	}
	if len(exts) == 0 {
		if firstErr == nil || errors.Is(firstErr, ErrStoreGone) || errors.Is(firstErr, ErrTooLarge) {
			firstErr = fmt.Errorf("%w for %d bytes", ErrNoSpace, it.Size)
		}
		return nil, nil, firstErr
	}
	return exts, used, nil
}

// reserveSize is how much one reservation of a segment asks for.
func reserveSize(capacity, n uint64) uint64 {
	return max(min(capacity/64, maxReserve), n)
}

// reserveFor reserves space of segment through raft and takes n bytes of
// it for the put that waits. It first joins a reservation in flight (which
// may have been asked for a smaller put, or be taken by others first),
// then asks for its own, whose first n bytes are this put's.
func (s *Server) reserveFor(ctx context.Context, segment string, size, n uint64) (*openResv, uint64, error) {
	for round := range 2 {
		call, err := s.startReserve(segment, size, n, true, round == 0)
		if err != nil {
			return nil, 0, err
		}
		select {
		case <-call.done:
		case <-ctx.Done():
			return nil, 0, ctx.Err() // a piece claimed for us waits for its release_after
		}
		if call.claimed != nil {
			return call.claimed, call.off, nil
		}
		if call.err != nil && !call.joined {
			return nil, 0, call.err
		}
		s.puts.mu.Lock()
		r, off, ok := s.puts.take(segment, n, s.cfg.Now())
		s.puts.mu.Unlock()
		if ok {
			return r, off, nil
		}
	}
	return nil, 0, fmt.Errorf("%w for %d bytes in %s", ErrNoSpace, n, segment)
}

// reserveCall is one ReserveCmd in flight.
type reserveCall struct {
	done chan struct{} // closed when it has ended
	// Set before done is closed, for the caller that asked (need) and not
	// for those that joined it.
	err     error
	claimed *openResv
	off     uint64
	joined  bool // the handle of a caller that joined another's call
}

// reserveAhead asks for segment's next reservation in the background, if
// the segment has room to spare: ahead of need it reclaims nothing.
func (s *Server) reserveAhead(segment string, size, n uint64) {
	_, _ = s.startReserve(segment, size, n, false, true)
}

// startReserve proposes a ReserveCmd of size bytes, in spans of at least
// n, for segment unless one is in flight,
// which it joins. The command runs in a goroutine of the server, so a
// caller that gives up does not waste it. need says a put waits for it:
// it may reclaim written-back replicas, and its first n bytes are claimed
// for that put. Unless join, it asks anew even with one in flight.
func (s *Server) startReserve(segment string, size, n uint64, need, join bool) (*reserveCall, error) {
	t := s.puts
	t.mu.Lock()
	if c, ok := t.reserving[segment]; ok && join {
		t.mu.Unlock()
		return &reserveCall{done: c.done, joined: true}, nil
	}
	view, ok := s.segmentView(segment)
	if !ok {
		t.mu.Unlock()
		return nil, fmt.Errorf("%w: segment %s", ErrStoreGone, segment)
	}
	if !need && view.largestFree < 2*size {
		// Under pressure the room is for puts that wait, not for later ones.
		t.mu.Unlock()
		return nil, nil
	}
	call := &reserveCall{done: make(chan struct{})}
	t.reserving[segment] = call
	gen := t.gen
	t.mu.Unlock()

	now := s.cfg.Now()
	cmd := &pb.ReserveCmd{
		Segment: segment, Bytes: size, MinSpan: n,
		AllocUntilUnixNano:   now.Add(s.cfg.ReserveWindow).UnixNano(),
		ReleaseAfterUnixNano: now.Add(s.cfg.ReserveWindow+s.cfg.PutTimeout).UnixNano() + lateWriteGrace,
	}
	if need && view.largestFree < n {
		cmd.Reclaim = s.reclaimFor([]*pb.PutStartItem{{Size: n, Candidates: []string{segment}}})
	}
	started := s.goOwned(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		out, err := s.apply(ctx, &pb.Command{Op: &pb.Command_Reserve{Reserve: cmd}})
		var res ReserveResult
		if err == nil {
			res = out.(ReserveResult)
			err = res.Err
			for range res.Reclaimed {
				s.metrics.dropped("reclaim")
			}
		}
		t.mu.Lock()
		defer t.mu.Unlock()
		defer close(call.done)
		if t.reserving[segment] == call {
			delete(t.reserving, segment)
		}
		call.err = err
		if err != nil {
			return
		}
		if t.gen != gen {
			// A new term: the reservation is freed at its release_after.
			call.err = fmt.Errorf("%w: the leader changed while reserving", ErrNotLeader)
			return
		}
		var total uint64
		for _, sp := range res.Spans {
			total += sp.len
		}
		r := &openResv{id: res.ID, segment: segment, spans: res.Spans, left: total, size: total,
			allocUntil: time.Unix(0, cmd.AllocUntilUnixNano), lastUse: time.Now()}
		t.resv[segment] = append(t.resv[segment], r)
		if need {
			call.claimed, call.off, _ = t.takeFrom(r, n)
		}
	})
	if !started { // closing
		t.mu.Lock()
		if t.reserving[segment] == call {
			delete(t.reserving, segment)
		}
		call.err = ErrNotLeader
		close(call.done)
		t.mu.Unlock()
		return nil, ErrNotLeader
	}
	return call, nil
}

// sweepPuts forgets expired puts, and releases this leader's reservations
// once every put placed in them has ended, and any leader's once no write
// placed in them can still land.
func (s *Server) sweepPuts(ctx context.Context, now time.Time) {
	t := s.puts
	t.mu.Lock()
	for id, p := range t.pending {
		if !now.Before(p.deadline) {
			// Its reservations wait for their release_after: late bytes.
			delete(t.pending, id)
			if t.byKey[p.item.Key] == id {
				delete(t.byKey, p.item.Key)
			}
			s.metrics.revoked(1)
		}
	}
	t.mu.Unlock()
	s.releaseDone(ctx, now)
	for seg, ids := range s.fsm.expiredReservations(now.UnixNano()) {
		s.releaseReservations(ctx, seg, ids, true)
	}
}

// releaseDone releases this leader's reservations that are closed (full, or
// past their window) and hold no open put.
func (s *Server) releaseDone(ctx context.Context, now time.Time) {
	t := s.puts
	done := map[string][]uint64{}
	t.mu.Lock()
	for seg, rs := range t.resv {
		for _, r := range rs {
			if !now.Before(r.allocUntil) || time.Since(r.lastUse) > idleReservation {
				r.closed = true
			}
			if r.closed && r.inflight == 0 {
				done[seg] = append(done[seg], r.id)
			}
		}
	}
	t.mu.Unlock()
	for seg, ids := range done {
		s.releaseReservations(ctx, seg, ids, false)
	}
}

func (s *Server) releaseReservations(ctx context.Context, segment string, ids []uint64, onlyExpired bool) {
	_, err := s.apply(ctx, &pb.Command{Op: &pb.Command_Release{Release: &pb.ReleaseCmd{Segment: segment, Ids: ids, OnlyExpired: onlyExpired}}})
	if err != nil {
		s.log.Warn("release reservations", "segment", segment, "ids", len(ids), "err", err)
		return
	}
	t := s.puts
	t.mu.Lock()
	defer t.mu.Unlock()
	rs := t.resv[segment][:0]
	for _, r := range t.resv[segment] {
		if !slices.Contains(ids, r.id) {
			rs = append(rs, r)
		}
	}
	if len(rs) == 0 {
		delete(t.resv, segment)
	} else {
		t.resv[segment] = rs
	}
}

// Grants are bounded per request, in count and bytes: what a client does
// not use stays reserved until its reservation is released.
const (
	maxGrants     = 1024
	maxGrantBytes = 16 << 20
)

// grant places puts for keys not known yet, as runs: each ask becomes as
// few runs of contiguous space as the reservations allow. The runs answer
// a prefix of the asks, in order: it stops at maxGrants, maxGrantBytes,
// or a shape it cannot place without evicting or spilling (the client
// then starts those puts as usual).
func (m *masterService) grant(ctx context.Context, asks []*pb.GrantAsk) []*pb.GrantRun {
	if len(asks) == 0 {
		return nil
	}
	host := clientHost(ctx)
	views := map[string]segmentView{}
	for _, v := range m.s.fsm.segmentViews() {
		views[v.id] = v
	}
	var out []*pb.GrantRun
	var count int
	var bytes uint64
	for _, a := range asks {
		if a.Count == 0 {
			continue
		}
		if a.Size == 0 || validTier(a.Tier) != nil || m.s.fsm.hasQuota(a.Tenant, orDRAM(a.Tier)) {
			// A put under a quota starts as usual, where room is made
			// within the quota first.
			return out
		}
		it := &pb.PutStartRequest{Size: a.Size, Tier: a.Tier, Replicas: a.Replicas, Tenant: a.Tenant}
		want := min(int(min(a.Count, maxGrants)), maxGrants-count, int((maxGrantBytes-bytes)/a.Size))
		cands := m.s.candidates(a.Size, a.Tier, host)
		for placed := 0; placed < want; {
			run, err := m.s.placeRun(ctx, it, want-placed, cands, views)
			if err != nil || run == nil {
				return out // no room without evicting, or a spill
			}
			out = append(out, run)
			placed += int(run.Count)
			count += int(run.Count)
			bytes += uint64(run.Count) * a.Size
		}
		if want < int(a.Count) {
			return out
		}
	}
	return out
}

// grantAsks is what req asks grants for: its grants, one request a grant
// (clients before grant_asks), as asks of consecutive requests of one
// shape and tenant, then its grant_asks.
func grantAsks(req *pb.BatchPutEndRequest) []*pb.GrantAsk {
	if len(req.Grants) == 0 {
		return req.GrantAsks
	}
	var asks []*pb.GrantAsk
	for i := 0; i < len(req.Grants); {
		it := req.Grants[i]
		same := 1
		for i+same < len(req.Grants) && req.Grants[i+same].Size == it.Size && req.Grants[i+same].Tier == it.Tier && req.Grants[i+same].Replicas == it.Replicas && req.Grants[i+same].Tenant == it.Tenant {
			same++
		}
		i += same
		asks = append(asks, &pb.GrantAsk{Size: it.Size, Tier: it.Tier, Replicas: it.Replicas, Tenant: it.Tenant, Count: uint32(same)})
	}
	return append(asks, req.GrantAsks...)
}

// placeRun places up to count puts of it's shape in contiguous space of
// one reservation per replica, in its preferred tier only.
func (s *Server) placeRun(ctx context.Context, it *pb.PutStartRequest, count int, candidates []string, views map[string]segmentView) (*pb.GrantRun, error) {
	want := max(int(it.Replicas), 1)
	type taken struct {
		r   *openResv
		off uint64
	}
	var got []taken
	var n uint64
	t := s.puts
	nodes := map[string]bool{}
	for _, seg := range candidates {
		if len(got) == want {
			break
		}
		v, ok := views[seg]
		if !ok || nodes[v.node] || v.tier != orDRAM(it.Tier) {
			continue
		}
		a := alignment(v.tier)
		n = (it.Size + a - 1) / a * a
		size := reserveSize(v.capacity, n)
		t.mu.Lock()
		r, off, c := t.takeRun(seg, n, count, s.cfg.Now())
		t.mu.Unlock()
		if c == 0 {
			r0, off0, err := s.reserveFor(ctx, seg, size, n)
			if err != nil {
				continue
			}
			r, off, c = r0, off0, 1
		}
		t.mu.Lock()
		low := t.low(seg, s.cfg.Now(), s.cfg.ReserveWindow)
		t.mu.Unlock()
		if low {
			s.reserveAhead(seg, size, n)
		}
		// Every replica of the run holds the same count of puts.
		if c < count {
			t.mu.Lock()
			for i := range got {
				t.giveBack(got[i].r, got[i].off+uint64(c)*n, uint64(count-c)*n, count-c)
			}
			t.mu.Unlock()
			count = c
		}
		nodes[v.node] = true
		got = append(got, taken{r, off})
	}
	if len(got) == 0 {
		return nil, nil
	}
	exts := make([]*pb.Extent, len(got))
	for i, g := range got {
		exts[i] = &pb.Extent{Segment: g.r.segment, Offset: g.off, Length: it.Size}
	}
	deadline := s.cfg.Now().Add(s.cfg.PutTimeout)
	s.fsm.mu.RLock()
	reps := s.fsm.describePlaced(exts, access{}, nil)
	// One ticket per replica covers the whole run, so the run's puts may
	// travel together; each put's id is in its PutEnd, not its ticket.
	for _, r := range reps {
		if seg := s.fsm.segments[r.Segment]; seg != nil {
			r.Ticket = seg.ticket(access{op: ticket.Write, expiry: deadline.UnixNano()}, r.Offset, uint64(count)*n)
		}
	}
	s.fsm.mu.RUnlock()
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(reps) < len(exts) {
		for _, g := range got { // a segment went away: so did its space
			for range count {
				g.r.inflight--
			}
			t.kickIfDone(g.r)
		}
		return nil, nil
	}
	run := &pb.GrantRun{Count: uint32(count), Stride: n, Replicas: reps, WriteTimeoutMs: uint64(s.cfg.PutTimeout.Milliseconds())}
	for _, g := range got {
		run.Reservations = append(run.Reservations, g.r.id)
	}
	// The run's puts in a few allocations rather than several each.
	puts, items := make([]pendingPut, count), make([]pb.PublishItem, count)
	r := len(got)
	placed, extPtrs, resvs := make([]pb.Extent, count*r), make([]*pb.Extent, count*r), make([]*openResv, count*r)
	for i := range count {
		p, pi := &puts[i], &items[i]
		pi.Size, pi.Reservations, pi.ReplicasWanted, pi.Tenant = it.Size, run.Reservations, uint32(want), it.Tenant
		for j, g := range got {
			e := &placed[i*r+j]
			e.Segment, e.Offset, e.Length = g.r.segment, g.off+uint64(i)*n, it.Size
			extPtrs[i*r+j], resvs[i*r+j] = e, g.r
		}
		pi.Replicas = extPtrs[i*r : (i+1)*r : (i+1)*r]
		p.item, p.grant, p.deadline, p.resv = pi, true, deadline, resvs[i*r:(i+1)*r:(i+1)*r]
		t.add(p)
		if i == 0 {
			run.FirstPutId = p.id
		}
	}
	return run, nil
}

// takeRun hands out up to count contiguous pieces of n bytes from one open
// reservation of segment, and reports how many it took.
func (t *putTable) takeRun(segment string, n uint64, count int, now time.Time) (*openResv, uint64, int) {
	for _, r := range t.resv[segment] {
		if r.closed || !now.Before(r.allocUntil) {
			continue
		}
		best := -1
		for i, sp := range r.spans {
			if sp.len >= n && (best < 0 || sp.len > r.spans[best].len) {
				best = i
			}
		}
		if best < 0 {
			continue
		}
		sp := r.spans[best]
		c := min(count, int(sp.len/n))
		take := uint64(c) * n
		if sp.len == take {
			r.spans = append(r.spans[:best], r.spans[best+1:]...)
		} else {
			r.spans[best] = span{sp.off + take, sp.len - take}
		}
		r.left -= take
		r.inflight += c
		r.lastUse = time.Now()
		return r, sp.off, c
	}
	return nil, 0, 0
}

// giveBack returns the tail of a run taken from r and not handed out.
func (t *putTable) giveBack(r *openResv, off, n uint64, count int) {
	r.inflight -= count
	r.left += n
	for i, sp := range r.spans {
		if sp.off == off+n {
			r.spans[i] = span{off, sp.len + n}
			return
		}
	}
	r.spans = append(r.spans, span{off, n})
}
