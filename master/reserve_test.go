package master

import (
	"slices"
	"testing"
)

// TestCarve takes extents out of a reservation's spans: from the front,
// the back, the middle and whole, and refuses what it does not hold.
func TestCarve(t *testing.T) {
	spans := func() []span { return []span{{0, 100}, {200, 100}} }
	for _, tc := range []struct {
		name   string
		id     uint64
		off, n uint64
		ok     bool
		want   []span
	}{
		{"front", 1, 0, 10, true, []span{{10, 90}, {200, 100}}},
		{"back", 1, 290, 10, true, []span{{0, 100}, {200, 90}}},
		{"middle", 1, 40, 20, true, []span{{0, 40}, {60, 40}, {200, 100}}},
		{"whole", 1, 200, 100, true, []span{{0, 100}}},
		{"across two spans", 1, 90, 120, false, spans()},
		{"past a span", 1, 250, 60, false, spans()},
		{"between spans", 1, 100, 10, false, spans()},
		{"another reservation", 2, 0, 10, false, spans()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := &segment{resv: []*reservation{{id: 1, spans: spans()}}}
			if ok := s.carve(tc.id, tc.off, tc.n); ok != tc.ok {
				t.Fatalf("carve = %v, want %v", ok, tc.ok)
			}
			if got := s.resv[0].spans; !slices.Equal(got, tc.want) {
				t.Fatalf("spans %v, want %v", got, tc.want)
			}
		})
	}
	// A run published in order carves from the front without allocating.
	s := &segment{resv: []*reservation{{id: 1, spans: []span{{0, 1 << 20}}}}}
	off := uint64(0)
	if n := testing.AllocsPerRun(100, func() {
		s.carve(1, off, 4096)
		off += 4096
	}); n != 0 {
		t.Fatalf("%v allocations a carve, want 0", n)
	}
}
