package logstore

import (
	"errors"
	"testing"

	"github.com/hashicorp/raft"
)

// TestReview22RecentAgreesWithDisk pins that what GetLog serves from the
// recent ring is what pebble holds, index by index, after stores that
// overwrite entries without a DeleteRange, a prefix compaction, and a
// reopen (which empties the ring). Passes.
func TestReview22RecentAgreesWithDisk(t *testing.T) {
	dir := t.TempDir()
	s := openTestStore(t, dir)
	const last = 3 * recentLogs
	want := map[uint64]*raft.Log{}
	if err := s.StoreLogs(testLogs(1, last)); err != nil {
		t.Fatal(err)
	}
	for _, l := range testLogs(1, last) {
		want[l.Index] = l
	}
	var rewrite []*raft.Log
	for i := uint64(last - 20); i <= last; i++ {
		l := testLog(i)
		l.Term += 7
		l.Data = append(l.Data, "-rewritten"...)
		rewrite = append(rewrite, l)
		want[i] = l
	}
	if err := s.StoreLogs(rewrite); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteRange(1, 100); err != nil {
		t.Fatal(err)
	}
	check := func(s *Store, when string) {
		t.Helper()
		for i := uint64(1); i <= last; i++ {
			var l raft.Log
			err := s.GetLog(i, &l)
			if i <= 100 {
				if !errors.Is(err, raft.ErrLogNotFound) {
					t.Fatalf("%s: GetLog(%d) of a compacted entry = %v", when, i, err)
				}
				continue
			}
			if err != nil || !logsEqual(&l, want[i]) {
				t.Fatalf("%s: GetLog(%d) = %+v, %v; want %+v", when, i, l, err, want[i])
			}
		}
	}
	check(s, "live")
	if err := s.StoreLogs(testLogs(last+1, last+recentLogs/2)); err != nil {
		t.Fatal(err)
	}
	for _, l := range testLogs(last+1, last+recentLogs/2) {
		want[l.Index] = l
	}
	check(s, "after more stores")
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	check(openTestStore(t, dir), "reopened")
}
