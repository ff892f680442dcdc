package master

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"
)

// TestObjectTableMatchesMap: random puts, replacements and removals
// (enough to grow shards and leave long probe runs behind removals) leave
// the table answering exactly as a map does, by get, len and iteration.
func TestObjectTableMatchesMap(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	tab := newObjectTable()
	want := map[string]*object{}
	key := func() string { return fmt.Sprintf("kv/%d", rng.IntN(20000)) }
	for step := range 200000 {
		k := key()
		switch rng.IntN(3) {
		case 0, 1:
			o := allocObject(k, "")
			o.size = uint64(step)
			tab.put(o)
			want[k] = o
		default:
			tab.remove(k)
			delete(want, k)
		}
		if step%1000 == 0 {
			for k, o := range want {
				if got := tab.get(k); got != o {
					t.Fatalf("step %d: get(%q) = %v, want %v", step, k, got, o)
				}
			}
		}
		if probe := key(); tab.get(probe) != want[probe] {
			t.Fatalf("step %d: get(%q) = %v, want %v", step, probe, tab.get(probe), want[probe])
		}
	}
	if tab.len() != len(want) {
		t.Fatalf("len %d, want %d", tab.len(), len(want))
	}
	got := map[string]*object{}
	for k, o := range tab.all() {
		if _, dup := got[k]; dup {
			t.Fatalf("%q yielded twice", k)
		}
		got[k] = o
	}
	if !maps.Equal(got, want) {
		t.Fatalf("iteration yielded %d objects, want %d", len(got), len(want))
	}
	if keys := tab.sortedKeys(); !slices.IsSorted(keys) || len(keys) != len(want) {
		t.Fatalf("sortedKeys: %d keys, sorted %v", len(keys), slices.IsSorted(keys))
	}
	for k := range want {
		tab.remove(k)
	}
	if tab.len() != 0 || tab.get("kv/1") != nil {
		t.Fatalf("after removing all: len %d", tab.len())
	}
}

func BenchmarkObjectTableGet(b *testing.B) {
	tab := newObjectTable()
	m := map[string]*object{}
	keys := make([]string, 1<<20)
	for i := range keys {
		keys[i] = fmt.Sprintf("kv/xxh3-64/m/t/%016x", i)
		o := allocObject(keys[i], "")
		tab.put(o)
		m[keys[i]] = o
	}
	b.Run("table", func(b *testing.B) {
		for i := range b.N {
			_ = tab.get(keys[i&(len(keys)-1)])
		}
	})
	b.Run("map", func(b *testing.B) {
		for i := range b.N {
			_ = m[keys[i&(len(keys)-1)]]
		}
	})
}

// TestObjectLease: a record keeps the latest lease end granted, rounded
// up to the millisecond, and reads it back the same on either side of the
// 2^32 ms wrap of its clock.
func TestObjectLease(t *testing.T) {
	const wrap = int64(1<<32) * 1e6 // ns at which the ms count wraps
	for _, now := range []int64{1_700_000_000e9, wrap - 3e9, wrap, wrap + 5e6, 17 * wrap} {
		o := allocObject("k", "")
		if got := o.leaseEnd(now); got != 0 {
			t.Fatalf("now %d: unleased record ends a lease at %d", now, got)
		}
		o.leaseUntil(now + 10e9 + 1) // 10 s and a nanosecond: rounds up a ms
		o.leaseUntil(now + 2e9)      // a shorter one does not shorten it
		want := now/1e6*1e6 + 10e9 + 1e6
		if now%1e6 != 0 {
			want += 1e6
		}
		if got := o.leaseEnd(now); got != want {
			t.Fatalf("now %d: lease ends at %d, want %d", now, got, want)
		}
		if got := o.leaseEnd(now + 20e9); got != want {
			t.Fatalf("now %d: read 20 s later, lease ends at %d, want %d", now, got, want)
		}
	}
}
