package client

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"math"
	"strings"
	"sync/atomic"
	"time"

	"github.com/dgraph-io/ristretto/v2"
	"google.golang.org/grpc"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Block is one cached block of a chain: where its bytes are and what they
// hash to.
type Block struct {
	Key      string
	Size     uint64
	Checksum uint32
	// Of a block a lookup answered: the stripe of its key and the removal
	// clock its lookup read before asking the master (see removals), and
	// when its lease ends, in nanoseconds since its client was made
	// (Client.born: the monotonic clock; a time.Time would be 16 bytes
	// more to copy for every block of every lookup).
	stripe   uint32
	seen     uint64
	leaseEnd int64
	// Where the copies are, fastest tier first: the first inline, the
	// rest (few blocks have them) apart. A lookup of a chain of thousands
	// of blocks so allocates nothing per block, and a block, cached or
	// not, keeps nothing of its answer alive but its segments' descriptors
	// and its read tickets.
	first location
	more  []location
}

// location is one copy of a block: its segment's descriptor (offset and
// length unset), its offset there and the read ticket covering it.
type location struct {
	seg    *pb.Replica
	off    uint64
	ticket []byte
}

// setReplicas makes reps (a describe's answer) the block's copies.
func (b *Block) setReplicas(reps []*pb.Replica) {
	b.first, b.more = location{}, nil
	for i, r := range reps {
		if i == 0 {
			b.first = location{r, r.Offset, r.Ticket}
			continue
		}
		b.more = append(b.more, location{r, r.Offset, r.Ticket})
	}
}

// Replicas are the block's copies, fastest tier first, built anew on each
// call.
func (b Block) Replicas() []*pb.Replica {
	if b.first.seg == nil {
		return nil
	}
	reps := make([]pb.Replica, 1+len(b.more))
	ptrs := make([]*pb.Replica, len(reps))
	for j := range reps {
		l := b.first
		if j > 0 {
			l = b.more[j-1]
		}
		r := &reps[j]
		r.Segment, r.Node, r.Endpoint, r.Tier = l.seg.Segment, l.seg.Node, l.seg.Endpoint, l.seg.Tier
		r.Offset, r.Length, r.Ticket = l.off, b.Size, l.ticket
		ptrs[j] = r
	}
	return ptrs
}

// Match is the answer to a Lookup: the longest prefix of the chain whose
// blocks are all cached, each leased until at least LeaseEnd. Read them
// with GetMatched before then; the pool does not evict a leased block.
type Match struct {
	Blocks   []Block
	LeaseEnd time.Time
}

// Len is the number of matched blocks.
func (m Match) Len() int { return len(m.Blocks) }

// Keys are the matched blocks' keys, in chain order.
func (m Match) Keys() []string {
	keys := make([]string, len(m.Blocks))
	for i, b := range m.Blocks {
		keys[i] = b.Key
	}
	return keys
}

// Lookup answers how many leading blocks of chain (the block keys of one
// prompt, first block first) the pool holds, and leases them in the same
// master round trip. Blocks a recent lookup leased are answered from the
// client's descriptor cache while at least half their lease is left, so
// repeated lookups of a hot prefix ask the master only for the rest.
//
// A lookup that starts after this client's Remove of a key has returned
// never answers the key from a descriptor cached before (nor from one that
// a lookup in flight meanwhile caches). Nor does one that starts after a
// re-put of a key removed by any client has returned answer the removed
// incarnation: the master answers such a put only once the lookup leases
// of the removed one have ended, and a cached block is not served after
// its lease. This client's own put of such a key drops the cached one.
func (c *Client) Lookup(ctx context.Context, chain []string) (Match, error) {
	if err := validChain(chain); err != nil {
		return Match{}, err
	}
	m := Match{Blocks: make([]Block, 0, len(chain))}
	end := int64(math.MaxInt64) // the earliest lease end matched
	now, half := int64(time.Since(c.born)), int64(c.leaseTTL()/2)
	for _, k := range chain {
		b, ok := c.descs.Get(k)
		if !ok || b.leaseEnd-now < half || !c.removed.current(&b) {
			break
		}
		m.Blocks = append(m.Blocks, b)
		end = min(end, b.leaseEnd)
	}
	if m.Len() == len(chain) {
		return c.leased(m, end), nil
	}
	rest := chain[m.Len():]
	var asked time.Time
	// Read before asking: a removal this client makes after it shows in
	// the clock, and so outdates what this answer caches.
	clock := c.removed.now()
	resp, err := c.lookup(ctx, rest, false, &asked)
	if err != nil {
		return Match{}, err
	}
	if err := checkLookup(resp, len(rest)); err != nil {
		return Match{}, err
	}
	ttl := time.Duration(resp.LeaseTtlMs) * time.Millisecond
	c.setLeaseTTL(ttl)
	leaseEnd := asked.Add(ttl) // measured from our side: conservative
	ttl = time.Until(leaseEnd) // ristretto reads 0 as forever: only a positive one caches
	lease := int64(leaseEnd.Sub(c.born))
	if resp.Matched > 0 {
		end = min(end, lease)
	}
	at := 0
	for i := range int(resp.Matched) {
		b := Block{Key: rest[i], Size: resp.Sizes[i], Checksum: resp.Checksums[i], leaseEnd: lease}
		for j := at; j < at+int(resp.ReplicaCounts[i]); j++ {
			l := location{resp.Segments[resp.ReplicaSegments[j]], resp.ReplicaOffsets[j], resp.ReplicaTicket(j)}
			if j == at {
				b.first = l
			} else {
				b.more = append(b.more, l)
			}
		}
		at += int(resp.ReplicaCounts[i])
		m.Blocks = append(m.Blocks, b)
		if c.descs != nil && ttl > 0 {
			// One a removal has overtaken already would be a miss anyway.
			if b.stripe, b.seen = c.removed.stripe(b.Key), clock; c.removed.current(&b) {
				// Its own copy of the key: the caller's may be a view of
				// a larger buffer (the agent's packed request) that the
				// cache would otherwise keep.
				b.Key = strings.Clone(b.Key)
				c.cached.mark(b.Key) // before the Set: a put that sees no mark has no Set to overtake
				c.descs.SetWithTTL(b.Key, b, 1, ttl)
			}
		}
	}
	return c.leased(m, end), nil
}

// lookup sends one Lookup of keys, their time of asking in *asked if not
// nil. The keys go packed unless the master has turned out not to read
// packed keys: one built before them sees none and answers
// InvalidArgument (the client checked the keys), and from then on this
// client lists them.
func (c *Client) lookup(ctx context.Context, keys []string, countOnly bool, asked *time.Time) (*pb.LookupResponse, error) {
	for {
		req, _ := c.lookupReqs.Get().(*pb.LookupRequest)
		if req == nil {
			req = &pb.LookupRequest{}
		}
		req.CountOnly, req.Uncached = countOnly, c.descs == nil
		listed := c.listedKeys.Load()
		if listed {
			req.Keys, req.PackedKeys, req.KeyLengths = keys, req.PackedKeys[:0], req.KeyLengths[:0]
		} else {
			req.PackKeys(keys)
		}
		var resp *pb.LookupResponse
		err := c.master(ctx, func(mc pb.MasterClient, o ...grpc.CallOption) (err error) {
			if asked != nil {
				*asked = time.Now() // per attempt: a retry after a failover gets a fresh lease
			}
			resp, err = mc.Lookup(ctx, req, o...)
			return err
		})
		// gRPC is done with the request once the call returns: its packed
		// buffers serve the next lookup, unless a huge chain grew them.
		if cap(req.PackedKeys) <= maxPooledKeyBytes {
			req.Keys = nil
			c.lookupReqs.Put(req)
		}
		if err != nil && !listed && errors.Is(err, ErrInvalidArgument) {
			c.listedKeys.Store(true)
			continue
		}
		return resp, err
	}
}

// maxPooledKeyBytes bounds the packed keys a pooled lookup request keeps.
const maxPooledKeyBytes = 1 << 20

// leased sets the lease end of a match of some blocks: end, in
// nanoseconds since the client was made.
func (c *Client) leased(m Match, end int64) Match {
	if m.Len() > 0 {
		m.LeaseEnd = c.born.Add(time.Duration(end))
	}
	return m
}

// BatchExists counts the leading keys of chain that are present, without
// leasing them (SGLang's storage-backend contract).
func (c *Client) BatchExists(ctx context.Context, chain []string) (int, error) {
	if err := validChain(chain); err != nil {
		return 0, err
	}
	resp, err := c.lookup(ctx, chain, true, nil)
	if err != nil {
		return 0, err
	}
	if int(resp.Matched) > len(chain) {
		return 0, fmt.Errorf("%w: %d of %d keys present", ErrProtocol, resp.Matched, len(chain))
	}
	return int(resp.Matched), nil
}

// Score is what the pool holds of a chain, for a router: the leading
// blocks cached (as a lookup would match), per tier the leading blocks
// with a replica there, and the weighted sum of the matched blocks.
type Score struct {
	Matched int
	Tiers   map[string]int // by tier name: "hbm", "dram", "ssd"
	Score   float64
}

// Score asks the master what the pool holds of chain, leasing nothing.
// weights, by tier name, replace the master's defaults (hbm 1.0, dram
// 0.8, ssd 0.5) for the tiers they name.
func (c *Client) Score(ctx context.Context, chain []string, weights map[string]float64) (Score, error) {
	if err := validChain(chain); err != nil {
		return Score{}, err
	}
	req := &pb.ScoreRequest{Chain: &pb.LookupRequest{}}
	req.Chain.PackKeys(chain)
	for name, w := range weights {
		t, ok := pb.ParseTier(name)
		if !ok {
			return Score{}, fmt.Errorf("%w: weight for tier %q: want hbm, dram or ssd", ErrInvalidArgument, name)
		}
		req.Weights = append(req.Weights, &pb.TierWeight{Tier: t, Weight: w})
	}
	var resp *pb.ScoreResponse
	err := c.master(ctx, func(mc pb.MasterClient, o ...grpc.CallOption) (err error) {
		resp, err = mc.Score(ctx, req, o...)
		return err
	})
	if err != nil {
		return Score{}, err
	}
	if int(resp.Matched) > len(chain) {
		return Score{}, fmt.Errorf("%w: %d of %d blocks matched", ErrProtocol, resp.Matched, len(chain))
	}
	out := Score{Matched: int(resp.Matched), Tiers: map[string]int{}, Score: resp.Score}
	for _, t := range resp.Tiers {
		out.Tiers[t.Tier.Name()] = int(t.Blocks)
	}
	return out, nil
}

// GetMatched reads the matched blocks into bufs[i] (at least Blocks[i].Size
// long) under the lookup's lease, without asking the master again, and
// returns the lengths.
func (c *Client) GetMatched(ctx context.Context, m Match, bufs [][]byte) ([]int, []error) {
	ns := make([]int, m.Len())
	errs := make([]error, m.Len())
	if len(bufs) != m.Len() {
		for i := range errs {
			errs[i] = fmt.Errorf("%w: %d blocks but %d buffers", ErrInvalidArgument, m.Len(), len(bufs))
		}
		return ns, errs
	}
	objs := make([]*pb.ObjectReplicas, m.Len())
	for i, b := range m.Blocks {
		objs[i] = &pb.ObjectReplicas{Status: &pb.ItemStatus{}, Size: b.Size, Checksum: b.Checksum, Replicas: b.Replicas()}
	}
	vals := make([][]byte, m.Len())
	c.readReplicas(ctx, m.Keys(), objs, m.LeaseEnd, vals, errs, func(i int, size uint64) ([]byte, error) {
		if uint64(len(bufs[i])) < size {
			return nil, fmt.Errorf("%w: %d bytes for a block of %d", ErrShortBuffer, len(bufs[i]), size)
		}
		return bufs[i][:size], nil
	})
	for i, v := range vals {
		ns[i] = len(v)
	}
	return ns, errs
}

// checkLookup makes sure every index in a LookupResponse is in range
// before the client trusts it.
func checkLookup(r *pb.LookupResponse, asked int) error {
	n := int(r.Matched)
	if n > asked || len(r.Sizes) != n || len(r.Checksums) != n || len(r.ReplicaCounts) != n {
		return fmt.Errorf("%w: lookup of %d keys matched %d with %d sizes, %d checksums, %d replica counts",
			ErrProtocol, asked, n, len(r.Sizes), len(r.Checksums), len(r.ReplicaCounts))
	}
	total := 0
	for _, c := range r.ReplicaCounts {
		if c == 0 {
			return fmt.Errorf("%w: lookup answered a block without replicas", ErrProtocol)
		}
		total += int(c)
	}
	if len(r.ReplicaSegments) != total || len(r.ReplicaOffsets) != total {
		return fmt.Errorf("%w: lookup answered %d replicas with %d segments and %d offsets", ErrProtocol, total, len(r.ReplicaSegments), len(r.ReplicaOffsets))
	}
	for _, i := range r.ReplicaSegments {
		if int(i) >= len(r.Segments) {
			return fmt.Errorf("%w: lookup answered segment %d of %d", ErrProtocol, i, len(r.Segments))
		}
	}
	if n := len(r.ReplicaTickets); n != 0 && n != total {
		return fmt.Errorf("%w: lookup answered %d replicas with %d tickets", ErrProtocol, total, n)
	}
	return nil
}

func validChain(chain []string) error {
	if len(chain) == 0 {
		return fmt.Errorf("%w: empty chain", ErrInvalidArgument)
	}
	for _, k := range chain {
		if err := validKey(k); err != nil {
			return err
		}
	}
	return nil
}

// descCache holds the blocks recent lookups leased, each until its lease
// ends (ristretto drops it then).
type descCache = ristretto.Cache[string, Block]

func newDescCache(blocks int) (*descCache, error) {
	return ristretto.NewCache(&ristretto.Config[string, Block]{
		NumCounters: int64(10 * blocks), MaxCost: int64(blocks), BufferItems: 64,
	})
}

// removals orders a client's lookups against its own removals, so that
// its descriptor cache never answers a key from a lookup that a removal
// of the key may have overtaken: one the master answered before the
// removal, whose answer reaches the cache at any time after.
//
// A removal ticks a clock and stamps its keys' stripes with the tick,
// before it asks the master and again once the master has answered; a
// lookup reads the clock before it asks the master and stamps what it
// caches with that reading; a cached block is current while its stripe
// was stamped no later than that. A block is checked on every hit, as
// deleting it would not do: ristretto's Del deletes at once, but a Set
// still queued then lands after it, and stays until the Del's own turn in
// the queue (seen in TestReview11LookupsOnRemovingClient). Stripes share
// stamps: a removal outdates the other cached keys of its stripes too (a
// miss each). A hit costs an atomic load, no lock and no hash.
type removals struct {
	seed   maphash.Seed
	clock  atomic.Uint64
	stamps [removalStripes]atomic.Uint64 // per stripe: the tick of its last removal
}

// cacheMarks marks, by a hash, each key this client has handed its
// descriptor cache, so that a put of a key never marked skips the cache's
// Del (an allocation and a channel send). Marks are never cleared: a
// client that has cached about a million keys marks most hashes, and
// then every put deletes, as if there were no marks.
type cacheMarks struct {
	seed maphash.Seed
	bits [cacheMarkBits / 64]atomic.Uint64
}

const cacheMarkBits = 1 << 20 // 128 KiB

func (m *cacheMarks) bit(key string) (*atomic.Uint64, uint64) {
	h := maphash.String(m.seed, key) & (cacheMarkBits - 1)
	return &m.bits[h/64], 1 << (h % 64)
}

func (m *cacheMarks) mark(key string) {
	w, b := m.bit(key)
	w.Or(b)
}

func (m *cacheMarks) marked(key string) bool {
	w, b := m.bit(key)
	return w.Load()&b != 0
}

// removalStripes is how many stripes keys are hashed to (a power of 2).
const removalStripes = 1 << 12

func newRemovals() *removals { return &removals{seed: maphash.MakeSeed()} }

// now is the clock, read before asking the master.
func (r *removals) now() uint64 { return r.clock.Load() }

func (r *removals) stripe(key string) uint32 {
	return uint32(maphash.String(r.seed, key) & (removalStripes - 1))
}

// current reports whether no key of b's stripe was removed since b's
// lookup read the clock.
func (r *removals) current(b *Block) bool {
	return r.stamps[b.stripe&(removalStripes-1)].Load() <= b.seen
}

// removing outdates what the descriptor cache holds for keys and what the
// lookups in flight will cache for them: for every lookup that starts
// after it returns.
func (c *Client) removing(keys []string) {
	if c.descs == nil {
		return
	}
	t := c.removed.clock.Add(1) // later than any reading taken before
	for _, k := range keys {
		s := &c.removed.stamps[c.removed.stripe(k)]
		for old := s.Load(); old < t && !s.CompareAndSwap(old, t); old = s.Load() {
		}
	}
}
