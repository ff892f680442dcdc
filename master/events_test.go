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
			e.add(t0.Add(time.Duration(i)*time.Second), "drain", "drain %d", i)
		}
		got := e.newest()
		if want := min(n, maxEvents); len(got) != want {
			t.Fatalf("%d added: %d listed, want %d", n, len(got), want)
		}
		for j, ev := range got {
			if i := n - 1 - j; ev.Text != fmt.Sprintf("drain %d", i) || !ev.At.Equal(t0.Add(time.Duration(i)*time.Second)) {
				t.Fatalf("%d added: event %d is %+v, want drain %d", n, j, ev, i)
			}
		}
	}
}

// TestEventsMergeEvictionRounds: a segment's eviction rounds within a
// minute of its first make one event, moved up with each round, so a pool
// that evicts every sweep keeps its other events listed.
func TestEventsMergeEvictionRounds(t *testing.T) {
	var e events
	t0 := time.Unix(1000, 0)
	e.add(t0, "store", "store s3 silent for 10s, declared dead")
	for i := range 50 {
		at := t0.Add(time.Duration(i+1) * time.Second)
		e.evicted(at, "s1/dram0@1", 2, 100)
		e.evicted(at, "s2/dram0@1", 1, 10)
	}
	got := e.newest()
	want := []string{
		"evicted 50 objects (500 bytes) from s2/dram0@1 to its watermark in 50 rounds over 49s",
		"evicted 100 objects (5000 bytes) from s1/dram0@1 to its watermark in 50 rounds over 49s",
		"store s3 silent for 10s, declared dead",
	}
	if len(got) != len(want) {
		t.Fatalf("%d events: %+v", len(got), got)
	}
	for i := range want {
		if got[i].Text != want[i] {
			t.Errorf("event %d: %q, want %q", i, got[i].Text, want[i])
		}
	}
	// A round a minute after a segment's first starts a new event.
	e.evicted(t0.Add(61*time.Second), "s1/dram0@1", 3, 30)
	if got := e.newest(); len(got) != 4 || got[0].Text != "evicted 3 objects (30 bytes) from s1/dram0@1 to its watermark" {
		t.Errorf("after a minute: %+v", got)
	}
	e.reset()
	if got := e.newest(); len(got) != 0 {
		t.Errorf("after reset: %+v", got)
	}
}
