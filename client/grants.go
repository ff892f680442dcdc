package client

import (
	"context"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// A grant is a put the leader placed ahead of need, for a key not known
// yet: the client's next put of the same shape writes there at once and
// publishes, skipping BatchPutStart. Grants are asked for with a PutEnd,
// only for shapes the client puts repeatedly (a one-off put would leave
// its grant unused, holding space until it expires).
type shape struct {
	size     uint64
	tier     pb.Tier
	replicas uint32
}

// An ask is n grants of a shape to ask for.
type ask struct {
	shape
	n int
}

type grant struct {
	id           uint64
	replicas     []*pb.Replica
	reservations []uint64  // where the leader placed each replica
	deadline     time.Time // the writes must end by then
}

// grantPool holds the grants of one client.
type grantPool struct {
	mu     sync.Mutex
	byShap map[shape][]grant
	last   map[shape]time.Time // when a put of the shape last ended
}

const (
	// maxPooled bounds the grants pooled per shape.
	maxPooled = 1024
	// grantMargin: a grant with less of its write time left is not used,
	// so a write never races its deadline.
	grantMargin = 0.5
	// streamGap: a shape put again within this counts as a stream, and
	// gets grants.
	streamGap = time.Second
	// maxShapes bounds the shapes pooled.
	maxShapes = 16
)

func newGrantPool() *grantPool {
	return &grantPool{byShap: map[shape][]grant{}, last: map[shape]time.Time{}}
}

// take pops a grant of sh that has enough write time left.
func (g *grantPool) take(sh shape, now time.Time, writeTimeout time.Duration) (grant, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	q := g.byShap[sh]
	for len(q) > 0 {
		gr := q[len(q)-1]
		q = q[:len(q)-1]
		if gr.deadline.Sub(now) > time.Duration(grantMargin*float64(writeTimeout)) {
			g.byShap[sh] = q
			return gr, true
		}
	}
	delete(g.byShap, sh)
	return grant{}, false
}

// want says how many grants of sh to ask for after n puts of it ended.
func (g *grantPool) want(sh shape, n int, now time.Time) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	prev, seen := g.last[sh]
	g.last[sh] = now
	if len(g.last) > maxShapes {
		for k, t := range g.last {
			if now.Sub(t) > streamGap {
				delete(g.last, k)
			}
		}
	}
	if (!seen || now.Sub(prev) > streamGap) && n < 2 {
		return 0 // not a stream (yet)
	}
	if _, ok := g.byShap[sh]; !ok && len(g.byShap) >= maxShapes {
		return 0
	}
	return max(0, min(n, maxPooled-len(g.byShap[sh])))
}

// addRun pools a run of grants the leader answered, asked at asked, up to
// maxPooled of a shape, and returns the put ids of those it did not pool.
func (g *grantPool) addRun(sh shape, run *pb.GrantRun, asked time.Time) (left []uint64) {
	if len(run.Replicas) == 0 || len(run.Reservations) != len(run.Replicas) {
		return runIDs(run)
	}
	deadline := asked.Add(time.Duration(run.WriteTimeoutMs) * time.Millisecond)
	g.mu.Lock()
	defer g.mu.Unlock()
	// The run's replicas in two allocations, not two a grant.
	nr := len(run.Replicas)
	reps := make([]pb.Replica, int(run.Count)*nr)
	ptrs := make([]*pb.Replica, len(reps))
	// Pooled last first: take pops from the end, so puts go in order.
	for i := int(run.Count) - 1; i >= 0; i-- {
		id := run.FirstPutId + uint64(i)
		if len(g.byShap[sh]) >= maxPooled {
			left = append(left, id)
			continue
		}
		for j, r := range run.Replicas {
			k := i*nr + j
			p := &reps[k]
			p.Segment, p.Node, p.Endpoint, p.Offset, p.Length, p.Tier, p.Ticket = r.Segment, r.Node, r.Endpoint, r.Offset+uint64(i)*run.Stride, r.Length, r.Tier, r.Ticket
			ptrs[k] = p
		}
		g.byShap[sh] = append(g.byShap[sh], grant{id: id, replicas: ptrs[i*nr : (i+1)*nr : (i+1)*nr], reservations: run.Reservations, deadline: deadline})
	}
	return left
}

// runIDs lists the put ids of a run.
func runIDs(run *pb.GrantRun) []uint64 {
	ids := make([]uint64, run.Count)
	for i := range ids {
		ids[i] = run.FirstPutId + uint64(i)
	}
	return ids
}

// drain empties the pool and returns the grants' put ids.
func (g *grantPool) drain() []uint64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	var ids []uint64
	for _, q := range g.byShap {
		for _, gr := range q {
			ids = append(ids, gr.id)
		}
	}
	clear(g.byShap)
	return ids
}

// dropOn takes the grants with a replica on any of segments out of the
// pool, and returns their put ids.
func (g *grantPool) dropOn(segments []string) []uint64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	var ids []uint64
	for sh, q := range g.byShap {
		g.byShap[sh] = slices.DeleteFunc(q, func(gr grant) bool {
			on := slices.ContainsFunc(gr.replicas, func(r *pb.Replica) bool { return slices.Contains(segments, r.Segment) })
			if on {
				ids = append(ids, gr.id)
			}
			return on
		})
	}
	return ids
}

// revokeGrants gives the pooled grants back, so their space is freed now
// rather than when they expire.
func (c *Client) revokeGrants() { c.revokeIDs(c.grants.drain()) }

// revokeIDs gives grants back by put id, in requests the master takes.
func (c *Client) revokeIDs(ids []uint64) {
	for len(ids) > 0 {
		n := min(len(ids), maxRevoke)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_ = c.master(ctx, func(m pb.MasterClient, o ...grpc.CallOption) error {
			_, err := m.PutRevoke(ctx, &pb.KeysRequest{Keys: make([]string, n), PutIds: ids[:n]}, o...)
			return err
		})
		cancel()
		ids = ids[n:]
	}
}

// maxRevoke is the most grants one PutRevoke gives back (the master's
// batch limit).
const maxRevoke = 16384
