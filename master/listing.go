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
// The order of a prefix is built on its first page after the first (the
// first page is a pass that keeps only its own keys) and kept for
// listingAge: pages served from it list the objects that existed when it
// was built and still exist, so a listing shows an object put since at
// most that much later. At most maxListings prefixes are kept, each
// holding a pointer per object (the objects stay alive until it goes).
type listings struct {
	mu       sync.Mutex
	byPrefix map[string]*listing
}

type listing struct {
	objs  []*object // in key order
	built time.Time
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

// order is the key order of the objects with prefix, built now if none
// younger than listingAge is kept.
func (l *listings) order(f *FSM, prefix string, now time.Time) []*object {
	l.mu.Lock()
	if ls := l.byPrefix[prefix]; ls != nil && now.Sub(ls.built) < listingAge {
		l.mu.Unlock()
		return ls.objs
	}
	l.mu.Unlock()
	objs := f.withPrefix(prefix)
	l.mu.Lock()
	defer l.mu.Unlock()
	for p, ls := range l.byPrefix {
		if now.Sub(ls.built) >= listingAge {
			delete(l.byPrefix, p)
		}
	}
	if len(l.byPrefix) >= maxListings {
		var oldest string
		for p, ls := range l.byPrefix {
			if oldest == "" || ls.built.Before(l.byPrefix[oldest].built) {
				oldest = p
			}
		}
		delete(l.byPrefix, oldest)
	}
	l.byPrefix[prefix] = &listing{objs: objs, built: now}
	return objs
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
