package master

import (
	"math/rand/v2"
	"testing"
)

func TestAllocator(t *testing.T) {
	tests := []struct {
		name  string
		steps func(a *allocator, t *testing.T)
	}{
		{"aligned first fit", func(a *allocator, t *testing.T) {
			for _, want := range []uint64{0, 64, 128} {
				if off, ok := a.alloc(1); !ok || off != want {
					t.Fatalf("alloc(1) = %d, %v; want %d", off, ok, want)
				}
			}
			if a.used != 192 {
				t.Fatalf("used = %d, want 192", a.used)
			}
		}},
		{"full then free reuses", func(a *allocator, t *testing.T) {
			off, ok := a.alloc(1024)
			if !ok || off != 0 {
				t.Fatalf("alloc(1024) = %d, %v", off, ok)
			}
			if _, ok := a.alloc(1); ok {
				t.Fatal("alloc on a full segment succeeded")
			}
			a.release(0, 1024)
			if a.used != 0 || len(a.free) != 1 || a.free[0] != (span{0, 1024}) {
				t.Fatalf("after release: used %d free %v", a.used, a.free)
			}
		}},
		{"merge both neighbours", func(a *allocator, t *testing.T) {
			x, _ := a.alloc(64)
			y, _ := a.alloc(64)
			z, _ := a.alloc(64)
			a.release(x, 64)
			a.release(z, 64)
			a.release(y, 64)
			if len(a.free) != 1 || a.free[0] != (span{0, 1024}) {
				t.Fatalf("free list %v, want one span", a.free)
			}
		}},
		{"too large", func(a *allocator, t *testing.T) {
			if _, ok := a.alloc(1025); ok {
				t.Fatal("alloc beyond capacity succeeded")
			}
		}},
		{"size that overflows rounding", func(a *allocator, t *testing.T) {
			for _, n := range []uint64{1<<64 - 1, 1<<64 - 63, 1<<64 - 64} {
				if off, ok := a.alloc(n); ok {
					t.Fatalf("alloc(%d) = %d, true on a 1 KiB segment", n, off)
				}
			}
			if a.used != 0 {
				t.Fatalf("used = %d after failed allocs", a.used)
			}
		}},
		{"reserve splits", func(a *allocator, t *testing.T) {
			if err := a.reserve(128, 64); err != nil {
				t.Fatal(err)
			}
			if err := a.reserve(128, 1); err == nil {
				t.Fatal("double reserve succeeded")
			}
			if len(a.free) != 2 || a.largestFree() != 1024-192 {
				t.Fatalf("free list %v", a.free)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { tc.steps(newAllocator(1024, 64), t) })
	}
}

// TestAllocatorRandom checks that random allocs and frees never overlap and
// that everything freed comes back as one span.
func TestAllocatorRandom(t *testing.T) {
	a := newAllocator(1<<20, 64)
	rng := rand.New(rand.NewPCG(1, 2))
	live := map[uint64]uint64{}
	for i := 0; i < 5000; i++ {
		if rng.IntN(3) > 0 {
			n := uint64(rng.IntN(8192) + 1)
			if off, ok := a.alloc(n); ok {
				for o, l := range live {
					if off < o+a.rounded(l) && o < off+a.rounded(n) {
						t.Fatalf("alloc [%d,+%d) overlaps [%d,+%d)", off, n, o, l)
					}
				}
				live[off] = n
			}
			continue
		}
		for off, n := range live {
			a.release(off, n)
			delete(live, off)
			break
		}
	}
	for off, n := range live {
		a.release(off, n)
	}
	if a.used != 0 || len(a.free) != 1 || a.free[0] != (span{0, 1 << 20}) {
		t.Fatalf("after freeing everything: used %d, free %v", a.used, a.free)
	}
}
