package logstore

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/hashicorp/raft"
)

var (
	_ raft.LogStore    = (*Store)(nil)
	_ raft.StableStore = (*Store)(nil)
	_ raft.LogStager   = (*Store)(nil)
)

// ErrInUse is returned by Open when another process has the directory open.
var ErrInUse = errors.New("directory in use")

// Store is a raft.LogStore and raft.StableStore backed by a pebble DB.
// It is safe for concurrent use.
type Store struct {
	db     *pebble.DB
	closed atomic.Bool

	// writeMu serializes writers so that the cached bounds in mu are
	// updated in the same order as the commits they describe (raft calls
	// StoreLogs and DeleteRange from different goroutines).
	writeMu sync.Mutex

	mu struct {
		sync.RWMutex
		// first and last are the lowest and highest stored log indexes,
		// both 0 when the log is empty.
		first, last uint64
		// staged are the entries a leader is writing, consecutive, which
		// GetLog serves (see StageLogs); nil when none.
		staged []*raft.Log
		// recent holds the last entries stored, each at its index modulo
		// the length: raft reads an entry back right after it is written
		// (a follower to apply it, the leader's replicators when they wake
		// after the write), and a pebble read decodes and copies it.
		recent [recentLogs]*raft.Log
	}

	disk diskHealth

	// fatal receives the error pebble could not go on after (see
	// stopLogger).
	fatal chan error
}

// diskHealth is what pebble's flushes say of the disk. A flush that fails
// (a disk full or failing) is retried by pebble while commits go on into
// the WAL, whose files are written ahead (see primeWAL), until the
// memtables fill and every commit stalls. The error stays until a flush
// succeeds again, so the master can refuse writes at once, saying why,
// rather than let them time out. Only flushes count: pebble retries a
// failed one by itself, so its success always comes to clear the error,
// whereas other background errors (a compaction, table statistics, a
// statfs) would leave nothing to clear them once writes are refused.
type diskHealth struct {
	mu    sync.Mutex
	err   error
	since time.Time
	fails int
}

func (h *diskHealth) failed(err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.err == nil {
		h.since = time.Now()
	}
	h.err = err
	h.fails++
}

// flushed records a flush's outcome. One that wrote no table ends with
// pebble's (unexported) "empty table" error, and it succeeded.
func (h *diskHealth) flushed(info pebble.FlushInfo) {
	if !info.Done {
		return
	}
	if info.Err != nil && info.Err.Error() != "pebble: empty table" {
		h.failed(info.Err)
		return
	}
	h.mu.Lock()
	h.err, h.fails = nil, 0
	h.mu.Unlock()
}

// DiskError reports the error of the last failed flush, when
// the failing started and how many failed, while no flush has succeeded
// since; nil while the disk is healthy.
func (s *Store) DiskError() (err error, since time.Time, fails int) {
	s.disk.mu.Lock()
	defer s.disk.mu.Unlock()
	return s.disk.err, s.disk.since, s.disk.fails
}

// recentLogs is how many of the last stored entries GetLog serves from
// memory: a few hundred KiB to a few MiB of batch entries.
const recentLogs = 128

// memTableSize is pebble's memtable, and so about how much log a WAL file
// holds before pebble moves to the next.
const memTableSize = 4 << 20

// Open opens or creates a Store in dir.
func Open(dir string) (*Store, error) {
	s := &Store{fatal: make(chan error, 1)}
	opts := &pebble.Options{
		// The raft log is write-mostly and reads hit recent entries, which
		// live in the memtable; keep memory use modest.
		CacheSize:          8 << 20,
		MemTableSize:       memTableSize,
		FormatMajorVersion: pebble.FormatNewest,
		Logger:             stopLogger{pebble.DefaultLogger, s.fatal},
		// Not pebble's logging listener: a full disk made it print each
		// retry, thousands a second. The master reports DiskError.
		EventListener: &pebble.EventListener{FlushEnd: s.disk.flushed},
	}
	db, err := pebble.Open(dir, opts)
	if errors.Is(err, syscall.EAGAIN) { // pebble's lock on the directory
		return nil, fmt.Errorf("logstore: %s is in use by another process (a tidepool master or up on the same --dir?): %w", dir, ErrInUse)
	}
	if err != nil {
		return nil, fmt.Errorf("logstore: opening %s: %w", dir, err)
	}
	s.db = db
	first, last, err := s.bounds()
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	s.mu.first, s.mu.last = first, last
	if err := s.primeWAL(); err != nil {
		_ = db.Close()
		return nil, err
	}
	return s, nil
}

// primeWAL has the WAL files that commits go to written in full before
// they are, as PostgreSQL fills its WAL segments with zeros: an fdatasync
// after a write that grows a file also commits the file's new size to the
// journal, and after one that overwrites written bytes it does not (on
// this kind of machine a raft commit took 0.12 ms against 0.16 ms).
// Pebble overwrites a WAL file only when it recycles one its DB instance
// wrote and made obsolete, and a recycled file keeps the size it had. Its
// memtables start at 256 KiB and double at each flush of one more than
// half full, up to memTableSize, and each memtable has a WAL file of its
// own: left alone, a fresh master's first WAL files are small, its
// commits outrun the recycling (every file of the log grew as it was
// written, for the first tens of MiB of log) and the small files stay in
// the recycling for good. So each priming round fills most of a memtable
// with keys of its own and its WAL file to a bit more than a full
// memtable's log (filler that is never read: pebble's LogData), and
// flushes: after primeRounds the memtable has its full size and the files
// to recycle are all large. It costs about 40 MiB of writes and 0.1-0.2 s
// at open; the keys are deleted after.
func (s *Store) primeWAL() error {
	value := make([]byte, 64<<10)
	mem := 256 << 10 // pebble's first memtable
	for range primeRounds {
		b := s.db.NewBatch()
		n := 0
		for i := 0; n < mem*6/10; i++ {
			if err := b.Set([]byte{primePrefix, byte(i >> 8), byte(i)}, value, nil); err != nil {
				return fmt.Errorf("logstore: priming the WAL: %w", err)
			}
			n += len(value)
		}
		for ; n < memTableSize+1<<20; n += len(value) {
			if err := b.LogData(value, nil); err != nil {
				return fmt.Errorf("logstore: priming the WAL: %w", err)
			}
		}
		if err := b.Commit(pebble.NoSync); err != nil {
			return fmt.Errorf("logstore: priming the WAL: %w", err)
		}
		if err := s.db.Flush(); err != nil {
			return fmt.Errorf("logstore: priming the WAL: %w", err)
		}
		mem = min(2*mem, memTableSize)
	}
	if err := s.db.DeleteRange([]byte{primePrefix}, []byte{primePrefix + 1}, pebble.NoSync); err != nil {
		return fmt.Errorf("logstore: priming the WAL: %w", err)
	}
	return nil
}

// primeRounds is how many WAL files primeWAL writes: pebble's memtable
// takes five flushes to grow from 256 KiB to 4 MiB, and it recycles up
// to three files (MemTableStopWritesThreshold + 1).
const primeRounds = 8

// Close closes the underlying DB. Calling Close more than once is a no-op.
func (s *Store) Close() error {
	if !s.closed.CompareAndSwap(false, true) {
		return nil
	}
	return s.db.Close()
}

// FirstIndex implements raft.LogStore.
func (s *Store) FirstIndex() (uint64, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.mu.first, nil
}

// LastIndex implements raft.LogStore.
func (s *Store) LastIndex() (uint64, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.mu.last, nil
}

// GetLog implements raft.LogStore. It returns raft.ErrLogNotFound if there
// is no entry at index.
func (s *Store) GetLog(index uint64, l *raft.Log) error {
	s.mu.RLock()
	if st := s.mu.staged; len(st) > 0 && index >= st[0].Index && index <= st[len(st)-1].Index {
		*l = *st[index-st[0].Index]
		s.mu.RUnlock()
		return nil
	}
	if r := s.mu.recent[index%recentLogs]; r != nil && r.Index == index {
		*l = *r
		s.mu.RUnlock()
		return nil
	}
	s.mu.RUnlock()
	v, closer, err := s.db.Get(logKey(index))
	if errors.Is(err, pebble.ErrNotFound) {
		return raft.ErrLogNotFound
	}
	if err != nil {
		return fmt.Errorf("logstore: reading log %d: %w", index, err)
	}
	defer closer.Close()
	var out raft.Log
	if err := decodeLog(v, &out); err != nil {
		return fmt.Errorf("logstore: log %d: %w", index, err)
	}
	if out.Index != index {
		return fmt.Errorf("logstore: log key %d holds entry with index %d", index, out.Index)
	}
	*l = out
	return nil
}

// StageLogs implements raft.LogStager (our fork of hashicorp/raft,
// third_party/raft): GetLog serves logs, as well as what is stored, until
// the next StageLogs, so raft sends them to the followers while its
// leader writes them.
func (s *Store) StageLogs(logs []*raft.Log) {
	s.mu.Lock()
	s.mu.staged = logs
	s.mu.Unlock()
}

// StoreLog implements raft.LogStore.
func (s *Store) StoreLog(l *raft.Log) error {
	return s.StoreLogs([]*raft.Log{l})
}

// StoreLogs implements raft.LogStore. All entries are written in a single
// synced batch.
func (s *Store) StoreLogs(logs []*raft.Log) error {
	if len(logs) == 0 {
		return nil
	}
	b := s.db.NewBatch()
	defer b.Close()
	lo, hi := logs[0].Index, logs[0].Index
	for _, l := range logs {
		// Encoded in place in the batch, with no copy between.
		op := b.SetDeferred(logKeyLen, logLen(l))
		putLogKey(op.Key, l.Index)
		if n := len(appendLog(op.Value[:0], l)); n != len(op.Value) {
			return fmt.Errorf("logstore: log %d encodes to %d bytes, not %d", l.Index, n, len(op.Value))
		}
		if err := op.Finish(); err != nil {
			return fmt.Errorf("logstore: batching log %d: %w", l.Index, err)
		}
		lo, hi = min(lo, l.Index), max(hi, l.Index)
	}

	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	if err := b.Commit(pebble.Sync); err != nil {
		return fmt.Errorf("logstore: committing logs %d-%d: %w", lo, hi, err)
	}
	s.mu.Lock()
	if s.mu.first == 0 || lo < s.mu.first {
		s.mu.first = lo
	}
	s.mu.last = max(s.mu.last, hi)
	for _, l := range logs {
		s.mu.recent[l.Index%recentLogs] = l
	}
	s.mu.Unlock()
	return nil
}

// DeleteRange implements raft.LogStore. The range [lo, hi] is inclusive.
func (s *Store) DeleteRange(lo, hi uint64) error {
	if lo > hi {
		return nil
	}
	b := s.db.NewBatch()
	defer b.Close()
	end := []byte{logPrefix + 1} // past every log key, for hi == MaxUint64
	if hi < ^uint64(0) {
		end = logKey(hi + 1)
	}
	if err := b.DeleteRange(logKey(lo), end, nil); err != nil {
		return fmt.Errorf("logstore: batching delete %d-%d: %w", lo, hi, err)
	}

	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	// Forgotten first, so no error below leaves deleted entries served.
	s.mu.Lock()
	s.mu.recent = [recentLogs]*raft.Log{} // rare: compaction or a follower's conflict
	s.mu.Unlock()
	if err := b.Commit(pebble.Sync); err != nil {
		return fmt.Errorf("logstore: deleting logs %d-%d: %w", lo, hi, err)
	}
	// The log may have gaps, so recompute the bounds rather than derive
	// them from lo and hi.
	first, last, err := s.bounds()
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.mu.first, s.mu.last = first, last
	s.mu.Unlock()
	return nil
}

// bounds reads the lowest and highest log indexes from the DB.
func (s *Store) bounds() (first, last uint64, err error) {
	it, err := s.db.NewIter(&pebble.IterOptions{
		LowerBound: []byte{logPrefix},
		UpperBound: []byte{logPrefix + 1},
	})
	if err != nil {
		return 0, 0, fmt.Errorf("logstore: %w", err)
	}
	defer it.Close()
	if it.First() {
		if first, err = parseLogKey(it.Key()); err != nil {
			return 0, 0, err
		}
	}
	if it.Last() {
		if last, err = parseLogKey(it.Key()); err != nil {
			return 0, 0, err
		}
	}
	if err := it.Error(); err != nil {
		return 0, 0, fmt.Errorf("logstore: scanning log bounds: %w", err)
	}
	return first, last, nil
}

// Set implements raft.StableStore.
func (s *Store) Set(key, val []byte) error {
	if err := s.db.Set(stableKey(key), val, pebble.Sync); err != nil {
		return fmt.Errorf("logstore: setting %q: %w", key, err)
	}
	return nil
}

// Get implements raft.StableStore. A missing key yields an error whose text
// is exactly "not found": raft compares err.Error() against that string.
func (s *Store) Get(key []byte) ([]byte, error) {
	v, closer, err := s.db.Get(stableKey(key))
	if errors.Is(err, pebble.ErrNotFound) {
		return nil, errors.New("not found")
	}
	if err != nil {
		return nil, fmt.Errorf("logstore: getting %q: %w", key, err)
	}
	defer closer.Close()
	return append([]byte{}, v...), nil
}

// SetUint64 implements raft.StableStore. The value shares the key space of
// Set and is stored as 8 big-endian bytes.
func (s *Store) SetUint64(key []byte, val uint64) error {
	return s.Set(key, binary.BigEndian.AppendUint64(nil, val))
}

// GetUint64 implements raft.StableStore. Like raft's InmemStore, a missing
// key yields 0 and no error.
func (s *Store) GetUint64(key []byte) (uint64, error) {
	v, closer, err := s.db.Get(stableKey(key))
	if errors.Is(err, pebble.ErrNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("logstore: getting %q: %w", key, err)
	}
	defer closer.Close()
	if len(v) != 8 {
		return 0, fmt.Errorf("logstore: value of %q is %d bytes, not a uint64", key, len(v))
	}
	return binary.BigEndian.Uint64(v), nil
}

// stopLogger drops pebble's chatty informational messages and keeps its
// errors. Pebble calls Fatalf where it cannot go on, such as a WAL write or
// sync that failed with EIO: the log may have lost what it was writing,
// and after a failed fsync the kernel may have dropped the dirty pages, so
// retrying proves nothing. Fatalf must not return; instead of pebble's
// os.Exit it hands the error to Fatal and parks the calling goroutine, so
// the process's owner logs why and exits, as a database must on such an
// error (PostgreSQL and etcd do the same).
type stopLogger struct {
	pebble.Logger
	fatal chan<- error
}

func (stopLogger) Infof(string, ...any) {}

func (l stopLogger) Fatalf(format string, args ...any) {
	select {
	case l.fatal <- fmt.Errorf(format, args...):
	default: // one is enough
	}
	select {}
}

// Fatal receives the error, if one comes, after which pebble, and so this
// store, cannot go on: the raft log's disk failed under a write. A
// goroutine that met it is parked for good, so Close may hang; the owner
// should exit the process, and restart it once the disk is healthy.
func (s *Store) Fatal() <-chan error { return s.fatal }
