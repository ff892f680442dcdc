package client

import (
	"fmt"
	"hash/maphash"
	"testing"
)

// TestCacheMarks: a key is marked once handed to the cache, and only then
// (but for the hashes it shares with marked keys).
func TestCacheMarks(t *testing.T) {
	m := &cacheMarks{seed: maphash.MakeSeed()}
	if m.marked("a") {
		t.Fatal("a key never cached is marked")
	}
	m.mark("a")
	if !m.marked("a") {
		t.Fatal("a cached key is not marked")
	}
	n := 0
	for i := range 1000 {
		if m.marked(fmt.Sprint("b", i)) {
			n++
		}
	}
	if n > 1 {
		t.Fatalf("%d of 1000 keys never cached are marked, after one key", n)
	}
}
