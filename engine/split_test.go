package engine

import "testing"

func TestSplit(t *testing.T) {
	const MiB = 1 << 20
	tests := []struct {
		n, ways int
		want    []int // span sizes
	}{
		{0, 4, []int{0}},
		{1, 4, []int{1}},
		{MiB, 4, []int{MiB}},
		{MiB + 1, 4, []int{MiB + 1}}, // 1-byte tail merged
		{3 * MiB / 2, 4, []int{MiB, MiB / 2}},
		{8 * MiB, 4, []int{2 * MiB, 2 * MiB, 2 * MiB, 2 * MiB}},
		{16 * MiB, 4, []int{4 * MiB, 4 * MiB, 4 * MiB, 4 * MiB}},
		{17 * MiB, 4, []int{4 * MiB, 4 * MiB, 4 * MiB, 4 * MiB, MiB}},
		{16*MiB + MiB/2, 4, []int{4 * MiB, 4 * MiB, 4 * MiB, 4*MiB + MiB/2}}, // tail merged
		{8 * MiB, 1, []int{4 * MiB, 4 * MiB}},
		{8 * MiB, 0, []int{4 * MiB, 4 * MiB}},
	}
	for _, tt := range tests {
		spans := split(tt.n, tt.ways)
		off := 0
		ok := len(spans) == len(tt.want)
		for i, s := range spans {
			if s.off != off || (ok && s.n != tt.want[i]) {
				ok = false
			}
			off += s.n
		}
		if !ok || off != tt.n {
			t.Errorf("split(%d, %d) = %v, want sizes %v", tt.n, tt.ways, spans, tt.want)
		}
	}
}
