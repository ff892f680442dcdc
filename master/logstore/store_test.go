package logstore

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/hashicorp/raft"
)

func openTestStore(t testing.TB, dir string) *Store {
	t.Helper()
	s, err := Open(dir)
	if err != nil {
		t.Fatalf("Open(%q): %v", dir, err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func testLog(index uint64) *raft.Log {
	return &raft.Log{
		Index:      index,
		Term:       index/10 + 1,
		Type:       raft.LogCommand,
		Data:       fmt.Appendf(nil, "data-%d", index),
		Extensions: fmt.Appendf(nil, "ext-%d", index),
		AppendedAt: time.Unix(1_700_000_000, int64(index)),
	}
}

func testLogs(lo, hi uint64) []*raft.Log {
	var logs []*raft.Log
	for i := lo; i <= hi; i++ {
		logs = append(logs, testLog(i))
	}
	return logs
}

func logsEqual(a, b *raft.Log) bool {
	return a.Index == b.Index && a.Term == b.Term && a.Type == b.Type &&
		bytes.Equal(a.Data, b.Data) && bytes.Equal(a.Extensions, b.Extensions) &&
		a.AppendedAt.Equal(b.AppendedAt)
}

func checkBounds(t *testing.T, s *Store, wantFirst, wantLast uint64) {
	t.Helper()
	first, err := s.FirstIndex()
	if err != nil || first != wantFirst {
		t.Errorf("FirstIndex() = %d, %v; want %d, nil", first, err, wantFirst)
	}
	last, err := s.LastIndex()
	if err != nil || last != wantLast {
		t.Errorf("LastIndex() = %d, %v; want %d, nil", last, err, wantLast)
	}
}

func TestEmptyStore(t *testing.T) {
	s := openTestStore(t, t.TempDir())
	checkBounds(t, s, 0, 0)
	var l raft.Log
	if err := s.GetLog(1, &l); !errors.Is(err, raft.ErrLogNotFound) {
		t.Errorf("GetLog(1) on empty store = %v; want ErrLogNotFound", err)
	}
}

func TestStoreAndGetLog(t *testing.T) {
	tests := []struct {
		name string
		log  *raft.Log
	}{
		{"all fields", testLog(1)},
		{"zero values", &raft.Log{Index: 2}},
		{"configuration", &raft.Log{Index: 3, Term: 7, Type: raft.LogConfiguration, Data: []byte{0, 1, 2}}},
		{"max values", &raft.Log{Index: 1<<64 - 1, Term: 1<<64 - 1, Type: raft.LogType(255),
			Data: bytes.Repeat([]byte{0xff}, 1<<16), AppendedAt: time.Unix(0, -1)}},
	}
	s := openTestStore(t, t.TempDir())
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := s.StoreLog(tt.log); err != nil {
				t.Fatalf("StoreLog: %v", err)
			}
			var got raft.Log
			if err := s.GetLog(tt.log.Index, &got); err != nil {
				t.Fatalf("GetLog: %v", err)
			}
			if !logsEqual(&got, tt.log) {
				t.Errorf("GetLog = %+v; want %+v", got, *tt.log)
			}
		})
	}
}

func TestStoreLogs(t *testing.T) {
	s := openTestStore(t, t.TempDir())
	if err := s.StoreLogs(nil); err != nil {
		t.Fatalf("StoreLogs(nil): %v", err)
	}
	checkBounds(t, s, 0, 0)

	if err := s.StoreLogs(testLogs(5, 20)); err != nil {
		t.Fatalf("StoreLogs: %v", err)
	}
	checkBounds(t, s, 5, 20)
	// Out-of-order and overlapping writes still yield correct bounds.
	if err := s.StoreLogs([]*raft.Log{testLog(25), testLog(3), testLog(10)}); err != nil {
		t.Fatalf("StoreLogs: %v", err)
	}
	checkBounds(t, s, 3, 25)

	for _, i := range []uint64{3, 5, 12, 20, 25} {
		var got raft.Log
		if err := s.GetLog(i, &got); err != nil {
			t.Fatalf("GetLog(%d): %v", i, err)
		}
		if want := testLog(i); !logsEqual(&got, want) {
			t.Errorf("GetLog(%d) = %+v; want %+v", i, got, *want)
		}
	}
	for _, i := range []uint64{1, 4, 21, 24, 26} {
		var got raft.Log
		if err := s.GetLog(i, &got); !errors.Is(err, raft.ErrLogNotFound) {
			t.Errorf("GetLog(%d) = %v; want ErrLogNotFound", i, err)
		}
	}
}

func TestDeleteRange(t *testing.T) {
	tests := []struct {
		name        string
		lo, hi      uint64
		first, last uint64
	}{
		{"head", 1, 5, 6, 10},
		{"tail", 8, 10, 1, 7},
		{"middle", 4, 6, 1, 10},
		{"all", 1, 10, 0, 0},
		{"beyond both ends", 0, 1<<64 - 1, 0, 0},
		{"empty range", 5, 4, 1, 10},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := openTestStore(t, t.TempDir())
			if err := s.StoreLogs(testLogs(1, 10)); err != nil {
				t.Fatal(err)
			}
			if err := s.DeleteRange(tt.lo, tt.hi); err != nil {
				t.Fatalf("DeleteRange(%d, %d): %v", tt.lo, tt.hi, err)
			}
			checkBounds(t, s, tt.first, tt.last)
			for i := uint64(1); i <= 10; i++ {
				var l raft.Log
				err := s.GetLog(i, &l)
				deleted := tt.lo <= i && i <= tt.hi
				switch {
				case deleted && !errors.Is(err, raft.ErrLogNotFound):
					t.Errorf("GetLog(%d) = %v; want ErrLogNotFound", i, err)
				case !deleted && err != nil:
					t.Errorf("GetLog(%d) = %v; want entry", i, err)
				}
			}
		})
	}
}

func TestDeleteRangeWithGap(t *testing.T) {
	s := openTestStore(t, t.TempDir())
	if err := s.StoreLogs(append(testLogs(1, 5), testLogs(20, 25)...)); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteRange(1, 5); err != nil {
		t.Fatal(err)
	}
	checkBounds(t, s, 20, 25)
	if err := s.DeleteRange(22, 25); err != nil {
		t.Fatal(err)
	}
	checkBounds(t, s, 20, 21)
}

func TestStable(t *testing.T) {
	s := openTestStore(t, t.TempDir())

	if v, err := s.Get([]byte("missing")); err == nil || err.Error() != "not found" || v != nil {
		t.Errorf(`Get(missing) = %q, %v; want nil, "not found"`, v, err)
	}
	if v, err := s.GetUint64([]byte("missing")); err != nil || v != 0 {
		t.Errorf("GetUint64(missing) = %d, %v; want 0, nil", v, err)
	}

	tests := []struct {
		key, val []byte
	}{
		{[]byte("LastVoteCand"), []byte("node-1")},
		{[]byte("empty"), []byte{}},
		{[]byte{}, []byte("empty key")},
		{[]byte{0xff, 0}, bytes.Repeat([]byte{7}, 4096)},
	}
	for _, tt := range tests {
		if err := s.Set(tt.key, tt.val); err != nil {
			t.Fatalf("Set(%q): %v", tt.key, err)
		}
	}
	for _, tt := range tests {
		got, err := s.Get(tt.key)
		if err != nil || !bytes.Equal(got, tt.val) {
			t.Errorf("Get(%q) = %q, %v; want %q, nil", tt.key, got, err, tt.val)
		}
	}
	// Overwrite.
	if err := s.Set([]byte("LastVoteCand"), []byte("node-2")); err != nil {
		t.Fatal(err)
	}
	if got, err := s.Get([]byte("LastVoteCand")); err != nil || string(got) != "node-2" {
		t.Errorf("Get after overwrite = %q, %v; want node-2", got, err)
	}

	for _, v := range []uint64{0, 1, 42, 1<<64 - 1} {
		if err := s.SetUint64([]byte("CurrentTerm"), v); err != nil {
			t.Fatal(err)
		}
		if got, err := s.GetUint64([]byte("CurrentTerm")); err != nil || got != v {
			t.Errorf("GetUint64 = %d, %v; want %d, nil", got, err, v)
		}
	}
	// A non-uint64 value is reported, not misread.
	if _, err := s.GetUint64([]byte("LastVoteCand")); err == nil {
		t.Error("GetUint64 of a 6-byte value: want error")
	}
	// Stable keys do not leak into the log.
	checkBounds(t, s, 0, 0)
}

func TestReopen(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.StoreLogs(testLogs(1, 50)); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteRange(1, 9); err != nil {
		t.Fatal(err)
	}
	if err := s.Set([]byte("k"), []byte("v")); err != nil {
		t.Fatal(err)
	}
	if err := s.SetUint64([]byte("term"), 9); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}

	s = openTestStore(t, dir)
	checkBounds(t, s, 10, 50)
	for i := uint64(1); i <= 50; i++ {
		var got raft.Log
		err := s.GetLog(i, &got)
		if i < 10 {
			if !errors.Is(err, raft.ErrLogNotFound) {
				t.Errorf("GetLog(%d) = %v; want ErrLogNotFound", i, err)
			}
			continue
		}
		if err != nil || !logsEqual(&got, testLog(i)) {
			t.Errorf("GetLog(%d) = %+v, %v; want %+v", i, got, err, *testLog(i))
		}
	}
	if v, err := s.Get([]byte("k")); err != nil || string(v) != "v" {
		t.Errorf("Get(k) = %q, %v; want v", v, err)
	}
	if v, err := s.GetUint64([]byte("term")); err != nil || v != 9 {
		t.Errorf("GetUint64(term) = %d, %v; want 9", v, err)
	}
}

func TestDecodeCorrupt(t *testing.T) {
	valid := appendLog(nil, testLog(300))
	tests := []struct {
		name string
		in   []byte
	}{
		{"nil", nil},
		{"unknown version", append([]byte{logVersion + 1}, valid[1:]...)},
		{"trailing bytes", append(slices.Clone(valid), 0)},
		{"overlong uvarint", append([]byte{logVersion}, bytes.Repeat([]byte{0xff}, 11)...)},
		{"huge data length", appendHugeLen()},
	}
	for n := range len(valid) {
		tests = append(tests, struct {
			name string
			in   []byte
		}{fmt.Sprintf("truncated to %d", n), valid[:n]})
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := raft.Log{Index: 77}
			if err := decodeLog(tt.in, &l); err == nil {
				t.Fatalf("decodeLog(%x) succeeded: %+v", tt.in, l)
			}
			if l.Index != 77 {
				t.Errorf("decodeLog modified its output on error: %+v", l)
			}
		})
	}
}

// appendHugeLen encodes a header whose Data length exceeds the input.
func appendHugeLen() []byte {
	b := appendLog(nil, &raft.Log{Index: 1})
	b = b[:len(b)-2] // drop the empty Data and Extensions lengths
	b = append(b, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01)
	return append(b, "short"...)
}

func TestGetLogCorruptValue(t *testing.T) {
	s := openTestStore(t, t.TempDir())
	tests := []struct {
		name  string
		index uint64
		val   []byte
	}{
		{"garbage", 1, []byte("garbage")},
		{"wrong index", 2, appendLog(nil, testLog(3))},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := s.db.Set(logKey(tt.index), tt.val, pebble.Sync); err != nil {
				t.Fatal(err)
			}
			var l raft.Log
			err := s.GetLog(tt.index, &l)
			if err == nil || errors.Is(err, raft.ErrLogNotFound) {
				t.Errorf("GetLog(%d) = %v; want a decoding error", tt.index, err)
			}
		})
	}
}

func FuzzDecodeLog(f *testing.F) {
	f.Add(appendLog(nil, testLog(1)))
	f.Add(appendLog(nil, &raft.Log{}))
	f.Add([]byte{logVersion, 0xff})
	f.Add(appendLog(nil, &raft.Log{Index: 1 << 63, Term: 1 << 40, AppendedAt: time.Unix(-5, 0), Data: make([]byte, 300)}))
	f.Fuzz(func(t *testing.T, b []byte) {
		var l raft.Log
		if decodeLog(b, &l) != nil {
			return
		}
		// Whatever decodes must round-trip, and StoreLogs's room for it
		// (logLen) must be its length.
		var again raft.Log
		enc := appendLog(nil, &l)
		if err := decodeLog(enc, &again); err != nil || !logsEqual(&l, &again) {
			t.Fatalf("round trip of %+v: %+v, %v", l, again, err)
		}
		if n := logLen(&l); n != len(enc) {
			t.Fatalf("logLen(%+v) = %d; encoded %d bytes", l, n, len(enc))
		}
	})
}

// testFSM records the data of every applied command.
type testFSM struct {
	mu      sync.Mutex
	applied []string
}

func (f *testFSM) Apply(l *raft.Log) any {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.applied = append(f.applied, string(l.Data))
	return len(f.applied)
}

func (f *testFSM) entries() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.applied)
}

func (f *testFSM) Snapshot() (raft.FSMSnapshot, error) {
	return fsmSnapshot{}, nil
}

func (f *testFSM) Restore(rc io.ReadCloser) error {
	return rc.Close()
}

// fsmSnapshot is empty: the test never takes snapshots.
type fsmSnapshot struct{}

func (fsmSnapshot) Persist(sink raft.SnapshotSink) error { return sink.Close() }
func (fsmSnapshot) Release()                             {}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// startRaft runs a single-node raft on the store in dir.
func startRaft(t *testing.T, dir string, bootstrap bool) (*raft.Raft, *testFSM, *Store) {
	t.Helper()
	store, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	conf := raft.DefaultConfig()
	conf.LocalID = "node1"
	conf.HeartbeatTimeout = 50 * time.Millisecond
	conf.ElectionTimeout = 50 * time.Millisecond
	conf.LeaderLeaseTimeout = 50 * time.Millisecond
	conf.CommitTimeout = 5 * time.Millisecond
	conf.SnapshotThreshold = 1 << 30 // never snapshot: replay must come from the log
	conf.LogOutput = io.Discard
	addr, trans := raft.NewInmemTransport("")
	fsm := &testFSM{}

	if bootstrap {
		cfg := raft.Configuration{Servers: []raft.Server{{ID: conf.LocalID, Address: addr}}}
		if err := raft.BootstrapCluster(conf, store, store, raft.NewInmemSnapshotStore(), trans, cfg); err != nil {
			t.Fatalf("BootstrapCluster: %v", err)
		}
	}
	r, err := raft.NewRaft(conf, fsm, store, store, raft.NewInmemSnapshotStore(), trans)
	if err != nil {
		t.Fatalf("NewRaft: %v", err)
	}
	waitFor(t, "leadership", func() bool { return r.State() == raft.Leader })
	return r, fsm, store
}

func stopRaft(t *testing.T, r *raft.Raft, s *Store) {
	t.Helper()
	if err := r.Shutdown().Error(); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
}

func TestRaftReplayAfterRestart(t *testing.T) {
	dir := t.TempDir()
	want := []string{"a", "b", "c", "d", "e"}

	r, fsm, store := startRaft(t, dir, true)
	for _, cmd := range want {
		if err := r.Apply([]byte(cmd), 5*time.Second).Error(); err != nil {
			t.Fatalf("Apply(%q): %v", cmd, err)
		}
	}
	if got := fsm.entries(); !slices.Equal(got, want) {
		t.Fatalf("applied %q; want %q", got, want)
	}
	stopRaft(t, r, store)

	r, fsm, store = startRaft(t, dir, false)
	defer stopRaft(t, r, store)
	waitFor(t, "log replay", func() bool { return len(fsm.entries()) >= len(want) })
	if got := fsm.entries(); !slices.Equal(got, want) {
		t.Errorf("replayed %q; want %q", got, want)
	}
	if term, err := store.GetUint64([]byte("CurrentTerm")); err != nil || term < 2 {
		t.Errorf("CurrentTerm after restart = %d, %v; want >= 2", term, err)
	}
}

func BenchmarkStoreLogs(b *testing.B) {
	const batch, size = 64, 1 << 10
	s := openTestStore(b, b.TempDir())
	data := bytes.Repeat([]byte{'x'}, size)
	logs := make([]*raft.Log, batch)
	for i := range logs {
		logs[i] = &raft.Log{Term: 1, Type: raft.LogCommand, Data: data, AppendedAt: time.Now()}
	}
	b.SetBytes(batch * size)
	b.ReportAllocs()
	var next uint64 = 1
	for b.Loop() {
		for _, l := range logs {
			l.Index = next
			next++
		}
		if err := s.StoreLogs(logs); err != nil {
			b.Fatal(err)
		}
	}
}

// TestOpenPrimesWAL checks that commits after Open overwrite a WAL file
// written in full (pebble recycled it) rather than grow a new one, on a
// fresh store and on one reopened with a log in it.
func TestOpenPrimesWAL(t *testing.T) {
	dir := t.TempDir()
	for _, round := range []string{"fresh", "reopened"} {
		s, err := Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		w := s.db.Metrics().WAL
		if w.Files != 1 || w.PhysicalSize < memTableSize || w.Size >= memTableSize/4 {
			t.Errorf("%s: live WAL: %d files, %d bytes on disk, %d written: want one file of at least %d bytes, little of it live",
				round, w.Files, w.PhysicalSize, w.Size, memTableSize)
		}
		if w.ObsoleteFiles < 1 || w.ObsoletePhysicalSize < memTableSize {
			t.Errorf("%s: %d WAL files (%d bytes) to recycle next; want one of at least %d bytes", round, w.ObsoleteFiles, w.ObsoletePhysicalSize, memTableSize)
		}
		if err := s.StoreLogs(testLogs(1, 20)); err != nil {
			t.Fatal(err)
		}
		checkBounds(t, s, 1, 20)
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// The WAL files a primed store writes its log into are recycled files of
// a full memtable's log or more from the first commit on, however many
// memtables the log has filled since: none grows as it is written.
func TestPrimedWALStaysRecycled(t *testing.T) {
	s, err := Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	data := make([]byte, 500)
	idx := uint64(1)
	for written := 0; written < 4*memTableSize; {
		var logs []*raft.Log
		for range 64 {
			logs = append(logs, &raft.Log{Index: idx, Term: 1, Type: raft.LogCommand, Data: data})
			idx++
			written += len(data)
		}
		if err := s.StoreLogs(logs); err != nil {
			t.Fatal(err)
		}
		if w := s.db.Metrics().WAL; w.PhysicalSize < memTableSize || w.Size > w.PhysicalSize {
			t.Fatalf("after %d bytes of log the live WAL holds %d bytes in a file of %d: want a recycled file of at least %d", written, w.Size, w.PhysicalSize, memTableSize)
		}
	}
}

// TestOpenInUse: an Open of a directory another process holds says so,
// rather than pebble's bare "resource temporarily unavailable".
func TestOpenInUse(t *testing.T) {
	dir := t.TempDir()
	holder := exec.Command(os.Args[0], "-test.run=^TestHoldOpen$")
	holder.Env = append(os.Environ(), holdEnv+"="+dir)
	stdin, err := holder.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := holder.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { stdin.Close(); _ = holder.Wait() }()
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "held\n" {
		t.Fatalf("holder: %q, %v", line, err)
	}
	_, err = Open(dir)
	if !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), "in use by another process") {
		t.Fatalf("Open of a directory another process holds: %v, want ErrInUse", err)
	}
}

// holdEnv names the directory TestHoldOpen holds, in a child process of
// TestOpenInUse, until its stdin closes.
const holdEnv = "LOGSTORE_TEST_HOLD"

func TestHoldOpen(t *testing.T) {
	dir := os.Getenv(holdEnv)
	if dir == "" {
		t.Skip("a helper of TestOpenInUse")
	}
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	fmt.Println("held")
	_, _ = io.Copy(io.Discard, os.Stdin)
}

// TestStagedLogsServedUntilUnstaged: staged entries are read through
// GetLog before they are stored, without counting in LastIndex, and from
// the log once stored and unstaged.
func TestStagedLogsServedUntilUnstaged(t *testing.T) {
	s := openTestStore(t, t.TempDir())
	if err := s.StoreLogs(testLogs(1, 4)); err != nil {
		t.Fatal(err)
	}
	staged := testLogs(5, 7)
	s.StageLogs(staged)
	read := func(when string, lo, hi uint64) {
		t.Helper()
		for i := lo; i <= hi; i++ {
			var got raft.Log
			if err := s.GetLog(i, &got); err != nil || !logsEqual(&got, testLog(i)) {
				t.Fatalf("GetLog(%d) %s = %+v, %v", i, when, got, err)
			}
		}
	}
	read("while staged", 1, 7)
	var got raft.Log
	if err := s.GetLog(8, &got); !errors.Is(err, raft.ErrLogNotFound) {
		t.Fatalf("GetLog(8) = %v, want ErrLogNotFound", err)
	}
	checkBounds(t, s, 1, 4)
	if err := s.StoreLogs(staged); err != nil {
		t.Fatal(err)
	}
	checkBounds(t, s, 1, 7)
	read("stored and staged", 1, 7)
	s.StageLogs(nil)
	read("stored", 1, 7)
	// A stage a failed write leaves is gone once unstaged.
	s.StageLogs(testLogs(8, 9))
	read("staged again", 8, 9)
	s.StageLogs(nil)
	if err := s.GetLog(8, &got); !errors.Is(err, raft.ErrLogNotFound) {
		t.Fatalf("GetLog(8) after unstaging = %v, want ErrLogNotFound", err)
	}
}

// Entries just stored are read back from memory (recent); a follower's
// truncation and rewrite of a suffix must not leave the old ones readable,
// and entries past the recent window still come from pebble.
func TestRecentLogsFollowRewrites(t *testing.T) {
	s := openTestStore(t, t.TempDir())
	if err := s.StoreLogs(testLogs(1, 2*recentLogs)); err != nil {
		t.Fatal(err)
	}
	for _, i := range []uint64{1, recentLogs, 2 * recentLogs} {
		var l raft.Log
		if err := s.GetLog(i, &l); err != nil || !logsEqual(&l, testLog(i)) {
			t.Fatalf("GetLog(%d) = %+v, %v; want %+v", i, l, err, testLog(i))
		}
	}
	last := uint64(2 * recentLogs)
	if err := s.DeleteRange(last-2, last); err != nil {
		t.Fatal(err)
	}
	var l raft.Log
	if err := s.GetLog(last, &l); !errors.Is(err, raft.ErrLogNotFound) {
		t.Fatalf("GetLog(%d) after DeleteRange = %v; want ErrLogNotFound", last, err)
	}
	rewrite := testLog(last - 1)
	rewrite.Term += 5
	rewrite.Data = []byte("the new leader's entry")
	if err := s.StoreLogs([]*raft.Log{rewrite}); err != nil {
		t.Fatal(err)
	}
	if err := s.GetLog(last-1, &l); err != nil || !logsEqual(&l, rewrite) {
		t.Fatalf("GetLog(%d) = %+v, %v; want the rewritten %+v", last-1, l, err, rewrite)
	}
	l.Term = 0 // a caller's copy, not the store's
	if err := s.GetLog(last-1, &l); err != nil || l.Term != rewrite.Term {
		t.Fatalf("GetLog(%d) after the caller changed its copy = term %d, %v; want %d", last-1, l.Term, err, rewrite.Term)
	}
}

func BenchmarkGetLog(b *testing.B) {
	s := openTestStore(b, b.TempDir())
	if err := s.StoreLogs(testLogs(1, 2*recentLogs)); err != nil {
		b.Fatal(err)
	}
	for _, bc := range []struct {
		name  string
		index uint64
	}{{"recent", 2 * recentLogs}, {"stored", 1}} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			var l raft.Log
			for b.Loop() {
				if err := s.GetLog(bc.index, &l); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
