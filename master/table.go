package master

import (
	"hash/maphash"
	"iter"
	"runtime"
	"slices"
	"unsafe"
)

// objectTable indexes the objects by key. A Go map of millions of keys
// costs about 50 bytes an object (a key header and a pointer per slot, at
// most seven eighths full, and twice that while it grows); this table
// keeps a pointer and a byte of hash per slot, so about 14. It is an
// open-addressing table with linear probing, split by hash into shards
// that grow one at a time: growing rehashes one 256th of the objects,
// never the whole table under the FSM's lock. The byte of hash skips most
// probes without touching the object.
//
// Iteration order follows the hash seed, random per process like a map's:
// Apply must not depend on it.
type objectTable struct {
	seed   maphash.Seed
	n      int
	shards [tableShards]tableShard
}

const tableShards = 256

type tableShard struct {
	tags  []uint8 // 0: empty; else the hash's second byte, low bit set
	slots []*object
	n     int
}

func newObjectTable() *objectTable { return &objectTable{seed: maphash.MakeSeed()} }

func (t *objectTable) hash(key string) (s *tableShard, tag uint8, h uint64) {
	h = maphash.String(t.seed, key)
	return t.shard(h), uint8(h>>48) | 1, h
}

func (t *objectTable) shard(h uint64) *tableShard { return &t.shards[h>>56] }

func (t *objectTable) len() int { return t.n }

// get returns the object of key, or nil.
func (t *objectTable) get(key string) *object {
	s, tag, h := t.hash(key)
	if s.n == 0 {
		return nil
	}
	mask := len(s.slots) - 1
	for i := int(h) & mask; ; i = (i + 1) & mask {
		switch s.tags[i] {
		case 0:
			return nil
		case tag:
			if o := s.slots[i]; o.key() == key {
				return o
			}
		}
	}
}

// warm reads, for key(0) to key(n-1) in order, the slot where the key's
// lookup starts, its tag and object pointer, and does nothing with them.
// Keys warmed one after another miss the cache in parallel (no load
// depends on another), where their lookups would miss one at a time: a
// table of millions of objects is far larger than the cache, which other
// processes share. The keys are hashed apart from the loads, so more
// loads are in flight at once. A follower applied a publish of 128 keys
// in two thirds of the time (BenchmarkFollowerPublish128), 7% less
// again with the hashing apart.
func (t *objectTable) warm(n int, key func(int) string) {
	var seen uint8
	var hashes [64]uint64
	for from := 0; from < n; from += len(hashes) {
		hs := hashes[:min(n-from, len(hashes))]
		for i := range hs {
			hs[i] = maphash.String(t.seed, key(from+i))
		}
		for _, h := range hs {
			if s := t.shard(h); len(s.slots) > 0 {
				j := int(h) & (len(s.slots) - 1)
				seen ^= s.tags[j] ^ uint8(uintptr(unsafe.Pointer(s.slots[j])))
			}
		}
	}
	runtime.KeepAlive(seen) // keeps the loads
}

// put adds o, or replaces the object of its key.
func (t *objectTable) put(o *object) {
	s, tag, h := t.hash(o.key())
	mask := len(s.slots) - 1
	for i := int(h) & mask; s.n > 0; i = (i + 1) & mask {
		if s.tags[i] == 0 {
			break
		}
		if s.tags[i] == tag && s.slots[i].key() == o.key() {
			s.slots[i] = o
			return
		}
	}
	if (s.n+1)*4 > len(s.slots)*3 { // at most three quarters full
		t.grow(s)
		mask = len(s.slots) - 1
	}
	i := int(h) & mask
	for s.tags[i] != 0 {
		i = (i + 1) & mask
	}
	s.tags[i], s.slots[i] = tag, o
	s.n++
	t.n++
}

func (t *objectTable) grow(s *tableShard) {
	tags, slots := s.tags, s.slots
	n := max(8, 2*len(slots))
	s.tags, s.slots = make([]uint8, n), make([]*object, n)
	mask := n - 1
	for j, o := range slots {
		if tags[j] == 0 {
			continue
		}
		_, _, h := t.hash(o.key())
		i := int(h) & mask
		for s.tags[i] != 0 {
			i = (i + 1) & mask
		}
		s.tags[i], s.slots[i] = tags[j], o
	}
}

// remove deletes the object of key, if any. It shifts the probe run after
// the hole back instead of leaving a tombstone, so lookups never slow
// down with churn.
func (t *objectTable) remove(key string) {
	s, tag, h := t.hash(key)
	if s.n == 0 {
		return
	}
	mask := len(s.slots) - 1
	i := int(h) & mask
	for ; ; i = (i + 1) & mask {
		if s.tags[i] == 0 {
			return
		}
		if s.tags[i] == tag && s.slots[i].key() == key {
			break
		}
	}
	s.n--
	t.n--
	for j := i; ; {
		s.tags[i], s.slots[i] = 0, nil
		for {
			j = (j + 1) & mask
			if s.tags[j] == 0 {
				return
			}
			_, _, hj := t.hash(s.slots[j].key())
			// The entry at j may fill the hole at i unless its home lies
			// cyclically in (i, j]: then moving it would hide it.
			home := int(hj) & mask
			if (i <= j && (home <= i || home > j)) || (i > j && home <= i && home > j) {
				break
			}
		}
		s.tags[i], s.slots[i] = s.tags[j], s.slots[j]
		i = j
	}
}

// all yields every object with its key, in no particular order. The
// table must not change during the iteration.
func (t *objectTable) all() iter.Seq2[string, *object] {
	return func(yield func(string, *object) bool) {
		for si := range t.shards {
			s := &t.shards[si]
			for i, tag := range s.tags {
				if tag != 0 && !yield(s.slots[i].key(), s.slots[i]) {
					return
				}
			}
		}
	}
}

// inShard yields the objects of one of the tableShards shards, as long as
// yield returns true: a walk of the table can take one shard under a lock
// and let go of it between shards. The table must not change meanwhile.
func (t *objectTable) inShard(i int, yield func(*object) bool) {
	s := &t.shards[i]
	for j, tag := range s.tags {
		if tag != 0 && !yield(s.slots[j]) {
			return
		}
	}
}

// sortedKeys lists the keys in order, for iterations Apply depends on.
func (t *objectTable) sortedKeys() []string {
	keys := make([]string, 0, t.n)
	for k := range t.all() {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
