package trace

import (
	"container/heap"
	"container/list"
)

// Result is what a cache did for a trace.
type Result struct {
	Requests int
	// Blocks and Tokens are what the requests' prompts asked for; Hit*
	// the leading blocks (and their tokens) found cached.
	Blocks, HitBlocks int64
	Tokens, HitTokens int64
}

// BlockHitRate and TokenHitRate are the hit fractions (0 for an empty
// trace).
func (r Result) BlockHitRate() float64 { return ratio(r.HitBlocks, r.Blocks) }
func (r Result) TokenHitRate() float64 { return ratio(r.HitTokens, r.Tokens) }

func ratio(a, b int64) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

// Add counts one request that found its first hit blocks cached.
func (r *Result) Add(req Request, hit int) {
	r.Requests++
	r.Blocks += int64(len(req.HashIDs))
	r.HitBlocks += int64(hit)
	r.Tokens += req.InputLength
	r.HitTokens += req.Tokens(hit)
}

// LRU simulates a cache of capacity blocks that evicts the least recently
// used block, where a request uses its blocks from the last to the first:
// of one request's blocks, the deepest go first, so what stays of a chain
// is a prefix (as engines' prefix caches order their free blocks, and as
// Tidepool's eviction breaks ties).
func LRU(reqs []Request, capacity int) Result {
	var res Result
	order := list.New() // front: most recent
	at := map[int64]*list.Element{}
	for _, req := range reqs {
		hit := 0
		for hit < len(req.HashIDs) && at[req.HashIDs[hit]] != nil {
			hit++
		}
		res.Add(req, hit)
		if capacity <= 0 {
			continue
		}
		for i := len(req.HashIDs) - 1; i >= 0; i-- {
			id := req.HashIDs[i]
			if e := at[id]; e != nil {
				order.MoveToFront(e)
				continue
			}
			if order.Len() == capacity {
				last := order.Back()
				delete(at, last.Value.(int64))
				order.Remove(last)
			}
			at[id] = order.PushFront(id)
		}
	}
	return res
}

// never is the next use of a block used no more.
const never = int(^uint(0) >> 1)

// Belady simulates the offline optimum: a cache of capacity blocks that,
// knowing the future, keeps the blocks used again soonest; a block whose
// next use comes after every cached one's is not admitted at all. (It
// minimizes misses of single blocks; prefix hits, where a block counts
// only after its predecessors hit, it bounds rather than attains, as every
// policy's figure is counted the same way.)
func Belady(reqs []Request, capacity int) Result {
	// nextUse[i][j]: the request after i that next uses reqs[i]'s block j.
	nextUse := make([][]int, len(reqs))
	last := map[int64]int{}
	for i := len(reqs) - 1; i >= 0; i-- {
		ids := reqs[i].HashIDs
		nextUse[i] = make([]int, len(ids))
		for j, id := range ids {
			n, ok := last[id]
			if !ok {
				n = never
			}
			nextUse[i][j] = n
		}
		for _, id := range ids {
			last[id] = i
		}
	}
	var res Result
	h := &farthest{pos: map[int64]int{}}
	for i, req := range reqs {
		hit := 0
		for hit < len(req.HashIDs) && h.has(req.HashIDs[hit]) {
			hit++
		}
		res.Add(req, hit)
		if capacity <= 0 {
			continue
		}
		for j, id := range req.HashIDs {
			n := nextUse[i][j]
			switch {
			case h.has(id):
				h.update(id, n)
			case n == never:
				// Used no more: not worth a place.
			case h.Len() < capacity:
				heap.Push(h, entry{id, n})
			case h.items[0].next > n:
				h.pop()
				heap.Push(h, entry{id, n})
			}
		}
	}
	return res
}

// farthest is a max-heap of cached blocks by next use.
type farthest struct {
	items []entry
	pos   map[int64]int // block -> index in items
}

type entry struct {
	id   int64
	next int
}

func (h *farthest) has(id int64) bool { _, ok := h.pos[id]; return ok }
func (h *farthest) Len() int          { return len(h.items) }
func (h *farthest) Less(i, j int) bool {
	return h.items[i].next > h.items[j].next
}
func (h *farthest) Swap(i, j int) {
	h.items[i], h.items[j] = h.items[j], h.items[i]
	h.pos[h.items[i].id], h.pos[h.items[j].id] = i, j
}
func (h *farthest) Push(x any) {
	e := x.(entry)
	h.pos[e.id] = len(h.items)
	h.items = append(h.items, e)
}
func (h *farthest) Pop() any {
	e := h.items[len(h.items)-1]
	h.items = h.items[:len(h.items)-1]
	delete(h.pos, e.id)
	return e
}
func (h *farthest) pop() { heap.Pop(h) }
func (h *farthest) update(id int64, next int) {
	i := h.pos[id]
	h.items[i].next = next
	heap.Fix(h, i)
}
