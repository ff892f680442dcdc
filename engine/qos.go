package engine

import (
	"cmp"
	"slices"
	"sync"
	"time"
)

// agingStep is how long a queued request waits to rise one class: LOW waiting 20 ms competes as
// HIGH, so strict priority never starves the lower classes.
const agingStep = 10 * time.Millisecond

// qosQueue holds requests waiting to be dispatched: strict priority by class with aging, FIFO
// within a class, per-tenant in-flight caps honored by skipping (not dropping) a tenant that is at
// its cap, and deadlines failed fast. T is the caller's request type.
//
// Within a class, order is push order: callers push with non-decreasing now (a clock read under
// their lock).
//
// A qosQueue is not safe for concurrent use: the scheduler holds its own lock around every call,
// and around pop together with the tenantCaps.start that follows it.
type qosQueue[T any] struct {
	byClass [3][]queued[T] // indexed by class - High; each FIFO by enqueue order
	seq     uint64         // enqueue order, breaking ties between equal enqueue times
}

type queued[T any] struct {
	item     T
	class    Priority // High, Medium or Low
	bytes    int64
	tenant   string
	deadline time.Time // zero: none
	enqueued time.Time
	seq      uint64
}

// push enqueues item of the given class (zero means Medium) at now. deadline is when the request
// must be done by, zero for none.
func (q *qosQueue[T]) push(item T, class Priority, bytes int64, tenant string, deadline, now time.Time) {
	if class == 0 {
		class = Medium
	}
	class = min(max(class, High), Low)
	q.seq++
	q.byClass[class-High] = append(q.byClass[class-High], queued[T]{
		item: item, class: class, bytes: bytes, tenant: tenant,
		deadline: deadline, enqueued: now, seq: q.seq,
	})
}

// pushFront puts back an item that pop just returned and the caller could
// not start, at the head of its class so it keeps its turn.
func (q *qosQueue[T]) pushFront(item T, class Priority, bytes int64, tenant string, enqueued time.Time) {
	if class == 0 {
		class = Medium
	}
	class = min(max(class, High), Low)
	q.seq++
	e := queued[T]{item: item, class: class, bytes: bytes, tenant: tenant, enqueued: enqueued, seq: q.seq}
	q.byClass[class-High] = append([]queued[T]{e}, q.byClass[class-High]...)
}

// effective is e's class at now after aging: a request that has waited
// agingStep moves up one class, once. Low thus overtakes Medium traffic but
// never competes with High, so bulk work that has queued for a while cannot
// push foreground reads back (the scheduler also caps Low's rail slots).
func (e *queued[T]) effective(now time.Time) Priority {
	if e.class > High && now.Sub(e.enqueued) >= agingStep {
		return e.class - 1
	}
	return e.class
}

// before orders dispatch: better effective class first, then earlier enqueue.
func (e *queued[T]) before(o *queued[T], now time.Time) bool {
	if a, b := e.effective(now), o.effective(now); a != b {
		return a < b
	}
	if c := e.enqueued.Compare(o.enqueued); c != 0 {
		return c < 0
	}
	return e.seq < o.seq
}

// pop removes and returns the request to dispatch next at now: the best effective class, FIFO
// among equals, skipping requests canStart refuses (by native class, tenant and size; nil
// admits all); those stay
// queued, in place. ok is false when nothing queued may start.
func (q *qosQueue[T]) pop(now time.Time, canStart func(class Priority, tenant string, bytes int64) bool) (item T, ok bool) {
	// Within a class the queue is FIFO, so its first startable request is also its oldest and best
	// aged: only one candidate per class needs comparing.
	bestC, bestJ := -1, -1
	for c := range q.byClass {
		for j := range q.byClass[c] {
			e := &q.byClass[c][j]
			if canStart != nil && !canStart(e.class, e.tenant, e.bytes) {
				continue
			}
			if bestC < 0 || e.before(&q.byClass[bestC][bestJ], now) {
				bestC, bestJ = c, j
			}
			break
		}
	}
	if bestC < 0 {
		return item, false
	}
	item = q.byClass[bestC][bestJ].item
	if bestJ == 0 {
		// The common case: reslice instead of shifting the whole class.
		q.byClass[bestC][0] = queued[T]{}
		q.byClass[bestC] = q.byClass[bestC][1:]
	} else {
		q.byClass[bestC] = slices.Delete(q.byClass[bestC], bestJ, bestJ+1)
	}
	return item, true
}

// remove takes out and returns, in class then enqueue order, every queued
// item that match accepts: the scheduler drops a canceled request's slices.
func (q *qosQueue[T]) remove(match func(T) bool) []T {
	var out []T
	for c := range q.byClass {
		q.byClass[c] = slices.DeleteFunc(q.byClass[c], func(e queued[T]) bool {
			if match(e.item) {
				out = append(out, e.item)
				return true
			}
			return false
		})
	}
	return out
}

// expired removes and returns, in enqueue order, the requests whose deadline cannot be met any
// more: now plus estimate(bytes), the predicted transfer time (nil: zero), is past the deadline.
// Failing them now lets the caller recompute instead of waiting for a load that will be late.
func (q *qosQueue[T]) expired(now time.Time, estimate func(bytes int64) time.Duration) []T {
	var out []queued[T]
	for c := range q.byClass {
		q.byClass[c] = slices.DeleteFunc(q.byClass[c], func(e queued[T]) bool {
			var d time.Duration
			if estimate != nil {
				d = estimate(e.bytes)
			}
			late := !e.deadline.IsZero() && now.Add(d).After(e.deadline)
			if late {
				out = append(out, e)
			}
			return late
		})
	}
	slices.SortFunc(out, func(a, b queued[T]) int { return cmp.Compare(a.seq, b.seq) })
	items := make([]T, len(out))
	for i := range out {
		items[i] = out[i].item
	}
	return items
}

// len is the number of queued requests.
func (q *qosQueue[T]) len() int {
	return len(q.byClass[0]) + len(q.byClass[1]) + len(q.byClass[2])
}

// tenantCaps bounds each tenant's bytes in flight, so one tenant's bulk traffic cannot take the
// whole engine. It is safe for concurrent use (done runs on completion paths).
type tenantCaps struct {
	limit int64 // bytes per tenant; 0: unlimited

	mu struct {
		sync.Mutex
		inflight map[string]int64
	}
}

// newTenantCaps caps each tenant at limit bytes in flight; 0 means unlimited.
func newTenantCaps(limit int64) *tenantCaps {
	t := &tenantCaps{limit: limit}
	t.mu.inflight = make(map[string]int64)
	return t
}

// canStart reports whether tenant may start a request of bytes now. A tenant with nothing in
// flight may always start one, even one larger than the cap, so no request starves.
func (t *tenantCaps) canStart(tenant string, bytes int64) bool {
	if t.limit <= 0 {
		return true
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	cur := t.mu.inflight[tenant]
	return cur == 0 || cur+bytes <= t.limit
}

// start accounts a started request of bytes to tenant.
func (t *tenantCaps) start(tenant string, bytes int64) {
	t.mu.Lock()
	t.mu.inflight[tenant] += bytes
	t.mu.Unlock()
}

// done releases what start accounted.
func (t *tenantCaps) done(tenant string, bytes int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.mu.inflight[tenant] -= bytes; t.mu.inflight[tenant] <= 0 {
		delete(t.mu.inflight, tenant)
	}
}

// inflight is tenant's bytes in flight, for telemetry.
func (t *tenantCaps) inflight(tenant string) int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.mu.inflight[tenant]
}
