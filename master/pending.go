package master

import (
	"container/heap"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// pendingFrees holds removed ranges until their space may be reused (the
// end of their read leases, or of a writer's late bytes). It is a min-heap
// by that time: every Apply releases what is due, and must not pay for the
// ranges that are not, however many removals are waiting.
type pendingFrees []*pb.PendingFree

func (h pendingFrees) Len() int           { return len(h) }
func (h pendingFrees) Less(i, j int) bool { return h[i].AfterUnixNano < h[j].AfterUnixNano }
func (h pendingFrees) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *pendingFrees) Push(x any)        { *h = append(*h, x.(*pb.PendingFree)) }

func (h *pendingFrees) Pop() any {
	old := *h
	p := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return p
}

// add keeps p until its time.
func (h *pendingFrees) add(p *pb.PendingFree) { heap.Push(h, p) }

// due takes out and returns, one at a time, a range whose time is at or
// before now; nil when none is.
func (h *pendingFrees) due(now int64) *pb.PendingFree {
	if len(*h) == 0 || (*h)[0].AfterUnixNano > now {
		return nil
	}
	return heap.Pop(h).(*pb.PendingFree)
}

// remove takes out the range at index i.
func (h *pendingFrees) remove(i int) { heap.Remove(h, i) }

// filter keeps the ranges keep accepts.
func (h *pendingFrees) filter(keep func(*pb.PendingFree) bool) {
	kept := (*h)[:0]
	for _, p := range *h {
		if keep(p) {
			kept = append(kept, p)
		}
	}
	clear((*h)[len(kept):])
	*h = kept
	heap.Init(h)
}
