package master

import (
	"fmt"
	"testing"
	"time"
)

// TestEventsKeepsTheNewest: the list is newest first and keeps the last
// maxEvents.
func TestEventsKeepsTheNewest(t *testing.T) {
	for _, n := range []int{0, 1, maxEvents - 1, maxEvents, maxEvents + 5, 3*maxEvents + 1} {
		var e events
		t0 := time.Unix(1000, 0)
		for i := range n {
			e.add(t0.Add(time.Duration(i)*time.Second), "eviction", "round %d", i)
		}
		got := e.list()
		if want := min(n, maxEvents); len(got) != want {
			t.Fatalf("%d added: %d listed, want %d", n, len(got), want)
		}
		for j, ev := range got {
			if i := n - 1 - j; ev.Text != fmt.Sprintf("round %d", i) || !ev.At.Equal(t0.Add(time.Duration(i)*time.Second)) {
				t.Fatalf("%d added: event %d is %+v, want round %d", n, j, ev, i)
			}
		}
	}
}
