package master

import (
	"container/heap"
	"slices"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// tombs remembers removed keys that clients may still answer from their
// lookup caches (a lookup's descriptors are cached for the lease it got),
// and until when. A new put of such a key is published at once, but its
// writer is told to report it done only once the time has passed
// (Server.holds): a lookup that starts after a remove and a re-put have
// returned then never answers the removed incarnation. A key is here only for a lease TTL
// after its removal, so the set is as large as the removals of a TTL.
type tombs struct {
	until map[string]int64
	queue tombQueue // by time; entries a later removal outdated stay until due
}

func newTombs() tombs { return tombs{until: map[string]int64{}} }

// add records that key may be cached until the given time (unix nanos),
// if that is after now.
func (t *tombs) add(key string, until, now int64) {
	if until <= now || until <= t.until[key] {
		return
	}
	t.until[key] = until
	heap.Push(&t.queue, tomb{key, until})
}

// expire forgets the tombs due at now.
func (t *tombs) expire(now int64) {
	for len(t.queue) > 0 && t.queue[0].until <= now {
		d := heap.Pop(&t.queue).(tomb)
		if t.until[d.key] == d.until {
			delete(t.until, d.key)
		}
	}
}

// latest is the latest time until which one of keys may be cached; 0 if
// none is.
func (t *tombs) latest(keys []string) int64 {
	var end int64
	if len(t.until) == 0 {
		return 0
	}
	for _, k := range keys {
		end = max(end, t.until[k])
	}
	return end
}

// snapshot lists the tombs in key order.
func (t *tombs) snapshot() []*pb.Tomb {
	keys := make([]string, 0, len(t.until))
	for k := range t.until {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	out := make([]*pb.Tomb, len(keys))
	for i, k := range keys {
		out[i] = &pb.Tomb{Key: k, UntilUnixNano: t.until[k]}
	}
	return out
}

type tomb struct {
	key   string
	until int64
}

type tombQueue []tomb

func (q tombQueue) Len() int           { return len(q) }
func (q tombQueue) Less(i, j int) bool { return q[i].until < q[j].until }
func (q tombQueue) Swap(i, j int)      { q[i], q[j] = q[j], q[i] }
func (q *tombQueue) Push(x any)        { *q = append(*q, x.(tomb)) }

func (q *tombQueue) Pop() any {
	old := *q
	d := old[len(old)-1]
	*q = old[:len(old)-1]
	return d
}
