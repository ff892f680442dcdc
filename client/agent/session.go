package agent

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tidepool-kv/tidepool/client"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

var (
	// ErrUnknownSession: the session was closed, ended idle, or never was.
	ErrUnknownSession = errors.New("unknown session")
	// ErrClosed: the agent is shutting down.
	ErrClosed = errors.New("agent closed")
	// ErrTooManyRegions: Attach would exceed MaxAttached.
	ErrTooManyRegions = errors.New("too many attached regions")
)

const (
	// MaxAttached is the most regions one session may attach.
	MaxAttached = 64
	// maxAttachBytes bounds one attached region: more than any host maps.
	maxAttachBytes = 1 << 50
)

// session is one process's shared-memory region, and the regions of its
// own that the process attached.
type session struct {
	id     uint64
	client string  // as the process named itself, for logs
	owner  process // the process that opened it, if the socket told
	size   uint64
	path   string // /proc/<pid>/fd/<fd>: what the process maps
	fd     int

	// mu is read-held by every request using mem or attached, write-held
	// to change them, so a region is never unmapped under a transfer.
	mu       sync.RWMutex
	mem      []byte             // nil once ended
	attached map[uint32]*region // by id, from 1
	nextID   uint32

	used   atomic.Int64 // unix nanoseconds of the last request's start or end
	active atomic.Int32 // requests using the session; raised under Server.mu
}

// region is a memfd of the session's process, attached: gets land in it and
// puts leave from it without a copy through the session's own region.
type region struct {
	mem  []byte
	fd   int
	file fileID
}

// fileID names a file, whatever path or descriptor reaches it.
type fileID struct{ dev, ino uint64 }

func fileOf(fd int) (fileID, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fileID{}, err
	}
	return fileID{uint64(st.Dev), st.Ino}, nil
}

// holds reports whether the file at path is one the session attached.
func (ss *session) holds(path string) bool {
	var st unix.Stat_t
	if unix.Stat(path, &st) != nil {
		return false
	}
	f := fileID{uint64(st.Dev), st.Ino}
	ss.mu.RLock()
	defer ss.mu.RUnlock()
	for _, r := range ss.attached {
		if r.file == f {
			return true
		}
	}
	return false
}

// isOwn reports whether f is the session's own memfd.
func (ss *session) isOwn(f fileID) bool {
	own, err := fileOf(ss.fd)
	return err == nil && own == f
}

func (r *region) close() error { return errors.Join(unix.Munmap(r.mem), unix.Close(r.fd)) }

func (ss *session) touch()              { ss.used.Store(time.Now().UnixNano()) }
func (ss *session) lastUsed() time.Time { return time.Unix(0, ss.used.Load()) }

// end unmaps the regions and closes the memfds once no request uses them.
func (ss *session) end() error {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.mem == nil {
		return nil
	}
	errs := []error{unix.Munmap(ss.mem), unix.Close(ss.fd)}
	for _, r := range ss.attached {
		errs = append(errs, r.close())
	}
	ss.mem, ss.fd, ss.attached = nil, -1, nil
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("session %d: %w", ss.id, err)
	}
	return nil
}

// span returns the bytes of sp in its region, capped at its length so
// nothing beyond it is ever touched. The caller read-holds ss.mu.
func (ss *session) span(sp *pb.Span) ([]byte, error) {
	mem := ss.mem
	if id := sp.GetRegion(); id != 0 {
		r := ss.attached[id]
		if r == nil {
			return nil, fmt.Errorf("%w: no attached region %d in session %d", client.ErrInvalidArgument, id, ss.id)
		}
		mem = r.mem
	}
	size := uint64(len(mem))
	off, n := sp.GetOffset(), sp.GetLength()
	if n > size || off > size-n {
		return nil, fmt.Errorf("%w: span of %d bytes at offset %d is outside region %d of %d bytes", client.ErrInvalidArgument, n, off, sp.GetRegion(), size)
	}
	return mem[off : off+n : off+n], nil
}

// attach maps the caller's memfd at path, which must be size bytes long,
// and returns its region id. The agent seals it against shrinking and
// growing first: a file shrunk under the agent's mapping would fault it.
func (s *Server) attach(id uint64, path string, size uint64) (uint32, error) {
	if size == 0 || size > maxAttachBytes {
		return 0, fmt.Errorf("%w: attach %d bytes: want 1 to %d", client.ErrInvalidArgument, size, uint64(maxAttachBytes))
	}
	ss, err := s.acquire(id)
	if err != nil {
		return 0, err
	}
	n := len(ss.attached)
	ss.release()
	if n >= MaxAttached && !ss.holds(path) {
		// Refused before it is opened (and sealed); a retry of what is
		// attached goes on, to answer its region.
		return 0, tooManyRegions(id, n)
	}
	r, err := mapMemfd(path, size)
	if err != nil {
		return 0, err
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	switch {
	case ss.mem == nil: // ended meanwhile
		return 0, errors.Join(unknownSession(id), r.close())
	case ss.isOwn(r.file):
		return 0, errors.Join(fmt.Errorf("%w: attach %s: that is session %d's own region", client.ErrInvalidArgument, path, id), r.close())
	}
	// The same memory again (a retry of an Attach whose answer was lost)
	// is the same region: two regions over the same bytes would defeat the
	// overlap check, two values landing in one place.
	for rid, old := range ss.attached {
		if old.file == r.file { // sealed: of the same size too
			return rid, r.close()
		}
	}
	if len(ss.attached) >= MaxAttached {
		return 0, errors.Join(tooManyRegions(id, len(ss.attached)), r.close())
	}
	if ss.attached == nil {
		ss.attached = map[uint32]*region{}
	}
	ss.nextID++
	ss.attached[ss.nextID] = r
	return ss.nextID, nil
}

func tooManyRegions(id uint64, n int) error {
	return fmt.Errorf("%w: session %d has %d attached regions, the most it may", ErrTooManyRegions, id, n)
}

// detach unmaps region rid of session id once no request uses it.
func (s *Server) detach(id uint64, rid uint32) error {
	ss, err := s.acquire(id)
	if err != nil {
		return err
	}
	ss.release()
	ss.mu.Lock()
	defer ss.mu.Unlock()
	r := ss.attached[rid]
	if r == nil {
		return fmt.Errorf("%w: no attached region %d in session %d", client.ErrNotFound, rid, id)
	}
	delete(ss.attached, rid)
	return r.close()
}

// mapMemfd opens path, checks that it is a memfd of size bytes, seals it
// against shrinking and growing and maps it shared.
func mapMemfd(path string, size uint64) (*region, error) {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: open %s: %v (a region to attach is /proc/PID/fd/N of a memfd of a process of this user)", client.ErrInvalidArgument, path, err)
	}
	fail := func(err error) (*region, error) {
		unix.Close(fd)
		return nil, err
	}
	link, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd))
	if err != nil {
		return fail(fmt.Errorf("attach %s: %w", path, err))
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fail(fmt.Errorf("attach %s: %w", path, err))
	}
	switch {
	case !strings.HasPrefix(link, "/memfd:") || st.Mode&unix.S_IFMT != unix.S_IFREG:
		return fail(fmt.Errorf("%w: attach %s: it is %q, not a memfd", client.ErrInvalidArgument, path, link))
	case uint64(st.Size) != size:
		return fail(fmt.Errorf("%w: attach %s: the memfd is %d bytes, not %d", client.ErrInvalidArgument, path, st.Size, size))
	}
	const want = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, want); err != nil {
		// Sealed already (F_SEAL_SEAL) is fine if it cannot change size.
		seals, gerr := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
		if gerr != nil || seals&want != want {
			return fail(fmt.Errorf("%w: attach %s: cannot seal it against resizing (%v): create it with MFD_ALLOW_SEALING", client.ErrInvalidArgument, path, err))
		}
	}
	// The size again, now that it cannot change: the caller may have
	// resized it between the first look and the seal, and a mapping past
	// the file's end would fault the agent.
	if err := unix.Fstat(fd, &st); err != nil || uint64(st.Size) != size {
		return fail(fmt.Errorf("%w: attach %s: the memfd is %d bytes, not %d", client.ErrInvalidArgument, path, st.Size, size))
	}
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fail(fmt.Errorf("%w: attach %s: map %d bytes read-write: %v (a memfd sealed against writes cannot be a region)", client.ErrInvalidArgument, path, size, err))
	}
	return &region{mem: mem, fd: fd, file: fileID{uint64(st.Dev), st.Ino}}, nil
}

// open creates a session with a region of size bytes.
func (s *Server) open(name string, size uint64, owner process) (*session, error) {
	if size == 0 || size > s.cfg.MaxSessionBytes {
		return nil, fmt.Errorf("%w: shm_bytes %d: want 1 to %d", client.ErrInvalidArgument, size, s.cfg.MaxSessionBytes)
	}
	fd, err := unix.MemfdCreate("tidepool-agent", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("size memfd to %d bytes: %w", size, err)
	}
	// The caller maps the region too: sealed, it cannot shrink the file
	// under the agent's mapping, which would fault the agent (SIGBUS).
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("seal memfd: %w", err)
	}
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("mmap %d bytes: %w", size, err)
	}
	// Huge pages cut TLB misses on multi-MiB KV blocks; best effort.
	_ = unix.Madvise(mem, unix.MADV_HUGEPAGE)
	ss := &session{client: name, owner: owner, size: size, fd: fd, mem: mem, path: fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), fd)}
	ss.touch()

	s.mu.Lock()
	if s.mu.closed {
		s.mu.Unlock()
		return nil, errors.Join(ErrClosed, ss.end())
	}
	if len(s.mu.sessions) >= s.cfg.MaxSessions {
		s.mu.Unlock()
		return nil, errors.Join(fmt.Errorf("%w (%d open)", ErrTooManySessions, s.cfg.MaxSessions), ss.end())
	}
	if owner.known() {
		n := 0
		for _, o := range s.mu.sessions {
			if o.owner == owner {
				n++
			}
		}
		if n >= s.cfg.MaxSessionsPerProcess {
			s.mu.Unlock()
			return nil, errors.Join(fmt.Errorf("%w (%d open by process %v)", ErrTooManySessions, n, owner), ss.end())
		}
	}
	// Random ids: a process that outlived an agent restart must not reach
	// the region of a session opened since.
	for ss.id == 0 || s.mu.sessions[ss.id] != nil {
		ss.id = rand.Uint64()
	}
	s.mu.sessions[ss.id] = ss
	s.mu.Unlock()
	return ss, nil
}

// acquire finds session id and holds it for one request; release it.
func (s *Server) acquire(id uint64) (*session, error) {
	s.mu.Lock()
	ss := s.mu.sessions[id]
	if ss != nil {
		ss.active.Add(1)
	}
	s.mu.Unlock()
	if ss == nil {
		return nil, unknownSession(id)
	}
	ss.mu.RLock()
	if ss.mem == nil { // ended by Close between the lookup and the lock
		ss.mu.RUnlock()
		ss.active.Add(-1)
		return nil, unknownSession(id)
	}
	ss.touch()
	return ss, nil
}

func (ss *session) release() {
	ss.touch()
	ss.mu.RUnlock()
	ss.active.Add(-1)
}

// closeSession ends session id.
func (s *Server) closeSession(id uint64) error {
	s.mu.Lock()
	ss := s.mu.sessions[id]
	delete(s.mu.sessions, id)
	s.mu.Unlock()
	if ss == nil {
		return unknownSession(id)
	}
	return ss.end()
}

func unknownSession(id uint64) error {
	return fmt.Errorf("%w %d (closed or idle too long)", ErrUnknownSession, id)
}
