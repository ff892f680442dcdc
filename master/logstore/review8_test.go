package logstore

import (
	"bytes"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// review8CrashImage copies dir as it is on disk while the store is open:
// what a machine that lost power right now would restart from (every
// commit the store acknowledged was synced).
//
// It first waits for s's flushes and compactions to end: a copy file by
// file while pebble compacts is not one instant's (a table written during
// the copy can be half in it and named whole by its MANIFEST, or copied
// out of a MANIFEST that names tables deleted since: a clean make test
// once failed so).
func review8CrashImage(t *testing.T, s *Store, dir string) string {
	t.Helper()
	quiet := 0
	for deadline := time.Now().Add(10 * time.Second); quiet < 3; time.Sleep(20 * time.Millisecond) {
		if m := s.db.Metrics(); m.Compact.NumInProgress == 0 && m.Flush.NumInProgress == 0 {
			quiet++
		} else {
			quiet = 0
		}
		if time.Now().After(deadline) {
			t.Fatal("pebble still compacting after 10 s")
		}
	}
	dst := t.TempDir()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.IsDir() {
			continue
		}
		in, err := os.Open(filepath.Join(dir, e.Name()))
		if errors.Is(err, fs.ErrNotExist) {
			continue // made obsolete and deleted meanwhile (a compaction): no crash needs it
		}
		if err != nil {
			t.Fatal(err)
		}
		out, err := os.Create(filepath.Join(dst, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.Copy(out, in); err != nil {
			t.Fatal(err)
		}
		in.Close()
		out.Close()
	}
	return dst
}

func review8BigLogs(lo, hi uint64) []*raft.Log {
	logs := testLogs(lo, hi)
	for _, l := range logs {
		l.Data = bytes.Repeat([]byte{byte(l.Index)}, 4<<10)
	}
	return logs
}

func review8Check(t *testing.T, s *Store, logs []*raft.Log) {
	t.Helper()
	checkBounds(t, s, logs[0].Index, logs[len(logs)-1].Index)
	for _, want := range logs {
		var got raft.Log
		if err := s.GetLog(want.Index, &got); err != nil || !logsEqual(&got, want) {
			t.Fatalf("log %d after the crash: %v", want.Index, err)
		}
	}
}

// TestReview8CrashAfterPrime: a store that crashes after priming, with
// commits that overwrite the recycled WAL (stale filler chunks after
// them) and commits that run past it into the next recycled file, replays
// every acknowledged entry and nothing else; and a store restarted from
// that image (primed again) does so too.
func TestReview8CrashAfterPrime(t *testing.T) {
	dir := t.TempDir()
	s := openTestStore(t, dir)
	small := testLogs(1, 50)
	if err := s.StoreLogs(small); err != nil {
		t.Fatal(err)
	}
	img := review8CrashImage(t, s, dir)
	big := review8BigLogs(51, 51+2500) // ~10 MiB: past both recycled files
	for i := 0; i < len(big); i += 100 {
		if err := s.StoreLogs(big[i:min(i+100, len(big))]); err != nil {
			t.Fatal(err)
		}
	}
	img2 := review8CrashImage(t, s, dir)

	c := openTestStore(t, img)
	review8Check(t, c, small)
	if err := c.StoreLogs(testLogs(51, 60)); err != nil {
		t.Fatal(err)
	}
	img3 := review8CrashImage(t, c, img)
	c3 := openTestStore(t, img3)
	review8Check(t, c3, testLogs(1, 60))

	c2 := openTestStore(t, img2)
	review8Check(t, c2, append(small, big...))
}

// TestReview8ReopenCost: every Open writes the filler again; disk use must
// not grow with restarts, and Open stays quick. Logs what it costs.
func TestReview8ReopenCost(t *testing.T) {
	dir := t.TempDir()
	var sizes []int64
	var slowest time.Duration
	for i := range 6 {
		start := time.Now()
		s, err := Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		slowest = max(slowest, time.Since(start))
		if err := s.StoreLogs(testLogs(uint64(i*10+1), uint64(i*10+10))); err != nil {
			t.Fatal(err)
		}
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
		var total int64
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			if info, err := e.Info(); err == nil {
				total += info.Size()
			}
		}
		sizes = append(sizes, total)
	}
	t.Logf("dir size after each restart: %v bytes; slowest Open %v", sizes, slowest)
	if sizes[len(sizes)-1] > sizes[1]+1<<20 {
		t.Errorf("disk use grows with restarts: %v", sizes)
	}
	s := openTestStore(t, dir)
	checkBounds(t, s, 1, 60)
}
