package kvevents

import (
	"fmt"
	"reflect"
	"testing"

	"github.com/tidepool-kv/tidepool/client/kvhash"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

const (
	hbm  = pb.Tier_TIER_HBM
	dram = pb.Tier_TIER_DRAM
	ssd  = pb.Tier_TIER_SSD
)

// keyOf is the key of block i of model's namespace (xxh3-64: the hash is
// i itself).
func keyOf(model string, i uint64) string {
	return kvhash.Namespace{Scheme: kvhash.XXH3, Model: model}.Key(mustHash(fmt.Sprintf("%016x", i)))
}

// got is a batch as the tests compare it: the topic and each event as
// "KIND MEDIUM parent [hashes]".
type got struct {
	topic  string
	events []string
}

func describe(bs []batch) []got {
	var out []got
	for _, b := range bs {
		g := got{topic: b.topic}
		for _, ev := range b.events {
			switch ev.kind {
			case blockStored:
				parent := "nil"
				if ev.hasParent {
					parent = fmt.Sprint(ev.parent)
				}
				g.events = append(g.events, fmt.Sprintf("stored %s %s %v", ev.medium, parent, ev.hashes))
			case blockRemoved:
				g.events = append(g.events, fmt.Sprintf("removed %s %v", ev.medium, ev.hashes))
			case allBlocksCleared:
				g.events = append(g.events, "cleared")
			}
		}
		out = append(out, g)
	}
	return out
}

func expect(t *testing.T, b *batcher, want ...got) {
	t.Helper()
	if g := describe(b.flush(1, nil)); !reflect.DeepEqual(g, want) {
		t.Fatalf("flush:\n got %v\nwant %v", g, want)
	}
}

func TestBatcher(t *testing.T) {
	const a, m = "kv@tidepool/a@a", "kv@tidepool/m@m"
	b := newBatcher()

	// A chain of three is one event; a fourth block of another chain is
	// another, as is the chain in another tier.
	b.stored(keyOf("a", 1), "", "", dram)
	b.stored(keyOf("a", 2), keyOf("a", 1), "", dram)
	b.stored(keyOf("a", 3), keyOf("a", 2), "", dram)
	b.stored(keyOf("a", 9), keyOf("a", 1), "", dram)
	b.stored(keyOf("a", 1), "", "", hbm)
	expect(t, b, got{a, []string{"stored CPU nil [1 2 3]", "stored CPU 1 [9]", "stored GPU nil [1]"}})

	// Not a KV key, no tier: nothing. A parent of another namespace: nil.
	b.stored("some/object", "", "", dram)
	b.stored(keyOf("a", 4), "", "", pb.Tier_TIER_UNSPECIFIED)
	expect(t, b)
	b.stored(keyOf("m", 5), keyOf("a", 3), "", ssd)
	expect(t, b, got{m, []string{"stored DISK nil [5]"}})

	// A demotion: removed from one tier, stored in the next; topics in
	// the order first heard.
	b.removed(keyOf("m", 5), "", ssd)
	b.stored(keyOf("m", 5), "", "", dram)
	b.removed(keyOf("a", 1), "", hbm)
	b.removed(keyOf("a", 3), "", dram)
	b.removed(keyOf("a", 2), "", dram)
	expect(t, b,
		got{m, []string{"removed DISK [5]", "stored CPU nil [5]"}},
		got{a, []string{"removed GPU [1]", "removed CPU [3 2]"}})

	// Removing all that is left clears the topic, which is forgotten.
	b.removed(keyOf("a", 1), "", dram)
	b.removed(keyOf("a", 9), "", dram)
	expect(t, b, got{a, []string{"cleared"}})
	if _, ok := b.topics[a]; ok {
		t.Fatalf("topic %s still known with no blocks", a)
	}

	// A restore clears every topic known, then stores what it restores.
	b.stored(keyOf("a", 1), "", "", dram)
	expect(t, b, got{a, []string{"stored CPU nil [1]"}})
	b.removed(keyOf("a", 1), "", dram) // superseded by the restore
	b.cleared()
	b.stored(keyOf("a", 7), "", "", ssd)
	expect(t, b,
		got{a, []string{"cleared", "stored DISK nil [7]"}},
		got{m, []string{"cleared"}})
	if len(b.topics) != 1 || b.topics[a].live != 1 {
		t.Fatalf("after the restore: %d topics, want %s alone with 1 block", len(b.topics), a)
	}
}

func TestBatcherTenants(t *testing.T) {
	b := newBatcher()
	ns := kvhash.Namespace{Scheme: kvhash.XXH3, Model: "m"}
	key := func(i uint64) string { return "acme/" + ns.Key(mustHash(fmt.Sprintf("%016x", i))) }
	b.stored(key(1), "", "acme", dram)
	b.stored(key(2), key(1), "acme", dram)
	b.stored(ns.Key(mustHash(fmt.Sprintf("%016x", 3))), "", "", dram)
	expect(t, b,
		got{"kv@tidepool/m/acme/@m", []string{"stored CPU nil [1 2]"}},
		got{"kv@tidepool/m@m", []string{"stored CPU nil [3]"}})
}

func TestBatcherSplitsLongBatches(t *testing.T) {
	b := newBatcher()
	n := uint64(2*maxBatchHashes + 10)
	b.stored(keyOf("a", 1), "", "", dram)
	for i := uint64(2); i <= n; i++ {
		b.stored(keyOf("a", i), keyOf("a", i-1), "", dram)
	}
	bs := b.flush(1, nil)
	if len(bs) != 3 {
		t.Fatalf("%d hashes made %d batches, want 3", n, len(bs))
	}
	next := uint64(1)
	for i, bt := range bs {
		ev := bt.events[0]
		if len(bt.events) != 1 || ev.hashes[0] != next || ev.hasParent != (i > 0) || (i > 0 && ev.parent != next-1) {
			t.Fatalf("batch %d: %+v, want a run from %d with parent %d", i, bt.events, next, next-1)
		}
		next += uint64(len(ev.hashes))
	}
	if next != n+1 {
		t.Fatalf("batches hold hashes up to %d, want %d", next-1, n)
	}
}

func TestSplit(t *testing.T) {
	ev := func(k kind, hashes ...uint64) event { return event{kind: k, hashes: hashes} }
	parts := split([]event{ev(allBlocksCleared), ev(blockRemoved, 1, 2, 3), ev(blockStored, 4, 5), ev(allBlocksCleared)}, 2)
	want := [][]event{
		{ev(allBlocksCleared), ev(blockRemoved, 1)},
		{ev(blockRemoved, 2, 3)},
		{ev(blockStored, 4, 5)},
		{ev(allBlocksCleared)},
	}
	if !reflect.DeepEqual(parts, want) {
		t.Fatalf("split = %+v, want %+v", parts, want)
	}
}
