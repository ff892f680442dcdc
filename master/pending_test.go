package master

import (
	"math/rand/v2"
	"slices"
	"testing"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestPendingFreesDue: against a plain list, random adds, removals by
// index, filters and releases release exactly the ranges whose time has
// come, each once.
func TestPendingFreesDue(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var h pendingFrees
	var naive []*pb.PendingFree
	now := int64(0)
	for step := range 5000 {
		switch op := rng.IntN(10); {
		case op < 5:
			p := &pb.PendingFree{AfterUnixNano: now + rng.Int64N(100), CopyId: uint64(step)}
			h.add(p)
			naive = append(naive, p)
		case op == 5 && len(h) > 0:
			i := rng.IntN(len(h))
			p := h[i]
			h.remove(i)
			naive = slices.DeleteFunc(naive, func(q *pb.PendingFree) bool { return q == p })
		case op == 6:
			odd := func(p *pb.PendingFree) bool { return p.CopyId%7 != 0 }
			h.filter(odd)
			naive = slices.DeleteFunc(naive, func(p *pb.PendingFree) bool { return !odd(p) })
		default:
			now += rng.Int64N(20)
			var got []uint64
			for p := h.due(now); p != nil; p = h.due(now) {
				got = append(got, p.CopyId)
			}
			var want []uint64
			naive = slices.DeleteFunc(naive, func(p *pb.PendingFree) bool {
				if p.AfterUnixNano <= now {
					want = append(want, p.CopyId)
					return true
				}
				return false
			})
			slices.Sort(got)
			slices.Sort(want)
			if !slices.Equal(got, want) {
				t.Fatalf("step %d, now %d: released %v, want %v", step, now, got, want)
			}
		}
		if len(h) != len(naive) {
			t.Fatalf("step %d: %d pending, want %d", step, len(h), len(naive))
		}
	}
}
