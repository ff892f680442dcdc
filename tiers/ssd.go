package tiers

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/engine/directio"
)

// SSDTier is a preallocated file on a disk: dir/<name>.data, capacity bytes
// long, read and written with pread and pwrite through a second fd opened
// with O_DIRECT: straight between the caller's buffer and the disk when the
// offset, length and buffer address are all multiples of 4096, else through
// an aligned bounce buffer (package engine/directio), so the tier's bytes
// never sit in the page cache. A write that does not start on a block, and
// every access where the filesystem refuses O_DIRECT (tmpfs on older
// kernels), goes through the page cache.
//
// The segment is not Mapped: the server stages payloads through a buffer. It
// is Shareable and FileBacked, so same-host clients pread and pwrite the file
// themselves (the engine's file transport).
//
// Next to the data file, dir/<name>.index/ holds the SSDIndex of the objects
// on the tier, so that a restarted store re-adopts them. The data file is
// kept as is across restarts; one of another size is refused, never resized.
//
// SSDTier is safe for concurrent use. Close waits for accesses in progress;
// accesses after Close fail with engine.ErrClosed.
type SSDTier struct {
	name     string
	path     string // the data file
	capacity int64
	index    *SSDIndex

	mu struct {
		sync.RWMutex     // read-held by every access, held by Close
		fd           int // buffered, O_RDWR; -1 after Close
		direct       int // O_DIRECT, or -1
		closed       bool
	}

	// Accesses served through each path, for tests and status.
	// Accesses through each path: O_DIRECT from the caller's buffer, O_DIRECT
	// through an aligned bounce buffer, the page cache.
	nDirect, nBounced, nBuffered atomic.Int64
	// directRefused is set once O_DIRECT answered EINVAL: the disk wants
	// more alignment than ssdAlign, so every later access goes buffered
	// instead of paying for a refused attempt first.
	directRefused atomic.Bool
}

var (
	_ Tier              = (*SSDTier)(nil)
	_ engine.Segment    = (*SSDTier)(nil)
	_ engine.Shareable  = (*SSDTier)(nil)
	_ engine.FileBacked = (*SSDTier)(nil)
)

// ssdAlign is the block of O_DIRECT: an access on whole blocks from an
// aligned buffer needs no bounce.
const ssdAlign = directio.Align

// NewSSD opens the SSD tier name in dir, creating dir, the data file and the
// index as needed. A new data file is preallocated to capacity bytes
// (fallocate, or ftruncate where the filesystem cannot preallocate), and the
// index of a new data file starts empty. An existing data file must be
// exactly capacity bytes: its bytes and index are kept.
func NewSSD(name, dir string, capacity int64) (*SSDTier, error) {
	if name == "" || len(name) > engine.MaxSegmentName || strings.ContainsAny(name, "/\x00") {
		return nil, fmt.Errorf("ssd tier %q: name must be 1..%d bytes without '/'", name, engine.MaxSegmentName)
	}
	if capacity <= 0 {
		return nil, fmt.Errorf("ssd tier %q: capacity must be positive, got %d", name, capacity)
	}
	if dir == "" {
		return nil, fmt.Errorf("ssd tier %q: no directory given", name)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("ssd tier %q: %w", name, err)
	}
	// The index first: pebble locks its directory, so a second process
	// opening this tier stops here, before it touches the data file.
	index, err := openSSDIndex(name, filepath.Join(dir, name+".index"), capacity)
	if err != nil {
		return nil, err
	}
	t := &SSDTier{name: name, path: filepath.Join(dir, name+".data"), capacity: capacity, index: index}
	fd, created, err := openDataFile(name, t.path, capacity)
	if err != nil {
		return nil, errors.Join(err, index.Close())
	}
	if created {
		// Entries left from an earlier data file describe bytes that are gone.
		if err := index.Replace(nil); err != nil {
			return nil, errors.Join(err, unix.Close(fd), index.Close())
		}
	}
	t.mu.fd, t.mu.direct = fd, -1
	if d, err := unix.Open(t.path, unix.O_RDWR|unix.O_DIRECT|unix.O_CLOEXEC, 0); err == nil {
		t.mu.direct = d
	}
	return t, nil
}

// openDataFile opens the data file at path, or creates it preallocated to
// capacity bytes; created reports which.
func openDataFile(name, path string, capacity int64) (fd int, created bool, err error) {
	st, err := os.Stat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		fd, err := createDataFile(name, path, capacity)
		return fd, err == nil, err
	case err != nil:
		return -1, false, fmt.Errorf("ssd tier %q: %w", name, err)
	case !st.Mode().IsRegular():
		return -1, false, fmt.Errorf("ssd tier %q: %s is not a regular file (%v)", name, path, st.Mode().Type())
	case st.Size() != capacity:
		return -1, false, fmt.Errorf("ssd tier %q: %s is %d bytes but the tier's capacity is %d; "+
			"a tier is never resized, as that would lose or misplace its objects: "+
			"set the capacity back to %d, or remove %s and %s to start the tier empty",
			name, path, st.Size(), capacity, st.Size(), path, strings.TrimSuffix(path, ".data")+".index")
	}
	fd, err = unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, false, fmt.Errorf("ssd tier %q: open %s: %w", name, path, err)
	}
	return fd, false, nil
}

// createDataFile preallocates the data file under a temporary name and renames
// it into place, so a crash never leaves a data file of the wrong size.
func createDataFile(name, path string, capacity int64) (int, error) {
	tmp := path + ".tmp"
	fd, err := unix.Open(tmp, unix.O_RDWR|unix.O_CREAT|unix.O_TRUNC|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return -1, fmt.Errorf("ssd tier %q: create %s: %w", name, tmp, err)
	}
	fail := func(err error) (int, error) {
		_ = unix.Close(fd)
		_ = os.Remove(tmp)
		return -1, fmt.Errorf("ssd tier %q: %w", name, err)
	}
	if err := preallocate(fd, capacity); err != nil {
		hint := ""
		if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EFBIG) {
			hint = " (free space on the filesystem, or lower the capacity)"
		}
		return fail(fmt.Errorf("preallocate %d bytes for %s%s: %w", capacity, path, hint, err))
	}
	if err := unix.Fsync(fd); err != nil {
		return fail(fmt.Errorf("sync %s: %w", tmp, err))
	}
	if err := os.Rename(tmp, path); err != nil {
		return fail(err)
	}
	if err := syncDir(filepath.Dir(path)); err != nil {
		_ = unix.Close(fd)
		return -1, fmt.Errorf("ssd tier %q: %w", name, err)
	}
	return fd, nil
}

// fallocate is unix.Fallocate; tests replace it to exercise the fallback.
var fallocate = unix.Fallocate

// preallocate reserves capacity bytes for fd, so writes never fail for space;
// where the filesystem cannot (EOPNOTSUPP), it only sets the size.
func preallocate(fd int, capacity int64) error {
	for {
		err := fallocate(fd, 0, 0, capacity)
		switch {
		case err == unix.EINTR:
			continue
		case errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS):
			return unix.Ftruncate(fd, capacity)
		}
		return err
	}
}

func syncDir(dir string) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", dir, err)
	}
	err = unix.Fsync(fd)
	if cerr := unix.Close(fd); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	return nil
}

func (t *SSDTier) Kind() Kind              { return SSD }
func (t *SSDTier) Name() string            { return t.name }
func (t *SSDTier) Capacity() int64         { return t.capacity }
func (t *SSDTier) Size() int64             { return t.capacity }
func (t *SSDTier) Segment() engine.Segment { return t }

// Path is the tier's data file.
func (t *SSDTier) Path() string { return t.path }

// Index is the index of the objects on the tier.
func (t *SSDTier) Index() *SSDIndex { return t.index }

// FileBacked reports true: same-host peers pread and pwrite the tier's file.
func (t *SSDTier) FileBacked() bool { return true }

// ShareFD returns the buffered fd of the data file; -1 after Close.
func (t *SSDTier) ShareFD() int {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.mu.fd
}

// DirectIO reports whether aligned accesses go through O_DIRECT, that is,
// whether the filesystem accepted an O_DIRECT open of the data file.
func (t *SSDTier) DirectIO() bool {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.mu.direct >= 0
}

// String describes the tier, for example
// "ssd0 (ssd file /data/ssd0.data, 1073741824 bytes, O_DIRECT when aligned)".
func (t *SSDTier) String() string {
	how := "O_DIRECT when aligned"
	if !t.DirectIO() {
		how = "buffered only"
	}
	return fmt.Sprintf("%s (ssd file %s, %d bytes, %s)", t.name, t.path, t.capacity, how)
}

// ReadAt reads len(p) bytes at off. It never returns a short read: a range
// that does not fit fails with ErrOutOfRange.
func (t *SSDTier) ReadAt(p []byte, off int64) (int, error) { return t.access(false, p, off) }

// WriteAt writes p at off. It does not sync: see Sync.
func (t *SSDTier) WriteAt(p []byte, off int64) (int, error) { return t.access(true, p, off) }

func (t *SSDTier) access(write bool, p []byte, off int64) (int, error) {
	if off < 0 || off > t.capacity-int64(len(p)) {
		return 0, fmt.Errorf("%w: %d bytes at %d in %d", ErrOutOfRange, len(p), off, t.capacity)
	}
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.mu.closed {
		return 0, fmt.Errorf("ssd tier %q: %w", t.name, engine.ErrClosed)
	}
	if len(p) == 0 {
		return 0, nil
	}
	var err error
	var bounced bool
	direct := t.mu.direct >= 0 && !t.directRefused.Load()
	if direct {
		if write {
			bounced, err = directio.WriteAt(t.mu.direct, p, off, t.capacity)
		} else {
			bounced, err = directio.ReadAt(t.mu.direct, p, off)
		}
		switch {
		case errors.Is(err, directio.ErrUnaligned):
			direct = false // a write that does not start on a block
		case errors.Is(err, unix.EINVAL):
			// The disk wants more alignment than directio.Align. The
			// access is idempotent, so it is safe to do it again through
			// the page cache.
			direct = false
			t.directRefused.Store(true)
		}
	}
	switch {
	case !direct:
		err = directio.All(t.mu.fd, write, p, off)
		t.nBuffered.Add(1)
	case bounced:
		t.nBounced.Add(1)
	default:
		t.nDirect.Add(1)
	}
	if err != nil {
		what := "read"
		if write {
			what = "write"
		}
		return 0, fmt.Errorf("ssd tier %q: %s %d bytes at %d: %w", t.name, what, len(p), off, err)
	}
	return len(p), nil
}

// Sync flushes written bytes to the disk (fdatasync).
func (t *SSDTier) Sync() error {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.mu.closed {
		return fmt.Errorf("ssd tier %q: %w", t.name, engine.ErrClosed)
	}
	if err := unix.Fdatasync(t.mu.fd); err != nil {
		return fmt.Errorf("ssd tier %q: sync %s: %w", t.name, t.path, err)
	}
	return nil
}

// Close syncs the data file, closes it and closes the index; it waits for
// accesses in progress. The engine must no longer serve the segment. Closing
// again does nothing.
func (t *SSDTier) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.mu.closed {
		return nil
	}
	t.mu.closed = true
	var errs []error
	if err := unix.Fdatasync(t.mu.fd); err != nil {
		errs = append(errs, fmt.Errorf("sync %s: %w", t.path, err))
	}
	if t.mu.direct >= 0 {
		errs = append(errs, unix.Close(t.mu.direct))
	}
	errs = append(errs, unix.Close(t.mu.fd), t.index.Close())
	t.mu.fd, t.mu.direct = -1, -1
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("ssd tier %q: close: %w", t.name, err)
	}
	return nil
}
