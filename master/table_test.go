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
	if keys, wantKeys := tab.sortedKeys(), slices.Sorted(maps.Keys(want)); !slices.Equal(keys, wantKeys) {
		t.Fatalf("sortedKeys: %d keys, want the %d of the map in order", len(keys), len(wantKeys))
	}
	n := 0
	for si := range tableShards {
		tab.inShard(si, func(o *object) bool {
			if want[o.key()] != o {
				t.Fatalf("shard %d yielded %q, not in the map", si, o.key())
			}
			n++
			return true
		})
	}
	if n != len(want) {
		t.Fatalf("the shards yielded %d objects, want %d", n, len(want))
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
