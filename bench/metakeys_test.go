package bench

import (
	"fmt"
	"testing"
)

// TestMetaKeys: keys are the prefix and a sequence number of at least nine
// digits, numbered on across calls.
func TestMetaKeys(t *testing.T) {
	m := &meta{cfg: MetaConfig{Prefix: "p/"}}
	var got []string
	for _, n := range []int{1, 3, 0, 2} {
		got = append(got, m.keys(n)...)
	}
	m.mu.seq = 99_999_998
	got = append(got, m.keys(3)...)
	var want []string
	for i := range 6 {
		want = append(want, fmt.Sprintf("p/%09d", i))
	}
	want = append(want, "p/099999998", "p/099999999", "p/100000000")
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("keys %q, want %q", got, want)
	}
	if len(m.mu.put) != len(want) {
		t.Fatalf("%d keys to remove, want %d", len(m.mu.put), len(want))
	}
}
