package client

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"hash/maphash"
	"log/slog"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"

	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Config configures a Client.
type Config struct {
	// Masters are the gRPC addresses of the masters, any of them.
	Masters []string
	// Credentials are what the client shows the masters (its token or
	// certificate); EngineConfig.PeerTLS, what it expects of stores.
	Credentials leaderconn.Credentials
	// Engine moves the bytes; nil creates one from EngineConfig that Close
	// closes.
	Engine       *engine.Engine
	EngineConfig engine.Config
	// Replicas is how many copies a put asks for, on distinct store nodes
	// (best effort); 0 means 1.
	Replicas int
	// Tier is the tier puts prefer: "dram" (default), "hbm" or "ssd".
	Tier string
	// Tenant is recorded with every put, so an operator can evict one
	// tenant's objects (admin evict --tenant); may be empty.
	Tenant string
	// LookupCache is how many block descriptors Lookup keeps while their
	// leases last; 0 means 65536, negative none.
	LookupCache int
	// SharedBuffers says others may write the buffers gets read into (the
	// agent's regions, mapped by local processes): a checksum failure there
	// says nothing about the replica, so it is not reported to the master
	// (which would drop it). The get still fails over to other replicas.
	SharedBuffers bool
	Logger        *slog.Logger
}

// Client talks to one Tidepool cluster. It is safe for concurrent use.
type Client struct {
	replicas  uint32
	tier      pb.Tier
	tenant    string
	masters   *leaderconn.Conn
	eng       *engine.Engine
	ownEngine bool
	log       *slog.Logger
	descs     *descCache   // nil: no lookup cache
	removed   *removals    // this client's removals, against descs
	cached    *cacheMarks  // the keys ever handed to descs
	born      time.Time    // when New made it: its cached blocks' time origin
	shared    bool         // Config.SharedBuffers
	lease     atomic.Int64 // the master's lease TTL in ns, as last answered
	// listedKeys: the master did not read a lookup's packed keys (it
	// predates them), so lookups list them.
	listedKeys atomic.Bool
	lookupReqs sync.Pool // of *pb.LookupRequest, for their packed buffers
	// putTimeout is the master's put timeout in ns, as last answered.
	putTimeout atomic.Int64
	grants     *grantPool
	ends       *endQueue
}

// New returns a client of the cluster; it connects lazily.
func New(cfg Config) (*Client, error) {
	masters, err := leaderconn.Dial(cfg.Masters, cfg.Credentials)
	if err != nil {
		return nil, fmt.Errorf("client: %w", err)
	}
	tier := pb.Tier_TIER_DRAM
	if cfg.Tier != "" {
		t, ok := pb.ParseTier(cfg.Tier)
		if !ok {
			masters.Close()
			return nil, fmt.Errorf("client: %w: tier %q (want dram, hbm or ssd)", ErrInvalidArgument, cfg.Tier)
		}
		tier = t
	}
	if cfg.Replicas < 0 {
		masters.Close()
		return nil, fmt.Errorf("client: %w: %d replicas", ErrInvalidArgument, cfg.Replicas)
	}
	c := &Client{masters: masters, eng: cfg.Engine, log: cfg.Logger, replicas: uint32(cfg.Replicas), tier: tier, tenant: cfg.Tenant, shared: cfg.SharedBuffers, born: time.Now()}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	c.lease.Store(int64(10 * time.Second))
	c.putTimeout.Store(int64(30 * time.Second))
	c.grants = newGrantPool()
	c.removed = newRemovals()
	c.cached = &cacheMarks{seed: maphash.MakeSeed()}
	c.ends = newEndQueue()
	if cfg.LookupCache >= 0 {
		n := cfg.LookupCache
		if n == 0 {
			n = 1 << 16
		}
		if c.descs, err = newDescCache(n); err != nil {
			masters.Close()
			return nil, fmt.Errorf("client: lookup cache: %w", err)
		}
	}
	if c.eng == nil {
		ecfg := cfg.EngineConfig
		if ecfg.Logger == nil {
			ecfg.Logger = c.log
		}
		c.eng, c.ownEngine = engine.New(ecfg), true
	}
	return c, nil
}

// Close releases the connections.
func (c *Client) Close() error {
	c.revokeGrants()
	var errs []error
	if c.ownEngine {
		errs = append(errs, c.eng.Close())
	}
	errs = append(errs, c.masters.Close())
	c.descs.Close()
	return errors.Join(errs...)
}

// Engine is the client's transfer engine.
func (c *Client) Engine() *engine.Engine { return c.eng }

func (c *Client) leaseTTL() time.Duration     { return time.Duration(c.lease.Load()) }
func (c *Client) setLeaseTTL(d time.Duration) { c.lease.Store(int64(d)) }

func (c *Client) master(ctx context.Context, fn func(pb.MasterClient, ...grpc.CallOption) error) error {
	return rpcError(c.masters.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) error {
		return fn(pb.NewMasterClient(cc), opts...)
	}))
}

// masterOnce is master for a call that must not take effect twice (see
// leaderconn.Conn.DoOnce).
func (c *Client) masterOnce(ctx context.Context, fn func(pb.MasterClient, ...grpc.CallOption) error) error {
	return rpcError(c.masters.DoOnce(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) error {
		return fn(pb.NewMasterClient(cc), opts...)
	}))
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Checksum is the CRC-32C that Tidepool stores with every value.
func Checksum(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// forEach calls fn(0), ..., fn(n-1) on up to GOMAXPROCS goroutines and
// returns when all have returned: for CPU-bound work on independent values
// (checksums) that would otherwise use one core of several.
func forEach(n int, fn func(int)) {
	w := min(runtime.GOMAXPROCS(0), n)
	if w <= 1 {
		for i := range n {
			fn(i)
		}
		return
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	for range w {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < n; i = int(next.Add(1) - 1) {
				fn(i)
			}
		})
	}
	wg.Wait()
}

// Put stores value under key. A key that is already complete is left as it
// is and Put succeeds: objects are immutable.
func (c *Client) Put(ctx context.Context, key string, value []byte) error {
	return c.BatchPut(ctx, []string{key}, [][]byte{value})[0]
}

// BatchPut stores values[i] under keys[i] with one master round trip per
// phase, and returns one error per key.
func (c *Client) BatchPut(ctx context.Context, keys []string, values [][]byte) []error {
	return c.BatchPutWith(ctx, keys, values, PutOptions{})
}

// BatchPutChain stores the blocks of a prefix chain: keys[0] continues
// parent (empty: the chain's first block) and keys[i] continues keys[i-1].
// The master records the links, so eviction takes a chain's leaves before
// the blocks they continue.
func (c *Client) BatchPutChain(ctx context.Context, parent string, keys []string, values [][]byte) []error {
	return c.BatchPutWith(ctx, keys, values, PutOptions{Chain: true, Parent: parent})
}

// PutOptions shape one batch put.
type PutOptions struct {
	// Chain links the keys as BatchPutChain does, continuing Parent.
	Chain  bool
	Parent string
	// Replicas overrides Config.Replicas when positive.
	Replicas int
}

// inlineChecksum is the most bytes of a put a caller sums itself before
// writing; more are summed beside the writes.
const inlineChecksum = 256 << 10

// BatchPutWith is BatchPut with options.
func (c *Client) BatchPutWith(ctx context.Context, keys []string, values [][]byte, o PutOptions) []error {
	replicas := c.replicas
	if o.Replicas > 0 {
		replicas = uint32(min(o.Replicas, maxReplicas))
	}
	if len(keys) != len(values) {
		errs := make([]error, len(keys))
		for i := range errs {
			errs[i] = fmt.Errorf("%w: %d keys but %d values", ErrInvalidArgument, len(keys), len(values))
		}
		return errs
	}
	parents := make([]string, len(keys))
	if o.Chain {
		for i := range keys {
			parents[i] = o.Parent
			if i > 0 {
				parents[i] = keys[i-1]
			}
		}
	}
	errs, lost := c.putBatch(ctx, keys, values, parents, replicas, true)
	if len(lost) == 0 || ctx.Err() != nil {
		return errs
	}
	// Some stores could not be reached: until their heartbeats stop and
	// the master declares them dead, placement would keep sending puts
	// there. Tell it, and place those puts once more, elsewhere.
	c.reportUnreachable(ctx, lost)
	var idx []int
	for i := range keys {
		if _, ok := lost[i]; ok {
			idx = append(idx, i)
		}
	}
	sub := func(all []string) []string {
		out := make([]string, len(idx))
		for j, i := range idx {
			out[j] = all[i]
		}
		return out
	}
	vals := make([][]byte, len(idx))
	for j, i := range idx {
		vals[j] = values[i]
	}
	again, _ := c.putBatch(ctx, sub(keys), vals, sub(parents), replicas, false)
	for j, i := range idx {
		errs[i] = again[j]
	}
	return errs
}

// putBatch puts values[i] under keys[i] with parents[i], using pooled
// grants if grants. It reports, for each put whose write found its store
// unreachable, the segments it could not write to; that put is revoked.
func (c *Client) putBatch(ctx context.Context, keys []string, values [][]byte, parents []string, replicas uint32, grants bool) ([]error, map[int][]string) {
	errs := make([]error, len(keys))
	var held holding
	defer held.wait(ctx, keys, errs)
	// Per put, by its index in keys: a batch's requests and grants in one
	// allocation each rather than one per put.
	reqs := make([]pb.PutStartRequest, len(keys))
	items := make([]*pb.PutStartRequest, len(keys))
	idx := make([]int, 0, len(keys))
	for i, k := range keys {
		errs[i] = validKey(k)
		if errs[i] == nil && len(values[i]) == 0 {
			errs[i] = fmt.Errorf("%w: zero-length value for %q", ErrInvalidArgument, k)
		}
		if errs[i] == nil {
			r := &reqs[i]
			r.Key, r.Size, r.Tier, r.Replicas, r.Parent, r.Tenant = k, uint64(len(values[i])), c.tier, replicas, parents[i], c.tenant
			items[i] = r
			idx = append(idx, i)
		}
	}
	if len(idx) == 0 {
		return errs, nil
	}
	// The checksums are computed while the values are on the wire: only
	// BatchPutEnd needs them, and BatchPutStart, which waits for them.
	// Small values are summed here first (a 64 KiB value takes 5 us, less
	// than starting and waking a goroutine for it).
	sums := make([]uint32, len(keys))
	summed := make(chan struct{})
	total := 0
	for _, i := range idx {
		total += len(values[i])
	}
	if total <= inlineChecksum {
		for _, i := range idx {
			sums[i] = Checksum(values[i])
		}
		close(summed)
	} else {
		go func() {
			defer close(summed)
			forEach(len(idx), func(j int) { sums[idx[j]] = Checksum(values[idx[j]]) })
		}()
	}
	defer func() { <-summed }()
	var haveSums bool
	checksums := func() {
		if haveSums {
			return
		}
		<-summed
		for _, i := range idx {
			items[i].Checksum = sums[i]
		}
		haveSums = true
	}

	// Where each put writes: a grant of its shape, or what BatchPutStart
	// answers for the rest.
	placed := make([]grant, len(keys)) // a placed put's replicas are not empty
	nplaced := 0
	start := &pb.BatchPutStartRequest{}
	var startIdx []int
	now := time.Now()
	for _, i := range idx {
		if grants {
			if g, ok := c.grants.take(shapeOf(items[i]), now, c.writeTimeout()); ok {
				placed[i] = g
				nplaced++
				continue
			}
		}
		start.Items = append(start.Items, items[i])
		startIdx = append(startIdx, i)
	}
	if len(start.Items) > 0 {
		checksums()
		var resp *pb.BatchPutStartResponse
		var asked time.Time
		err := c.master(ctx, func(m pb.MasterClient, o ...grpc.CallOption) (err error) {
			asked = time.Now()
			resp, err = m.BatchPutStart(ctx, start, o...)
			return err
		})
		answered := time.Now()
		if err == nil && len(resp.Results) != len(startIdx) {
			err = fmt.Errorf("%w: master answered %d results for %d puts", ErrProtocol, len(resp.Results), len(startIdx))
		}
		if err != nil {
			for _, i := range startIdx {
				errs[i] = err
			}
		} else {
			for j, r := range resp.Results {
				i := startIdx[j]
				if errs[i] = itemError(r.Status); errs[i] != nil || r.Exists {
					if r.Exists {
						held.add(i, holdUntil(answered, r.HoldMs))
					}
					continue
				}
				if len(r.Replicas) == 0 {
					errs[i] = fmt.Errorf("%w: master placed %q nowhere", ErrProtocol, keys[i])
					continue
				}
				// The writes must end before the master may reuse the space,
				// measured conservatively from before we asked.
				c.setWriteTimeout(time.Duration(r.WriteTimeoutMs) * time.Millisecond)
				placed[i] = grant{id: r.PutId, replicas: r.Replicas, reservations: r.Reservations, deadline: asked.Add(time.Duration(r.WriteTimeoutMs) * time.Millisecond)}
				nplaced++
			}
		}
	}

	// A placed put publishes a new incarnation of its key: what the cache
	// holds for the key is an older one, which another client removed.
	// Dropped once the master has answered, whatever it answered (a put
	// that failed may still have been published). Not stamped as a removal
	// is (see removals): a stamp outdates the other keys of its stripes
	// too, and puts are many. So a lookup in flight since before the other
	// client's removal may still cache the old one: the master orders the
	// two clients, by holding the put (see holding) until that lookup's lease
	// has ended.
	if nplaced == 0 {
		return errs, nil
	}
	if c.descs != nil {
		defer func() {
			for i := range placed {
				// Whether or not the cache holds the key now: a lookup's
				// Set of it may still be queued in the cache's buffer,
				// and only a Del queued behind it drops what it stores.
				// Most puts follow a lookup that missed, which cached
				// nothing.
				if len(placed[i].replicas) > 0 && c.cached.marked(keys[i]) {
					c.descs.Del(keys[i])
				}
			}
		}()
	}

	// Write every replica of every placed put in one engine batch.
	c.ends.startWrite()
	counted := true
	defer func() {
		if counted {
			c.ends.stopWrite()
		}
	}()
	batch := c.eng.NewBatch()
	nreps := 0
	for _, g := range placed {
		nreps += len(g.replicas)
	}
	tasks := make([][]*engine.Task, len(keys)) // each a window of all
	all := make([]*engine.Task, 0, nreps)
	var ticket string // the last one: a run's puts share theirs
	for i, g := range placed {
		opts := engine.Options{Priority: engine.Medium, Deadline: g.deadline}
		from := len(all)
		for _, rep := range g.replicas {
			if string(rep.Ticket) != ticket {
				ticket = string(rep.Ticket)
			}
			t := engine.Target{Endpoint: rep.Endpoint, Segment: rep.Segment, Ticket: ticket}
			all = append(all, batch.Write(values[i], t, int64(rep.Offset), opts))
		}
		tasks[i] = all[from:len(all):len(all)]
	}
	// Run returns once every task is terminal (ctx cancels them), so no
	// bytes land after we revoke or read the buffer.
	_ = batch.Run(ctx)
	checksums()
	var revoked puts
	var lost map[int][]string
	// The items go without their replicas, which the leader that placed
	// them knows; another leader (after a failover) asks for them, and
	// only then are the full items built (see endUnplaced).
	ends := make([]pb.PutEndItem, 0, nplaced)
	endIdx := make([]int, 0, nplaced)
	shapes := map[shape]int{}
	for _, i := range idx { // in the caller's order: a chain's blocks parent first
		ts := tasks[i]
		if len(ts) == 0 {
			continue
		}
		for j, t := range ts {
			err := t.Err()
			if errors.Is(err, engine.ErrUnavailable) {
				if lost == nil {
					lost = map[int][]string{}
				}
				lost[i] = append(lost[i], placed[i].replicas[j].Segment)
			}
			if err != nil && errs[i] == nil {
				errs[i] = fmt.Errorf("%w: write %q: %w", ErrUnavailable, keys[i], err)
			} else if t.State() != engine.Done && errs[i] == nil {
				errs[i] = fmt.Errorf("%w: write %q did not finish (%s)", ErrUnavailable, keys[i], t.State())
			}
		}
		if errs[i] != nil {
			revoked.add(keys[i], placed[i].id)
			continue
		}
		it := items[i]
		ends = append(ends, pb.PutEndItem{
			Key: it.Key, PutId: placed[i].id, Size: it.Size, Checksum: it.Checksum, Parent: it.Parent, Tenant: it.Tenant,
		})
		endIdx = append(endIdx, i)
		shapes[shapeOf(it)]++
	}
	if len(revoked.keys) > 0 {
		// Its writes are over: no sender waits for this put while it
		// revokes (a round trip); what it has left to end goes later.
		c.ends.stopWrite()
		counted = false
		c.revoke(revoked.request())
	}
	if len(ends) == 0 {
		return errs, lost
	}
	// Ask for grants for the next puts of a shape put repeatedly.
	call := &endCall{items: make([]*pb.PutEndItem, len(ends))}
	for sh, n := range shapes {
		if n := c.grants.want(sh, n, now); n > 0 {
			call.grants = append(call.grants, ask{sh, n})
		}
	}
	for j := range ends {
		call.items[j] = &ends[j]
	}
	call.wrote, counted = counted, false
	c.end(ctx, call)
	if call.err != nil {
		var r puts
		for _, it := range call.items {
			r.add(it.Key, it.PutId)
		}
		c.revoke(r.request())
		for _, i := range endIdx {
			errs[i] = call.err
		}
		return errs, lost
	}
	resp := &pb.BatchPutEndResponse{Results: call.results, Unplaced: call.unplaced}
	holds := call.holds(len(ends))
	// All of where a put was placed, so a new leader can publish a put
	// the old one placed.
	full := func(j int) *pb.PutEndItem {
		i, s := endIdx[j], &ends[j]
		return &pb.PutEndItem{
			Key: s.Key, PutId: s.PutId, Size: s.Size, Checksum: s.Checksum, Parent: s.Parent, Tenant: s.Tenant,
			Replicas: placed[i].replicas, Reservations: placed[i].reservations, ReplicasWanted: items[i].Replicas,
		}
	}
	failed := c.endUnplaced(ctx, len(ends), full, resp, holds)
	for j, i := range endIdx {
		if errs[i] = failed[uint32(j)]; errs[i] == nil {
			errs[i] = itemError(resp.Results[j])
		}
		held.add(i, holds[j])
	}
	return errs, lost
}

// reportUnreachable tells the leader of the segments some puts could not
// write to, and gives back the pooled grants that point there. A failed
// report costs only that placement may choose those stores again.
func (c *Client) reportUnreachable(ctx context.Context, lost map[int][]string) {
	var segs []string
	for _, s := range lost {
		for _, id := range s {
			if !slices.Contains(segs, id) {
				segs = append(segs, id)
			}
		}
	}
	c.revokeIDs(c.grants.dropOn(segs))
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	err := c.master(ctx, func(m pb.MasterClient, o ...grpc.CallOption) error {
		_, err := m.ReportUnreachable(ctx, &pb.UnreachableReport{Segments: segs}, o...)
		return err
	})
	c.log.Warn("could not reach stores to write puts; placing them elsewhere", "segments", segs, "report_err", err)
}

// holding collects the puts of a batch the master holds: a key removed
// while a lookup leased it (see BatchPutEndResponse.hold_ms). Such a put
// is reported done only once its hold is over, and then no lookup that
// starts later answers the removed incarnation from a cache.
type holding struct {
	puts  []int // indices of the batch's keys
	until time.Time
}

// add holds put i until the given time (none if zero).
func (h *holding) add(i int, until time.Time) {
	if !until.IsZero() {
		h.puts, h.until = append(h.puts, i), later(h.until, until)
	}
}

// wait waits for the holds to end, or ctx: then each held put that ended
// well fails instead (it is published, but not yet ordered before later
// lookups).
func (h *holding) wait(ctx context.Context, keys []string, errs []error) {
	d := time.Until(h.until)
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return
	case <-ctx.Done():
	}
	for _, i := range h.puts {
		if errs[i] == nil {
			errs[i] = fmt.Errorf("%w: %q is put, but lookup caches may answer an incarnation removed before until %v: %w",
				ErrUnavailable, keys[i], h.until.Format(time.RFC3339Nano), context.Cause(ctx))
		}
	}
}

// endUnplaced sends again, with their replicas (full(j) is item j of the
// n sent, in full), the items the leader answered as not placed by it,
// and puts their results in resp. If that fails it returns the error of
// each (they are revoked); the others keep their results.
func (c *Client) endUnplaced(ctx context.Context, n int, full func(int) *pb.PutEndItem, resp *pb.BatchPutEndResponse, holds []time.Time) map[uint32]error {
	again := &pb.BatchPutEndRequest{}
	var idx []uint32
	for _, j := range resp.Unplaced {
		if int(j) < n {
			again.Items = append(again.Items, full(int(j)))
			idx = append(idx, j)
		}
	}
	if len(again.Items) == 0 {
		return nil
	}
	var r *pb.BatchPutEndResponse
	err := c.master(ctx, func(m pb.MasterClient, o ...grpc.CallOption) (err error) {
		r, err = m.BatchPutEnd(ctx, again, o...)
		return err
	})
	answered := time.Now()
	if err == nil && (len(r.Results) != len(again.Items) || len(r.Unplaced) > 0 || !holdsFit(r)) {
		err = fmt.Errorf("%w: master answered %d results for %d puts, %d unplaced with their replicas, %d holds",
			ErrProtocol, len(r.Results), len(again.Items), len(r.Unplaced), len(r.HoldMs))
	}
	if err != nil {
		var rv puts
		for _, it := range again.Items {
			rv.add(it.Key, it.PutId)
		}
		c.revoke(rv.request())
		failed := map[uint32]error{}
		for _, j := range idx {
			failed[j] = err
		}
		return failed
	}
	for k, j := range idx {
		resp.Results[j] = r.Results[k]
		if len(r.HoldMs) > 0 {
			holds[j] = holdUntil(answered, r.HoldMs[k])
		}
	}
	return nil
}

func shapeOf(it *pb.PutStartRequest) shape {
	return shape{size: it.Size, tier: it.Tier, replicas: it.Replicas}
}

// writeTimeout is the master's put timeout as last answered (30 s until
// then): a grant is used only with enough of it left.
func (c *Client) writeTimeout() time.Duration { return time.Duration(c.putTimeout.Load()) }

func (c *Client) setWriteTimeout(d time.Duration) {
	if d > 0 {
		c.putTimeout.Store(int64(d))
	}
}

// puts collects keys with the put ids PutStart gave them.
type puts struct {
	keys []string
	ids  []uint64
}

func (p *puts) add(key string, id uint64) {
	p.keys = append(p.keys, key)
	p.ids = append(p.ids, id)
}

func (p *puts) request() *pb.KeysRequest { return &pb.KeysRequest{Keys: p.keys, PutIds: p.ids} }

// revoke abandons puts; on failure the leader revokes them after its timeout.
func (c *Client) revoke(req *pb.KeysRequest) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := c.master(ctx, func(m pb.MasterClient, o ...grpc.CallOption) error {
		_, err := m.PutRevoke(ctx, req, o...)
		return err
	}); err != nil {
		c.log.Warn("revoke puts; the master will revoke them after its put timeout", "keys", len(req.Keys), "err", err)
	}
}
