package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/tiers/tierstest"
)

// smallDisk mounts a tmpfs of size bytes for the test: a disk the test can
// fill. It needs root (CI runs as root); elsewhere the test is skipped.
func smallDisk(t *testing.T, size int) string {
	t.Helper()
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, fmt.Sprintf("size=%d", size)); err != nil {
		t.Skipf("mount a tmpfs to fill (needs root): %v", err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(dir, syscall.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	return dir
}

// fillDisk writes a file until the disk is full, and returns its path.
func fillDisk(t *testing.T, dir string) string {
	t.Helper()
	path := filepath.Join(dir, "filler")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 64<<10)
	for {
		if _, err := f.Write(buf); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("fill %s: %v", dir, err)
			}
			return path
		}
	}
}

// TestRaftLogDiskFull: the disk under the raft log fills up. The master
// soon refuses writes, saying why, instead of letting them hang; it reads
// on, status says so, and once space is freed it takes writes again.
// Nothing acknowledged is lost and the process never dies.
func TestRaftLogDiskFull(t *testing.T) {
	if testing.Short() {
		t.Skip("fills a disk")
	}
	disk := smallDisk(t, 48<<20)
	var filler string
	testRaftLogDiskFault(t, disk, func() { filler = fillDisk(t, disk) }, func() {
		if err := os.Remove(filler); err != nil {
			t.Fatal(err)
		}
	})
}

// TestRaftLogDiskFailing: the disk under the leader's raft log, one of
// three, starts answering every read, write and sync with EIO (a FUSE
// filesystem the test fails). The log may have lost what it was writing,
// so that master exits, saying why, instead of serving from a log it
// cannot trust; the other two elect a leader and go on taking puts.
// Healed and restarted, it catches up. Nothing acknowledged is lost.
func TestRaftLogDiskFailing(t *testing.T) {
	disk := tierstest.MountFaultFS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	h := startMastersIn(t, ctx, []string{filepath.Join(disk.Dir, "m1"), filepath.Join(disk.Dir, "m2"), filepath.Join(disk.Dir, "m3")})
	masters := strings.Join(h.grpc, ",")
	startStore(t, ctx, "s1", masters, "dram:1GiB")
	c := newClient(t, h.grpc...)

	var acked []string
	val := func(k string) []byte { return faultValue(k, 1<<10) }
	batch := 0
	putBatch := func() error {
		keys := make([]string, 64)
		vals := make([][]byte, 64)
		for i := range keys {
			keys[i] = fmt.Sprintf("b%05d/%02d", batch, i)
			vals[i] = val(keys[i])
		}
		batch++
		pctx, pcancel := context.WithTimeout(ctx, 20*time.Second)
		defer pcancel()
		var first error
		for i, err := range c.BatchPut(pctx, keys, vals) {
			if err == nil {
				acked = append(acked, keys[i])
			} else if first == nil {
				first = err
			}
		}
		return first
	}
	for range 10 {
		if err := putBatch(); err != nil {
			t.Fatal(err)
		}
	}
	st, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var l int
	if _, err := fmt.Sscanf(st.LeaderId, "m%d", &l); err != nil || l < 1 || l > 3 {
		t.Fatalf("leader id %q", st.LeaderId)
	}
	leader := h.procs[l-1]
	disk.Fail(func(path string) bool { return strings.HasPrefix(path, st.LeaderId+"/") })
	// Puts go on (some fail while the leader changes) until it stops.
	failed := 0
	waitFor(t, 2*time.Minute, func() error {
		if err := putBatch(); err != nil {
			failed++
		}
		if !leader.exited() {
			return fmt.Errorf("%s still running", st.LeaderId)
		}
		return nil
	})
	if out := leader.out.String(); !strings.Contains(out, "the raft log's disk failed") || !strings.Contains(out, "input/output error") {
		t.Fatalf("%s exited (%v) without saying its raft log's disk failed:\n%s", st.LeaderId, leader.err, out)
	}
	for line := range strings.Lines(leader.out.String()) {
		if strings.Contains(line, "disk failed") {
			t.Logf("%s: %s", st.LeaderId, strings.TrimSpace(line))
		}
	}
	if code := leader.cmd.ProcessState.ExitCode(); code == 0 {
		t.Fatalf("%s exited with status 0 after its disk failed", st.LeaderId)
	}
	waitFor(t, time.Minute, putBatch)
	t.Logf("%s exited; %d batches failed while the leader moved", st.LeaderId, failed)

	disk.Fail(nil)
	h.restart(t, ctx, l-1)
	for range 10 {
		if err := putBatch(); err != nil {
			t.Fatalf("put after %s came back: %v", st.LeaderId, err)
		}
	}
	// It caught up: its table (the FSM, applied on every master) holds
	// every object, acknowledged or not, that the others' do.
	other := h.http[l%3]
	waitFor(t, time.Minute, func() error {
		want, err := counter(other, "tidepool_master_objects", `state="complete"`)
		if err != nil {
			return err
		}
		got, err := counter(h.http[l-1], "tidepool_master_objects", `state="complete"`)
		if err != nil || got != want || want < float64(len(acked)) {
			return fmt.Errorf("%s has %v complete objects (%v), the others %v, %d acknowledged", st.LeaderId, got, err, want, len(acked))
		}
		return nil
	})
	for chunk := range slices.Chunk(acked, 4096) {
		got, errs := c.BatchGet(ctx, chunk)
		for i, k := range chunk {
			if errs[i] != nil || !bytes.Equal(got[i], val(k)) {
				t.Fatalf("acknowledged %s: %d bytes, %v", k, len(got[i]), errs[i])
			}
		}
	}
	t.Logf("%d puts acknowledged, all read back", len(acked))
}

// testRaftLogDiskFault runs a master whose raft log is under disk, puts,
// breaks the disk, checks that writes are refused while reads go on, heals
// it, and checks that writes resume and every acknowledged put reads back.
func testRaftLogDiskFault(t *testing.T, disk string, breakDisk, heal func()) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	m := startMaster(t, ctx, filepath.Join(disk, "master"))
	startStore(t, ctx, "s1", m.grpc, "dram:1GiB")
	c := newClient(t, m.grpc)

	var acked []string
	val := func(k string) []byte { return faultValue(k, 1<<10) }
	batch := 0
	putBatch := func(timeout time.Duration) error {
		keys := make([]string, 64)
		vals := make([][]byte, 64)
		for i := range keys {
			keys[i] = fmt.Sprintf("b%05d/%02d", batch, i)
			vals[i] = val(keys[i])
		}
		batch++
		pctx, pcancel := context.WithTimeout(ctx, timeout)
		defer pcancel()
		var first error
		for i, err := range c.BatchPut(pctx, keys, vals) {
			if err == nil {
				acked = append(acked, keys[i])
			} else if first == nil {
				first = err
			}
		}
		return first
	}
	for range 10 {
		if err := putBatch(10 * time.Second); err != nil {
			t.Fatal(err)
		}
	}
	breakDisk()

	// Commits go on into the WAL, written ahead, until a memtable must be
	// flushed; from then on the master refuses writes at once.
	var refused error
	waitFor(t, 2*time.Minute, func() error {
		start := time.Now()
		var err error
		for range 50 {
			if err = putBatch(20 * time.Second); err != nil {
				break
			}
		}
		if err == nil {
			return errors.New("puts still succeed")
		}
		if !strings.Contains(err.Error(), "raft log's disk is full or failing") {
			return fmt.Errorf("a put failed for another reason after %v: %v", time.Since(start), err)
		}
		refused = err
		return nil
	})
	t.Logf("refused: %v", refused)
	st := string(mustCLI(t, ctx, nil, "status", "--masters", m.grpc).stdout)
	if !strings.Contains(st, "refusing writes: the raft log's disk is full or failing") {
		t.Fatalf("status does not say writes are refused:\n%s", st)
	}
	if n, err := counter(m.http, "tidepool_master_raft_log_disk_failing"); err != nil || n != 1 {
		t.Fatalf("tidepool_master_raft_log_disk_failing = %v, %v; want 1", n, err)
	}
	// Reads go on.
	if got, err := c.Get(ctx, acked[0]); err != nil || !bytes.Equal(got, val(acked[0])) {
		t.Fatalf("get while the disk is full: %d bytes, %v", len(got), err)
	}

	heal()
	waitFor(t, time.Minute, func() error { return putBatch(10 * time.Second) })
	if m.exited() {
		t.Fatalf("the master exited: %v", m.err)
	}
	for chunk := range slices.Chunk(acked, 4096) {
		got, errs := c.BatchGet(ctx, chunk)
		for i, k := range chunk {
			if errs[i] != nil || !bytes.Equal(got[i], val(k)) {
				t.Fatalf("acknowledged %s: %d bytes, %v", k, len(got[i]), errs[i])
			}
		}
	}
	t.Logf("%d puts acknowledged, all read back", len(acked))
}
