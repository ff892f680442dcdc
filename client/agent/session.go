package agent

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
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
)

// session is one process's shared-memory region.
type session struct {
	id     uint64
	client string // as the process named itself, for logs
	size   uint64
	path   string // /proc/<pid>/fd/<fd>: what the process maps
	fd     int

	// mu is read-held by every request using mem, write-held to unmap it,
	// so a region is never unmapped under a transfer.
	mu  sync.RWMutex
	mem []byte // nil once ended

	used   atomic.Int64 // unix nanoseconds of the last request's start or end
	active atomic.Int32 // requests using the session; raised under Server.mu
}

func (ss *session) touch()              { ss.used.Store(time.Now().UnixNano()) }
func (ss *session) lastUsed() time.Time { return time.Unix(0, ss.used.Load()) }

// end unmaps the region and closes the memfd once no request uses them.
func (ss *session) end() error {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.mem == nil {
		return nil
	}
	err := errors.Join(unix.Munmap(ss.mem), unix.Close(ss.fd))
	ss.mem, ss.fd = nil, -1
	if err != nil {
		return fmt.Errorf("session %d: %w", ss.id, err)
	}
	return nil
}

// span returns the bytes of sp in the region, capped at its length so
// nothing beyond it is ever touched.
func (ss *session) span(sp *pb.Span) ([]byte, error) {
	size := uint64(len(ss.mem))
	off, n := sp.GetOffset(), sp.GetLength()
	if n > size || off > size-n {
		return nil, fmt.Errorf("%w: span of %d bytes at offset %d is outside the session's region of %d bytes", client.ErrInvalidArgument, n, off, size)
	}
	return ss.mem[off : off+n : off+n], nil
}

// open creates a session with a region of size bytes.
func (s *Server) open(name string, size uint64) (*session, error) {
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
	ss := &session{client: name, size: size, fd: fd, mem: mem, path: fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), fd)}
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
