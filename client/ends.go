package client

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// endQueue coalesces the PutEnds of concurrent puts: while one BatchPutEnd
// is in flight, those that come meanwhile wait and go together in the
// next, sent by the first of them. Concurrent puts so share round trips
// and the leader's raft entries, and a put alone waits for nothing (its
// PutEnd goes at once).
type endQueue struct {
	mu      sync.Mutex
	busy    bool // a BatchPutEnd is in flight, or its successor is picked
	waiting []*endCall
	// writing counts the puts placed and still writing their values:
	// each will call end soon, and a sender waits for them a little.
	writing   int
	arrived   chan struct{} // a writer came (or gave up); 1 buffered
	lingerFor time.Duration // endLinger but in tests
	lastCalls int           // in the last BatchPutEnd sent
}

// endCall is one BatchPutWith's PutEnd: its items (without replicas) and
// the grants it asks for.
type endCall struct {
	items    []*pb.PutEndItem
	grants   []ask
	deadline time.Time     // of the put's context; zero: none
	bytes    int           // about what its items weigh on the wire
	wrote    bool          // its put was counted in endQueue.writing
	turn     chan struct{} // closed when it is to send the next batch
	done     chan struct{} // closed when a batch with it has been answered
	// Set by the call's sender before done is closed.
	results  []*pb.ItemStatus
	unplaced []uint32 // indices into items
	holdMs   []uint32 // per item, or none (see BatchPutEndResponse.hold_ms)
	answered time.Time
	err      error
}

// holds are, per item of n, until when its writer waits before reporting
// it done; zero for none.
func (call *endCall) holds(n int) []time.Time {
	out := make([]time.Time, n)
	for j, ms := range call.holdMs {
		out[j] = holdUntil(call.answered, ms)
	}
	return out
}

// holdUntil is when a hold of ms from an answer at answered ends; zero for
// none.
func holdUntil(answered time.Time, ms uint32) time.Time {
	if ms == 0 {
		return time.Time{}
	}
	return answered.Add(time.Duration(ms) * time.Millisecond)
}

// holdsFit reports whether r's holds are one per result, or none.
func holdsFit(r *pb.BatchPutEndResponse) bool {
	return len(r.HoldMs) == 0 || len(r.HoldMs) == len(r.Results)
}

func newEndQueue() *endQueue {
	return &endQueue{arrived: make(chan struct{}, 1), lingerFor: endLinger}
}

// endLinger bounds how long a sender waits for puts still writing before
// it sends: about a log write of the leader's, which those puts would
// otherwise each need for themselves.
const endLinger = 200 * time.Microsecond

// startWrite counts a put that is about to write its values; its end, or
// stopWrite if it ends without one, uncounts it.
func (q *endQueue) startWrite() {
	q.mu.Lock()
	q.writing++
	q.mu.Unlock()
}

func (q *endQueue) stopWrite() {
	q.mu.Lock()
	q.stopWriteLocked()
	q.mu.Unlock()
}

func (q *endQueue) stopWriteLocked() {
	q.writing--
	select {
	case q.arrived <- struct{}{}:
	default:
	}
}

// linger waits, within lingerFor, until no put is writing or the next
// BatchPutEnd is full. q.mu is held.
func (q *endQueue) linger() {
	if q.writing == 0 || q.full() {
		return
	}
	t := time.NewTimer(q.lingerFor)
	defer t.Stop()
	for q.writing > 0 && !q.full() {
		q.mu.Unlock()
		select {
		case <-q.arrived:
			q.mu.Lock()
		case <-t.C:
			q.mu.Lock()
			return
		}
	}
}

// full reports whether the calls waiting fill a BatchPutEnd. q.mu is held.
func (q *endQueue) full() bool {
	n, bytes := 0, 0
	for _, w := range q.waiting {
		n, bytes = n+len(w.items), bytes+w.bytes
	}
	return n >= maxEndItems || bytes >= maxEndBytes
}

// A coalesced BatchPutEnd carries at most maxEndItems items (the master's
// batch limit) and about maxEndBytes (well within gRPC's 64 MiB message).
const (
	maxEndItems = 16384
	maxEndBytes = 32 << 20
)

// end publishes call's items, alone or with others' that wait, and pools
// the grants the leader answers. A call still waiting when its ctx ends
// leaves the queue with ctx's error; once a sender has it, it waits for
// that answer (bounded by the latest deadline of the batch).
func (c *Client) end(ctx context.Context, call *endCall) {
	call.deadline, _ = ctx.Deadline()
	call.turn, call.done = make(chan struct{}), make(chan struct{})
	for _, it := range call.items {
		call.bytes += len(it.Key) + len(it.Parent) + len(it.Tenant) + 48
	}
	q := c.ends
	q.mu.Lock()
	q.waiting = append(q.waiting, call)
	if call.wrote {
		q.stopWriteLocked()
	}
	if !q.busy {
		q.busy = true
		close(call.turn)
	}
	q.mu.Unlock()
	select {
	case <-call.turn:
	case <-call.done:
		return
	case <-ctx.Done():
		q.mu.Lock()
		if i := slices.Index(q.waiting, call); i >= 0 && !closed(call.turn) {
			q.waiting = slices.Delete(q.waiting, i, i+1)
			q.mu.Unlock()
			call.err = fmt.Errorf("%w: %w", ErrUnavailable, context.Cause(ctx))
			return
		}
		q.mu.Unlock()
		select { // a sender has it, or it was handed the turn meanwhile
		case <-call.turn:
		case <-call.done:
			return
		}
	}
	if closed(call.done) {
		return
	}
	// This call sends: it and those waiting behind it, within the bounds.
	q.mu.Lock()
	if q.lastCalls > 1 {
		// Puts whose end was just answered may be about to put again:
		// let the runnable ones start before counting who writes.
		q.mu.Unlock()
		runtime.Gosched()
		q.mu.Lock()
	}
	q.linger()
	var batch []*endCall
	n, bytes := 0, 0
	for len(q.waiting) > 0 {
		w := q.waiting[0]
		if len(batch) > 0 && (n+len(w.items) > maxEndItems || bytes+w.bytes > maxEndBytes) {
			break
		}
		batch = append(batch, w)
		n, bytes = n+len(w.items), bytes+w.bytes
		q.waiting = q.waiting[1:]
	}
	q.lastCalls = len(batch)
	q.mu.Unlock()
	c.sendEnds(ctx, batch)
	q.mu.Lock()
	for _, b := range batch {
		close(b.done)
	}
	if len(q.waiting) > 0 {
		close(q.waiting[0].turn) // the next batch is the first waiter's to send
	} else {
		q.busy = false
	}
	q.mu.Unlock()
}

func closed(ch chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// sendEnds sends one BatchPutEnd for the calls of batch and hands each its
// results. The round trip is bounded by the latest deadline among the
// batch's puts (the write timeout if one has none), not by the sender's
// cancellation: the others' puts ride in it.
func (c *Client) sendEnds(ctx context.Context, batch []*endCall) {
	var latest time.Time
	for _, call := range batch {
		if call.deadline.IsZero() {
			latest = time.Now().Add(c.writeTimeout())
			break
		}
		latest = later(latest, call.deadline)
	}
	ctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), latest)
	defer cancel()
	req := &pb.BatchPutEndRequest{SparseResults: true}
	var shapes []shape
	for _, call := range batch {
		req.Items = append(req.Items, call.items...)
		for _, a := range call.grants {
			req.GrantAsks = append(req.GrantAsks, &pb.GrantAsk{Size: a.size, Tier: a.tier, Replicas: a.replicas, Tenant: c.tenant, Count: uint32(a.n)})
			for range a.n {
				shapes = append(shapes, a.shape)
			}
		}
	}
	var resp *pb.BatchPutEndResponse
	var asked time.Time
	err := c.master(ctx, func(m pb.MasterClient, o ...grpc.CallOption) (err error) {
		asked = time.Now()
		resp, err = m.BatchPutEnd(ctx, req, o...)
		return err
	})
	answered := time.Now()
	if err == nil {
		err = unsparse(resp, len(req.Items))
	}
	if err == nil {
		// The runs answer a prefix of the grants asked for, in order.
		k := 0
		for _, run := range resp.Grants {
			if k >= len(shapes) || run.Count == 0 || k+int(run.Count) > len(shapes) {
				c.revokeIDs(runIDs(run))
				continue
			}
			c.revokeIDs(c.grants.addRun(shapes[k], run, asked))
			k += int(run.Count)
		}
	}
	unplaced := map[int]bool{}
	if err == nil {
		for _, j := range resp.Unplaced {
			unplaced[int(j)] = true
		}
	}
	base := 0
	for _, call := range batch {
		call.err = err
		if err == nil {
			call.results = resp.Results[base : base+len(call.items)]
			if len(resp.HoldMs) > 0 {
				call.holdMs, call.answered = resp.HoldMs[base:base+len(call.items)], answered
			}
			for j := range call.items {
				if unplaced[base+j] {
					call.unplaced = append(call.unplaced, uint32(j))
				}
			}
		}
		base += len(call.items)
	}
}

// unsparse turns a BatchPutEnd answer to n items into one result per
// item (nil: it succeeded), whichever form the master answered in (see
// BatchPutEndRequest.sparse_results), checking that it fits.
func unsparse(r *pb.BatchPutEndResponse, n int) error {
	if len(r.Failed) > 0 || len(r.Results) == 0 {
		full := make([]*pb.ItemStatus, n)
		for k, i := range r.Failed {
			if int(i) >= n || (k > 0 && i <= r.Failed[k-1]) || k >= len(r.Results) {
				return fmt.Errorf("%w: master answered failed items %v for %d puts", ErrProtocol, r.Failed, n)
			}
			full[i] = r.Results[k]
		}
		if len(r.Results) != len(r.Failed) {
			return fmt.Errorf("%w: master answered %d results for %d failed items", ErrProtocol, len(r.Results), len(r.Failed))
		}
		r.Results, r.Failed = full, nil
	}
	if len(r.Results) != n || !holdsFit(r) {
		return fmt.Errorf("%w: master answered %d results and %d holds for %d puts", ErrProtocol, len(r.Results), len(r.HoldMs), n)
	}
	return nil
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
