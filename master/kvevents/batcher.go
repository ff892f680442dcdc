package kvevents

import (
	"maps"
	"slices"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

type kind uint8

const (
	blockStored kind = iota
	blockRemoved
	allBlocksCleared
)

// event is one vLLM KV event, not yet encoded.
type event struct {
	kind      kind
	hashes    []uint64
	parent    uint64 // stored, when hasParent
	hasParent bool
	blockSize int
	medium    string
	ns        string // stored: the hash space, so that a run never spans two
}

// batch is one EventBatch of one topic.
type batch struct {
	topic  string
	seq    uint64
	ts     float64 // seconds since the epoch
	events []event
}

// maxBatchHashes caps the block hashes of one batch (an AllBlocksCleared
// counts one). A snapshot restore hears every object of the table in one
// entry; cut in batches, it stays within what a queue slot, a replay slot
// and a subscriber's buffers are sized for.
const maxBatchHashes = 512

// batcher turns the FSM's calls into batches: it coalesces runs, keeps the
// live count of each topic and applies the clear rule (see the package
// documentation). Like the FSM it serves, it is not safe for concurrent use.
type batcher struct {
	topics  map[string]*topicState // those holding blocks, and those touched
	touched []*topicState          // heard since the last flush, first-heard first
}

type topicState struct {
	name    string
	live    int     // (key, tier) pairs stored and not removed
	events  []event // heard since the last flush
	removed bool    // a block left since the last flush
	cleared bool    // the state was replaced since the last flush
	touched bool
}

func newBatcher() *batcher { return &batcher{topics: make(map[string]*topicState)} }

func (b *batcher) topic(name string) *topicState {
	t := b.topics[name]
	if t == nil {
		t = &topicState{name: name}
		b.topics[name] = t
	}
	b.touch(t)
	return t
}

func (b *batcher) touch(t *topicState) {
	if !t.touched {
		t.touched = true
		b.touched = append(b.touched, t)
	}
}

func (b *batcher) stored(key, parent, tenant string, tier pb.Tier) {
	m := medium(tier)
	if m == "" {
		return
	}
	k, ok := parseKey(key, tenant)
	if !ok {
		return
	}
	ph, hasParent := parentHash(parent, k)
	t := b.topic(k.topic)
	t.live++
	// A block whose parent is the last block stored extends that run, as
	// vLLM stores a request's consecutive full blocks in one event.
	if n := len(t.events); n > 0 && hasParent {
		last := &t.events[n-1]
		if last.kind == blockStored && last.medium == m && last.ns == k.ns && last.hashes[len(last.hashes)-1] == ph {
			last.hashes = append(last.hashes, k.hash)
			return
		}
	}
	t.events = append(t.events, event{kind: blockStored, hashes: []uint64{k.hash}, parent: ph, hasParent: hasParent,
		blockSize: k.blockSize, medium: m, ns: k.ns})
}

func (b *batcher) removed(key, tenant string, tier pb.Tier) {
	m := medium(tier)
	if m == "" {
		return
	}
	k, ok := parseKey(key, tenant)
	if !ok {
		return
	}
	t := b.topic(k.topic)
	t.live = max(t.live-1, 0) // a removal of what was never stored cannot go below none
	t.removed = true
	if n := len(t.events); n > 0 {
		if last := &t.events[n-1]; last.kind == blockRemoved && last.medium == m {
			last.hashes = append(last.hashes, k.hash)
			return
		}
	}
	t.events = append(t.events, event{kind: blockRemoved, hashes: []uint64{k.hash}, medium: m})
}

// cleared forgets every topic's blocks and events; each starts its next
// batch with AllBlocksCleared. Topics are touched in name order, so that a
// restore's batches come in the same order everywhere.
func (b *batcher) cleared() {
	for _, name := range slices.Sorted(maps.Keys(b.topics)) {
		t := b.topics[name]
		t.live, t.events, t.removed, t.cleared = 0, nil, false, true
		b.touch(t)
	}
}

// flush appends to out what was heard since the last flush: for each topic
// touched, in first-heard order, one batch, or several when it holds more
// than maxBatchHashes hashes. Their seq is left for the caller. Topics left
// without blocks are forgotten.
func (b *batcher) flush(ts float64, out []batch) []batch {
	for _, t := range b.touched {
		evs := t.events
		switch {
		case t.removed && t.live == 0:
			// Everything the topic held is gone; one event says so.
			evs = []event{{kind: allBlocksCleared}}
		case t.cleared:
			evs = append([]event{{kind: allBlocksCleared}}, evs...)
		}
		for _, part := range split(evs, maxBatchHashes) {
			out = append(out, batch{topic: t.name, ts: ts, events: part})
		}
		t.events, t.removed, t.cleared, t.touched = nil, false, false, false
		if t.live == 0 {
			delete(b.topics, t.name)
		}
	}
	clear(b.touched)
	b.touched = b.touched[:0]
	return out
}

// split cuts evs into parts of at most limit hashes. A run of stored blocks
// cut in two goes on in the next part with the last block before the cut as
// its parent.
func split(evs []event, limit int) [][]event {
	var parts [][]event
	var cur []event
	room := limit
	for _, ev := range evs {
		for {
			if n := max(len(ev.hashes), 1); n <= room {
				cur, room = append(cur, ev), room-n
				break
			}
			if room > 0 {
				head := ev
				head.hashes = ev.hashes[:room:room]
				cur = append(cur, head)
				ev.hashes = ev.hashes[room:]
				if ev.kind == blockStored {
					ev.parent, ev.hasParent = head.hashes[room-1], true
				}
			}
			parts, cur, room = append(parts, cur), nil, limit
		}
	}
	if len(cur) > 0 {
		parts = append(parts, cur)
	}
	return parts
}
