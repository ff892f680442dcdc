package client

import (
	"context"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// endQueue coalesces the PutEnds of concurrent puts: while one BatchPutEnd
// is in flight, those that come meanwhile wait and go together in the
// next. Concurrent puts so share round trips and the leader's raft
// entries, and a put alone waits for nothing (its PutEnd goes at once).
type endQueue struct {
	mu      sync.Mutex
	cond    *sync.Cond
	busy    bool
	waiting []*endCall
}

// endCall is one BatchPutWith's PutEnd: its items (without replicas) and
// the grants it asks for.
type endCall struct {
	items  []*pb.PutEndItem
	grants []shape
	// Set by the call's sender before done; done is set under endQueue.mu.
	results  []*pb.ItemStatus
	unplaced []uint32 // indices into items
	err      error
	done     bool
}

func newEndQueue() *endQueue {
	q := &endQueue{}
	q.cond = sync.NewCond(&q.mu)
	return q
}

// maxEndItems bounds the items of one coalesced BatchPutEnd (the master's
// batch limit).
const maxEndItems = 16384

// end publishes call's items, alone or with others' that wait, and pools
// the grants the leader answers.
func (c *Client) end(ctx context.Context, call *endCall) {
	q := c.ends
	q.mu.Lock()
	q.waiting = append(q.waiting, call)
	for !call.done {
		if q.busy {
			q.cond.Wait()
			continue
		}
		q.busy = true
		var batch []*endCall
		n := 0
		for len(q.waiting) > 0 && (len(batch) == 0 || n+len(q.waiting[0].items) <= maxEndItems) {
			batch = append(batch, q.waiting[0])
			n += len(q.waiting[0].items)
			q.waiting = q.waiting[1:]
		}
		q.mu.Unlock()
		c.sendEnds(ctx, batch)
		q.mu.Lock()
		for _, b := range batch {
			b.done = true // under mu: the waiters read it there
		}
		q.busy = false
		q.cond.Broadcast()
	}
	q.mu.Unlock()
}

// sendEnds sends one BatchPutEnd for the calls of batch and hands each its
// results. The round trip is bounded by the sender's deadline but not its
// cancellation: the others' puts ride in it.
func (c *Client) sendEnds(ctx context.Context, batch []*endCall) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.writeTimeout())
	defer cancel()
	req := &pb.BatchPutEndRequest{}
	var shapes []shape
	for _, call := range batch {
		req.Items = append(req.Items, call.items...)
		for _, sh := range call.grants {
			req.Grants = append(req.Grants, &pb.PutStartRequest{Size: sh.size, Tier: sh.tier, Replicas: sh.replicas, Tenant: c.tenant})
			shapes = append(shapes, sh)
		}
	}
	var resp *pb.BatchPutEndResponse
	var asked time.Time
	err := c.master(ctx, func(m pb.MasterClient, o ...grpc.CallOption) (err error) {
		asked = time.Now()
		resp, err = m.BatchPutEnd(ctx, req, o...)
		return err
	})
	if err == nil && len(resp.Results) != len(req.Items) {
		err = fmt.Errorf("%w: master answered %d results for %d puts", ErrProtocol, len(resp.Results), len(req.Items))
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
			for j := range call.items {
				if unplaced[base+j] {
					call.unplaced = append(call.unplaced, uint32(j))
				}
			}
		}
		base += len(call.items)
	}
}
