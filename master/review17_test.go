package master

import (
	"testing"
	"time"
)

// TestReview17HoldCoversStepDownLag: a put ending in a new leader's first
// lease TTL, on a key removed then (its tomb lasts to the leader's
// evictable horizon, LeaseTTL + stepDownLag after it took over), is held
// until that horizon: holdMs caps the hold at one LeaseTTL, which ends
// stepDownLag before the last lookup lease an old, cut-off leader may have
// granted.
func TestReview17HoldCoversStepDownLag(t *testing.T) {
	s := &Server{cfg: Config{LeaseTTL: 10 * time.Second}}
	now := time.Now()
	s.mu.leader, s.mu.leaderSince = true, now
	until := s.leadership().evictable // what cachedEnds gives an older object's tomb
	got := time.Duration(s.holdMs(until.UnixNano(), now.UnixNano())) * time.Millisecond
	if want := until.Sub(now); got < want {
		t.Fatalf("put held %v, but the removed incarnation may be answered from a lookup cache for %v", got, want)
	}
}
