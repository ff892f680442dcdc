package master

import (
	"fmt"
	"testing"
	"time"
)

// TestReview18FollowerKeepsStaleEvents shows that a master that loses
// leadership keeps listing the events of its old term: events is never
// cleared when leadership goes, so a follower's status page shows a
// "Recent events" table ("m0 became the leader", ...) that is not the
// leader's and not recent, and a master that wins again does not start
// with its own election as events.go says. Fixed: setLeader resets them.
func TestReview18FollowerKeepsStaleEvents(t *testing.T) {
	c := newCluster(t, 3, nil)
	old := c.leader()
	if len(old.srv.Events()) == 0 {
		t.Fatal("the leader has no election event")
	}
	if err := old.srv.raft.LeadershipTransfer().Error(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 15*time.Second, "another leader", func() error {
		if l := c.leader(); l == old {
			return fmt.Errorf("%s still leads", old.srv.cfg.ID)
		}
		return nil
	})
	if ev := old.srv.Events(); len(ev) != 0 {
		t.Errorf("follower %s lists %d events of its past leadership, newest %q", old.srv.cfg.ID, len(ev), ev[0].Text)
	}
}

// TestReview18EvictionRoundsFlushEvents shows that one eviction event per
// segment per round (the sweep runs every second, and again at most every
// 50 ms after a spilled put) pushes a store declared dead out of the 64
// kept events within about a minute of a full pool evicting, the steady
// state of a KV cache: the page's "stores declared dead, elections" are
// gone when an operator looks. Fixed: a segment's rounds merge.
func TestReview18EvictionRoundsFlushEvents(t *testing.T) {
	var e events
	t0 := time.Unix(1000, 0)
	e.add(t0, "store", "store s3 silent for 10s, declared dead")
	for i := range 64 { // one full DRAM segment, one sweep a second
		e.evicted(t0.Add(time.Duration(i+1)*time.Second), "s1/dram0@1", 12, 49152)
	}
	found := false
	for _, ev := range e.newest() {
		found = found || ev.Kind == "store"
	}
	if !found {
		t.Errorf("a store declared dead 64 s ago is no longer listed: %d eviction rounds pushed it out", 64)
	}
}
