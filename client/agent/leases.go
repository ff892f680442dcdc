package agent

import (
	"sync"
	"time"

	"github.com/tidepool-kv/tidepool/client"
)

// leases keeps the blocks that lookups leased, so that the gets that follow
// read them under that lease (client.GetMatched) instead of asking the
// master again, when the blocks could have been evicted meanwhile.
//
// Two generations bound it without a goroutine: blocks go into cur; cur
// becomes old when it holds max/2 blocks or when the longest lease seen has
// passed since the last turn, and the old old is dropped. An entry is used
// only while a quarter of its lease is left.
type leases struct {
	half int // blocks per generation

	mu struct {
		sync.Mutex
		cur, old map[string]lease
		turned   time.Time
		longest  time.Duration
	}
}

type lease struct {
	block client.Block
	end   time.Time
	ttl   time.Duration // as granted: end minus when it was kept
}

func newLeases(blocks int) *leases {
	l := &leases{half: max(blocks/2, 1)}
	l.mu.cur, l.mu.old = map[string]lease{}, map[string]lease{}
	return l
}

// keep records the blocks of m, leased until m.LeaseEnd.
func (l *leases) keep(m client.Match, now time.Time) {
	if l == nil || m.Len() == 0 {
		return
	}
	ttl := m.LeaseEnd.Sub(now)
	if ttl <= 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.mu.longest = max(l.mu.longest, ttl)
	if now.Sub(l.mu.turned) > l.mu.longest {
		l.turn(now)
	}
	for _, b := range m.Blocks {
		if len(l.mu.cur) >= l.half {
			l.turn(now)
		}
		l.mu.cur[b.Key] = lease{block: b, end: m.LeaseEnd, ttl: ttl}
	}
}

func (l *leases) turn(now time.Time) {
	l.mu.old, l.mu.cur, l.mu.turned = l.mu.cur, make(map[string]lease, len(l.mu.cur)), now
}

// get returns key's block and its lease end, if a lookup leased it and
// enough of the lease is left to read it.
func (l *leases) get(key string, now time.Time) (client.Block, time.Time, bool) {
	if l == nil {
		return client.Block{}, time.Time{}, false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	e, ok := l.mu.cur[key]
	if !ok {
		e, ok = l.mu.old[key]
	}
	if !ok || e.end.Sub(now) < e.ttl/4 {
		return client.Block{}, time.Time{}, false
	}
	return e.block, e.end, true
}

// drop forgets keys: they were removed, or reading them failed.
func (l *leases) drop(keys ...string) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, k := range keys {
		delete(l.mu.cur, k)
		delete(l.mu.old, k)
	}
}
