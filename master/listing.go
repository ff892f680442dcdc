package master

import (
	"cmp"
	"slices"
	"strings"
	"sync"
	"time"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// listings keep the key order of paged Lists, so that a page after the
// first costs its own keys, not a pass over the table: a full listing of
// N keys in pages of P so costs one pass and one sort, not N/P passes. An
// index of every key in order would cost 44-52 bytes an object more
// (measured: docs/benchmarks.md), over the master's memory target, for
// what only paged listings use.
//
// A listing's first page is a pass that keeps only its own keys, and it
// drops the prefix's kept order: its second page builds a new one, which
// its later pages (and those of listings of the prefix begun before) use
// for up to listingAge. So a listing lists every object that existed when
// it began and still exists, and leaves out some put since; an object put
// while a listing runs shows in it at most that much later. One build of
// a prefix runs at a time (the others wait for it), and at most
// maxListings prefixes keep an order, each a pointer per object (removed
// ones stay alive until it goes).
type listings struct {
	mu       sync.Mutex
	byPrefix map[string]*listing
	gens     uint64 // the last generation handed out
}

type listing struct {
	gen   uint64    // of the order that may be kept: a first page begins a new one
	objs  []*object // in key order; nil: none kept
	built time.Time
	ready chan struct{} // closed when the build in flight ends; nil: none is
}

const (
	listingAge  = 30 * time.Second
	maxListings = 4
)

func newListings() *listings { return &listings{byPrefix: map[string]*listing{}} }

// list answers a List page: up to limit objects whose key starts with
// prefix and sorts after after, in key order, and whether more follow.
func (s *Server) list(prefix, after string, limit int, now time.Time) ([]*pb.ObjectInfo, bool) {
	if after == "" {
		s.listings.restart(prefix)
		return s.fsm.list(prefix, after, limit)
	}
	objs := s.listings.order(s.fsm, prefix, now)
	i, _ := slices.BinarySearchFunc(objs, after, func(o *object, k string) int { return cmp.Compare(o.key(), k) })
	for i < len(objs) && strings.Compare(objs[i].key(), after) <= 0 {
		i++
	}
	var out []*pb.ObjectInfo
	for i < len(objs) && len(out) < limit {
		chunk := objs[i:min(len(objs), i+limit-len(out))]
		i += len(chunk)
		keys := make([]string, len(chunk))
		for j, o := range chunk {
			keys[j] = o.key()
		}
		out = append(out, s.fsm.infos(keys)...) // those removed since are left out
	}
	return out, i < len(objs)
}

// restart drops the kept order of prefix, and any build in flight, for a
// listing that begins: its pages after the first see a new one.
func (l *listings) restart(prefix string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if ls := l.byPrefix[prefix]; ls != nil {
		l.gens++
		ls.gen, ls.objs = l.gens, nil
	}
}

// order is the key order of the objects with prefix: the kept one if it is
// younger than listingAge, else the one a build in flight makes, else one
// built now.
func (l *listings) order(f *FSM, prefix string, now time.Time) []*object {
	l.mu.Lock()
	ls := l.byPrefix[prefix]
	for ls != nil && ls.ready != nil && ls.objs == nil {
		ready := ls.ready
		l.mu.Unlock()
		<-ready
		l.mu.Lock()
		ls = l.byPrefix[prefix]
	}
	if ls != nil && ls.objs != nil && now.Sub(ls.built) < listingAge {
		objs := ls.objs
		l.mu.Unlock()
		return objs
	}
	if ls == nil {
		ls = l.add(prefix)
	}
	gen, ready := ls.gen, make(chan struct{})
	ls.objs, ls.ready = nil, ready
	l.mu.Unlock()

	objs := f.withPrefix(prefix)
	l.mu.Lock()
	defer l.mu.Unlock()
	if ls.gen == gen && l.byPrefix[prefix] == ls { // no first page dropped it meanwhile
		ls.objs, ls.built = objs, now
	}
	if ls.ready == ready {
		ls.ready = nil
	}
	close(ready)
	return objs
}

// add keeps a new entry for prefix, first dropping the oldest if
// maxListings are kept. l.mu is held.
func (l *listings) add(prefix string) *listing {
	if len(l.byPrefix) >= maxListings {
		var oldest string
		for p, ls := range l.byPrefix {
			if oldest == "" || ls.built.Before(l.byPrefix[oldest].built) {
				oldest = p
			}
		}
		delete(l.byPrefix, oldest)
	}
	l.gens++
	ls := &listing{gen: l.gens}
	l.byPrefix[prefix] = ls
	return ls
}

// withPrefix lists the objects whose key starts with prefix, in key order:
// a pass over the table (see walk), and a sort after it.
func (f *FSM) withPrefix(prefix string) []*object {
	var chunks [][]*object
	var shard []*object
	f.walk(func(o *object) {
		if strings.HasPrefix(o.key(), prefix) {
			shard = append(shard, o)
		}
	}, func() {
		if len(shard) > 0 {
			chunks, shard = append(chunks, shard), nil
		}
	})
	out := slices.Concat(chunks...)
	slices.SortFunc(out, func(a, b *object) int { return strings.Compare(a.key(), b.key()) })
	return out
}
