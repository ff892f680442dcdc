package engine

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"
	"time"
)

// A scheduler moves one request at a time of a peer's traffic over its
// rails: it cuts requests into slices, queues the slices by QoS class with
// aging, and binds each to a rail only when a connection slot on a rail
// frees up (late binding), choosing the rail by the sprayer's predicted
// finish time. In round-robin mode (the baseline) a slice is bound to a
// rail when it is cut, as Mooncake's engine does, and waits for that rail.

// lowYield is how long after the last High or Medium slice Low traffic
// keeps to one slot per rail.
const lowYield = 50 * time.Millisecond

// maxSliceAttempts bounds how often a slice is retried on other rails
// before its request falls over to the next transport.
const maxSliceAttempts = 8

// peer is the scheduling state of one target endpoint (all its rails).
type peer struct {
	e         *Engine
	sliceBase int
	tr        Transport
	endpoint  string
	mode      sprayMode
	rails     []*rail
	sp        *sprayer

	mu struct {
		sync.Mutex
		busy    map[*rail]int // slots in use per rail
		lowBusy map[*rail]int // of which by Low slices
		urgent  time.Time     // when the last High or Medium slice was queued
		shared  *qosQueue[*slice]
		byRail  map[*rail]*qosQueue[*slice] // round-robin mode
		rr      int
		caps    *tenantCaps
	}
}

// request is one task's transfer through the scheduler.
type request struct {
	op     *Op
	opts   Options
	ctx    context.Context
	cancel context.CancelFunc

	undispatched int           // slices not yet started; guarded by the peer's mu
	quota        map[*rail]int // slices planned per rail (spray mode); guarded by the peer's mu

	mu struct {
		sync.Mutex
		left int   // slices not yet finished
		err  error // first fatal error
	}
	done chan struct{}
}

type slice struct {
	req      *request
	span     span
	rail     *rail // bound rail (round-robin mode: when cut)
	attempts int
	tried    map[*rail]bool
	enqueued time.Time
}

func (e *Engine) newPeer(tr Transport, target Target) *peer {
	p := &peer{e: e, tr: tr, endpoint: target.Endpoint, mode: sprayScore}
	if e.cfg.RoundRobin {
		p.mode = sprayRoundRobin
	}
	p.sliceBase = sliceBase
	if ss, ok := tr.(SliceSizer); ok && ss.SliceBase() > 0 {
		p.sliceBase = ss.SliceBase()
	}
	for _, addr := range target.Rails() {
		p.rails = append(p.rails, newRail(addr, e.cfg.RailBandwidth))
	}
	p.sp = newSprayer(p.mode, p.rails)
	p.mu.busy = map[*rail]int{}
	p.mu.lowBusy = map[*rail]int{}
	p.mu.shared = &qosQueue[*slice]{}
	p.mu.byRail = map[*rail]*qosQueue[*slice]{}
	for _, r := range p.rails {
		p.mu.byRail[r] = &qosQueue[*slice]{}
	}
	p.mu.caps = newTenantCaps(e.cfg.TenantInflight)
	return p
}

// peer returns the scheduler of target's endpoint over transport tr.
func (e *Engine) peer(tr Transport, target Target) *peer {
	key := peerKey{tr, target.Endpoint}
	e.peersMu.Lock()
	defer e.peersMu.Unlock()
	p := e.peers[key]
	if p == nil {
		p = e.newPeer(tr, target)
		e.peers[key] = p
	}
	return p
}

type peerKey struct {
	tr       Transport
	endpoint string
}

// do runs op over the peer's rails and returns when every slice is done.
func (p *peer) do(ctx context.Context, op *Op, opts Options) error {
	now := time.Now()
	if p.estimate(1) < 0 {
		return fmt.Errorf("%w: every rail to %s is paused after errors", ErrUnavailable, op.Target.Endpoint)
	}
	if !opts.Deadline.IsZero() {
		if est := p.estimate(int64(len(op.Buf))); now.Add(est).After(opts.Deadline) {
			return fmt.Errorf("%w: %d bytes need about %v over %d rails, past the deadline", ErrTimedOut, len(op.Buf), est.Round(time.Microsecond), len(p.rails))
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	spans := cutSlicesFrom(len(op.Buf), p.sliceBase)
	req := &request{op: op, opts: opts, ctx: ctx, cancel: cancel, done: make(chan struct{})}
	req.mu.left = len(spans)
	req.undispatched = len(spans)
	p.mu.Lock()
	if p.mode == sprayScore && len(spans) > 1 {
		// Split the request over the rails in proportion to 1/score, so its
		// slices tend to finish together; dispatch may still deviate when a
		// planned rail is busy or fails.
		if counts := p.sp.plan(spans, now); counts != nil {
			req.quota = map[*rail]int{}
			for i, n := range counts {
				req.quota[p.rails[i]] = n
			}
		}
	}
	for _, s := range spans {
		sl := &slice{req: req, span: s, enqueued: now}
		if p.mode == sprayRoundRobin {
			sl.rail = p.rails[p.mu.rr%len(p.rails)]
			p.mu.rr++
		}
		p.enqueueLocked(sl, now)
	}
	p.dispatchLocked(now)
	p.mu.Unlock()
	select {
	case <-req.done:
	case <-ctx.Done():
		// Running slices see the canceled context; queued ones end now.
		p.mu.Lock()
		for _, q := range append([]*qosQueue[*slice]{p.mu.shared}, values(p.mu.byRail)...) {
			for _, sl := range q.remove(func(sl *slice) bool { return sl.req == req }) {
				p.finishSlice(sl, ctx.Err())
			}
		}
		p.mu.Unlock()
		<-req.done
	}
	req.mu.Lock()
	defer req.mu.Unlock()
	p.e.met.request(normClass(opts.Priority), req.mu.err)
	return req.mu.err
}

// estimate predicts how long n bytes take over the available rails; -1
// when none is available.
func (p *peer) estimate(n int64) time.Duration {
	var bw float64
	now := time.Now()
	for _, r := range p.rails {
		if r.available(now) {
			bw += r.stats(now).ewma
		}
	}
	if bw <= 0 {
		return -1
	}
	return time.Duration(float64(n) / bw * float64(time.Second))
}

func (p *peer) enqueueLocked(sl *slice, now time.Time) {
	if normClass(sl.req.opts.Priority) != Low {
		p.mu.urgent = now
	}
	q := p.mu.shared
	if sl.rail != nil {
		q = p.mu.byRail[sl.rail]
	}
	q.push(sl, sl.req.opts.Priority, int64(sl.span.n), sl.req.opts.Tenant, time.Time{}, sl.enqueued)
}

// dispatchLocked starts queued slices while rails have free slots.
func (p *peer) dispatchLocked(now time.Time) {
	slots := p.e.cfg.ConnsPerPeer
	// While higher classes are active, Low slices may hold only one slot
	// per rail: what Low has in flight on a rail is what a High slice waits
	// behind on the link, whatever the queue order.
	lowCapped := now.Sub(p.mu.urgent) < lowYield
	lowRoom := func() bool {
		if !lowCapped {
			return true
		}
		for _, r := range p.rails {
			if p.mu.lowBusy[r] < 1 && p.mu.busy[r] < slots && r.available(now) {
				return true
			}
		}
		return false
	}
	canStart := func(class Priority, tenant string, n int64) bool {
		if class == Low && !lowRoom() {
			return false
		}
		return p.mu.caps.canStart(tenant, n)
	}
	if p.mode == sprayRoundRobin {
		// Rebind the queues of paused rails first: a slice moved to a rail
		// whose turn had already passed would otherwise wait there for the
		// next dispatch, which never comes when nothing is in flight.
		for _, r := range p.rails {
			if !r.available(now) {
				p.rebindLocked(r, now)
			}
		}
		for _, r := range p.rails {
			if !r.available(now) {
				continue
			}
			// A slice here can only go to r, so the Low cap is r's own.
			onR := func(class Priority, tenant string, n int64) bool {
				if class == Low && lowCapped && p.mu.lowBusy[r] >= 1 {
					return false
				}
				return p.mu.caps.canStart(tenant, n)
			}
			for p.mu.busy[r] < slots {
				sl, ok := p.mu.byRail[r].pop(now, onR)
				if !ok {
					break
				}
				p.startLocked(sl, r, now)
			}
		}
		return
	}
	full := func(r *rail) bool { return p.mu.busy[r] >= slots }
	for p.mu.shared.len() > 0 {
		anyFree, anyUp := false, false
		for _, r := range p.rails {
			up := r.available(now)
			anyUp = anyUp || up
			anyFree = anyFree || (up && !full(r))
		}
		if !anyUp {
			// Every rail is paused: fail fast so the request can fall over
			// to another transport instead of waiting out the cooldown.
			for _, sl := range p.mu.shared.remove(func(*slice) bool { return true }) {
				p.finishSlice(sl, fmt.Errorf("%w: every rail to %s is paused after errors", ErrUnavailable, sl.req.op.Target.Endpoint))
			}
			return
		}
		if !anyFree {
			return
		}
		sl, ok := p.mu.shared.pop(now, canStart)
		if !ok {
			return
		}
		capped := func(*rail) bool { return false }
		if lowCapped && normClass(sl.req.opts.Priority) == Low {
			capped = func(r *rail) bool { return p.mu.lowBusy[r] >= 1 }
		}
		// A request's last slices go to the rail with the best predicted
		// finish even if they must wait for its slot: on a slower rail they
		// would be the request's stragglers. Earlier ones take the best
		// free rail, so no rail idles while work is queued.
		tail := sl.req.undispatched <= len(p.rails)
		overPlan := func(r *rail) bool { return sl.req.quota != nil && sl.req.quota[r] <= 0 && !tail }
		skip := func(r *rail) bool {
			return capped(r) || (!tail && full(r)) || (sl.tried[r] && len(sl.tried) < len(p.rails)) || overPlan(r)
		}
		r := p.sp.pick(sl.span.n, now, skip)
		if r == nil {
			r = p.sp.pick(sl.span.n, now, func(r *rail) bool { return capped(r) || (!tail && full(r)) }) // every rail was tried
		}
		if r == nil || full(r) {
			p.mu.shared.pushFront(sl, sl.req.opts.Priority, int64(sl.span.n), sl.req.opts.Tenant, sl.enqueued)
			return
		}
		p.startLocked(sl, r, now)
	}
}

func (p *peer) startLocked(sl *slice, r *rail, now time.Time) {
	if sl.req.ctx.Err() != nil {
		p.finishSlice(sl, sl.req.ctx.Err())
		return
	}
	p.mu.busy[r]++
	sl.req.undispatched--
	if sl.req.quota != nil {
		sl.req.quota[r]--
	}
	if normClass(sl.req.opts.Priority) == Low {
		p.mu.lowBusy[r]++
	}
	p.mu.caps.start(sl.req.opts.Tenant, int64(sl.span.n))
	p.sp.begin(r, sl.span.n)
	p.e.wg.Add(1)
	go p.run(sl, r, time.Now())
}

// run moves one slice over rail r; service time is measured from here, the
// dispatch, not from when the slice was queued.
func (p *peer) run(sl *slice, r *rail, dispatched time.Time) {
	defer p.e.wg.Done()
	op := *sl.req.op
	op.Offset += int64(sl.span.off)
	op.Buf = op.Buf[sl.span.off : sl.span.off+sl.span.n : sl.span.off+sl.span.n]
	op.Rail = r.addr
	err := p.tr.Do(sl.req.ctx, &op)
	now := time.Now()
	p.e.met.slice(normClass(sl.req.opts.Priority), sl.span.n, dispatched.Sub(sl.enqueued), now.Sub(dispatched), err == nil)

	p.mu.Lock()
	defer p.mu.Unlock()
	p.mu.busy[r]--
	if normClass(sl.req.opts.Priority) == Low {
		p.mu.lowBusy[r]--
	}
	p.mu.caps.done(sl.req.opts.Tenant, int64(sl.span.n))
	railErr := err != nil && sl.req.ctx.Err() == nil && railFault(err)
	p.sp.end(r, sl.span.n, now.Sub(dispatched), err, now)
	if railErr && sl.attempts+1 < maxSliceAttempts {
		sl.attempts++
		if sl.tried == nil {
			sl.tried = map[*rail]bool{}
		}
		sl.tried[r] = true
		if p.mode == sprayRoundRobin {
			sl.rail = p.nextRailLocked(r, now)
		}
		p.e.met.retry()
		p.enqueueLocked(sl, now)
	} else {
		p.finishSlice(sl, err)
	}
	p.dispatchLocked(now)
}

// rebindLocked moves the slices queued on a paused rail to the next rails,
// or fails them when no rail is up.
func (p *peer) rebindLocked(r *rail, now time.Time) {
	for _, sl := range p.mu.byRail[r].remove(func(*slice) bool { return true }) {
		next := p.nextRailLocked(r, now)
		if next == r {
			p.finishSlice(sl, fmt.Errorf("%w: every rail to %s is paused after errors", ErrUnavailable, sl.req.op.Target.Endpoint))
			continue
		}
		sl.rail = next
		p.enqueueLocked(sl, now)
	}
}

// nextRailLocked is round-robin's choice for a retry: the next available rail.
func (p *peer) nextRailLocked(after *rail, now time.Time) *rail {
	for i, r := range p.rails {
		if r != after {
			continue
		}
		for j := 1; j <= len(p.rails); j++ {
			if c := p.rails[(i+j)%len(p.rails)]; c.available(now) {
				return c
			}
		}
	}
	return after
}

// finishSlice records a slice's outcome; the request ends with its last
// slice or its first fatal error.
func (p *peer) finishSlice(sl *slice, err error) {
	req := sl.req
	req.mu.Lock()
	defer req.mu.Unlock()
	if err != nil && req.mu.err == nil {
		req.mu.err = err
		req.cancel()
	}
	req.mu.left--
	if req.mu.left == 0 {
		close(req.done)
	}
}

func values[K comparable, V any](m map[K]V) []V {
	out := make([]V, 0, len(m))
	for _, v := range m {
		out = append(out, v)
	}
	return out
}

// RailInfo describes one rail to one peer, as the engine sees it.
type RailInfo struct {
	Peer          string  // the target's endpoint
	Addr          string  // this rail's address
	InflightBytes int64   // bytes of slices on the rail now
	Bandwidth     float64 // EWMA of observed bytes per second
	Errors        int64   // errors since the engine started
	State         string  // up, probing (cooldown over, on trial) or paused
}

// Rails describes every rail the engine has used, by peer and address.
func (e *Engine) Rails() []RailInfo {
	e.peersMu.Lock()
	peers := values(e.peers)
	e.peersMu.Unlock()
	now := time.Now()
	var out []RailInfo
	for _, p := range peers {
		for _, r := range p.rails {
			st := r.stats(now)
			out = append(out, RailInfo{Peer: p.endpoint, Addr: st.addr, InflightBytes: st.inflight, Bandwidth: st.ewma, Errors: st.errors, State: st.state})
		}
	}
	slices.SortFunc(out, func(a, b RailInfo) int { return cmp.Or(cmp.Compare(a.Peer, b.Peer), cmp.Compare(a.Addr, b.Addr)) })
	return out
}

// normClass maps the zero Priority to Medium, as the QoS queue does.
func normClass(p Priority) Priority {
	if p == 0 {
		return Medium
	}
	return p
}
