package engine

import (
	"math/rand/v2"
	"testing"
)

func TestSliceSize(t *testing.T) {
	const KiB, MiB = 1 << 10, 1 << 20
	tests := []struct{ n, want int }{
		{0, 64 * KiB},
		{1, 64 * KiB},
		{4 * MiB, 64 * KiB},        // exactly 64 slices of the base
		{4*MiB + 1, 128 * KiB},     // 65 base slices: ceil(n/64) rounded up to 64 KiB
		{64 * MiB, MiB},            // n/64 is already a multiple of 64 KiB
		{100 * MiB, 1600 * KiB},    // so is 100 MiB/64 = 25 x 64 KiB
		{100_000_000, 1536 * KiB},  // 1,562,500 rounded up to 24 x 64 KiB
		{64*MiB + 1, MiB + 64*KiB}, // one byte more rounds up a whole 64 KiB
	}
	for _, tt := range tests {
		if got := sliceSize(tt.n); got != tt.want {
			t.Errorf("sliceSize(%d) = %d, want %d", tt.n, got, tt.want)
		}
	}
}

func TestCutSlices(t *testing.T) {
	const KiB, MiB = 1 << 10, 1 << 20
	repeat := func(size, times int, tail ...int) []int {
		var out []int
		for range times {
			out = append(out, size)
		}
		return append(out, tail...)
	}
	tests := []struct {
		name string
		n    int
		want []int // slice sizes
	}{
		{"empty", 0, []int{0}},
		{"one byte", 1, []int{1}},
		{"one base slice", 64 * KiB, []int{64 * KiB}},
		{"tail merged", 64*KiB + 1, []int{64*KiB + 1}},
		{"tail just under a quarter merged", 80*KiB - 1, []int{80*KiB - 1}},
		{"tail of exactly a quarter kept", 80 * KiB, []int{64 * KiB, 16 * KiB}},
		{"4 MiB", 4 * MiB, repeat(64*KiB, 64)},
		{"4 MiB + 1", 4*MiB + 1, repeat(128*KiB, 31, 128*KiB+1)},
		{"64 MiB", 64 * MiB, repeat(MiB, 64)},
		{"100 MiB", 100 * MiB, repeat(1600*KiB, 64)},
		// 100 MB: 1536 KiB slices (rounded up), 63 full ones and a 900,032-byte tail (over a
		// quarter, kept).
		{"100 MB rounded up", 100_000_000, repeat(1536*KiB, 63, 100_000_000-63*1536*KiB)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := cutSlices(tt.n)
			checkSpans(t, tt.n, got)
			if len(got) != len(tt.want) {
				t.Fatalf("cutSlices(%d): %d slices, want %d", tt.n, len(got), len(tt.want))
			}
			for i, s := range got {
				if s.n != tt.want[i] {
					t.Fatalf("cutSlices(%d)[%d].n = %d, want %d", tt.n, i, s.n, tt.want[i])
				}
			}
		})
	}
}

// TestCutSlicesProperties checks, over random sizes, that slices cover [0, n) contiguously, that
// there are at most maxSlices, all but the last of one size, the last under 1.25 slices.
func TestCutSlicesProperties(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		var n int
		switch r.IntN(3) {
		case 0:
			n = r.IntN(256 << 10)
		case 1:
			n = r.IntN(16 << 20)
		default:
			n = r.IntN(1 << 30)
		}
		spans := cutSlices(n)
		checkSpans(t, n, spans)
		size := sliceSize(n)
		if size%sliceBase != 0 || len(spans) > maxSlices {
			t.Fatalf("cutSlices(%d): %d slices of %d", n, len(spans), size)
		}
		for i, s := range spans[:len(spans)-1] {
			if s.n != size {
				t.Fatalf("cutSlices(%d)[%d].n = %d, want %d", n, i, s.n, size)
			}
		}
		if last := spans[len(spans)-1].n; last > size+size/4 || (len(spans) > 1 && last < size/4) {
			t.Fatalf("cutSlices(%d): last slice %d of %d", n, last, size)
		}
	}
}

func checkSpans(t *testing.T, n int, spans []span) {
	t.Helper()
	if len(spans) == 0 {
		t.Fatalf("cutSlices(%d): no spans", n)
	}
	off := 0
	for i, s := range spans {
		if s.off != off || (s.n <= 0 && n > 0) {
			t.Fatalf("cutSlices(%d)[%d] = %+v, want off %d and n > 0", n, i, s, off)
		}
		off += s.n
	}
	if off != n {
		t.Fatalf("cutSlices(%d) covers %d bytes", n, off)
	}
}
