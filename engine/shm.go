package engine

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// shmTransport is the same-host Transport. It maps a peer's Shareable segment (the peer's memfd,
// opened through /proc/<pid>/fd/<fd>) into this process, so a read or write is one memcpy between
// op.Buf and the peer's memory.
//
// The first op to a (rail, segment) asks the peer to describe the segment over tcp, then maps it;
// later ops use the cached mapping. When shm cannot reach a segment (the peer is on another host,
// the segment is not Shareable, the open or mmap fails) Do fails with ErrUnsupported and that
// answer is cached too, so the engine falls over to the next transport at the cost of a map
// lookup. Before each copy the peer's pidfd is polled: a mapping outlives its owner, so once the
// owner has exited the mapping is dropped and Do fails with ErrUnavailable; the next op describes
// again (a restarted peer has a new pid and memfd).
//
// What it does not see: a segment unregistered by a live owner. Its mapping stays valid memory,
// and ops on it succeed until the owner exits, where tcp would answer ErrSegmentNotFound.
type shmTransport struct {
	describe func(ctx context.Context, addr, segment string) (shmInfo, error)

	mu struct {
		sync.RWMutex
		closed bool
		maps   map[shmKey]*shmEntry
	}
}

type shmKey struct{ addr, segment string }

// shmEntry is the cached answer for one key: a mapping, or the error that says shm cannot reach
// the segment. The op that misses creates the entry and fills it (so a mapping is made once);
// others wait for ready. Failures worth retrying (peer down, segment not found) are not cached:
// their entry is removed before ready closes.
type shmEntry struct {
	ready chan struct{} // closed once m or err is set; m and err are written under shmTransport.mu
	m     *shmMapping
	err   error
	retry bool // the filler gave up because its own ctx ended: waiters try again themselves
}

// shmMapping is one peer segment mapped into this process.
type shmMapping struct {
	mu    sync.RWMutex // read-held across every copy, write-held to unmap
	mem   []byte       // the peer's segment; nil once unmapped (or for an empty segment)
	pidfd int          // the owner; it polls readable once the owner has exited
	gone  error        // non-nil once unmapped: what Do returns for ops that still hold m
}

func newShmTransport(desc func(ctx context.Context, addr, segment string) (shmInfo, error)) *shmTransport {
	t := &shmTransport{describe: desc}
	t.mu.maps = make(map[shmKey]*shmEntry)
	return t
}

func (t *shmTransport) Name() string { return "shm" }

// Do copies op.Buf to or from the peer segment's memory.
func (t *shmTransport) Do(ctx context.Context, op *Op) error {
	if n := len(op.Target.Segment); n == 0 || n > MaxSegmentName {
		return fmt.Errorf("%w: segment name of %d bytes", ErrInvalid, n)
	}
	if op.Kind != OpRead && op.Kind != OpWrite {
		return fmt.Errorf("%w: op kind %d", ErrInvalid, op.Kind)
	}
	if err := ctx.Err(); err != nil {
		return context.Cause(ctx)
	}
	key := shmKey{addr: op.Rail, segment: op.Target.Segment}
	if key.addr == "" {
		key.addr, _, _ = strings.Cut(op.Target.Endpoint, ",") // Rails()[0], without allocating
	}
	m, err := t.mapping(ctx, key)
	if err != nil {
		return err
	}
	return t.copy(key, m, op)
}

// copy moves op's bytes, holding m mapped while it does.
func (t *shmTransport) copy(key shmKey, m *shmMapping, op *Op) error {
	m.mu.RLock()
	if m.gone != nil {
		m.mu.RUnlock()
		return m.gone
	}
	if exited(m.pidfd) {
		m.mu.RUnlock()
		why := fmt.Errorf("%w: shm peer %s (segment %q) exited", ErrUnavailable, key.addr, key.segment)
		t.forget(key, m, why)
		return why
	}
	n := int64(len(op.Buf))
	if !inRange(op.Offset, n, int64(len(m.mem))) {
		size := len(m.mem)
		m.mu.RUnlock()
		return fmt.Errorf("%w: %s %d+%d of %q (size %d)", ErrOutOfRange, op.Kind, op.Offset, n, key.segment, size)
	}
	if op.Kind == OpRead {
		copy(op.Buf, m.mem[op.Offset:])
	} else {
		copy(m.mem[op.Offset:], op.Buf)
	}
	m.mu.RUnlock()
	return nil
}

// mapping returns key's mapping, making it on a miss, or the cached reason there is none.
func (t *shmTransport) mapping(ctx context.Context, key shmKey) (*shmMapping, error) {
	for {
		t.mu.RLock()
		closed, e := t.mu.closed, t.mu.maps[key]
		t.mu.RUnlock()
		if closed {
			return nil, ErrClosed
		}
		if e == nil {
			t.mu.Lock()
			if t.mu.closed {
				t.mu.Unlock()
				return nil, ErrClosed
			}
			if e = t.mu.maps[key]; e == nil {
				e = &shmEntry{ready: make(chan struct{})}
				t.mu.maps[key] = e
				t.mu.Unlock()
				return t.fill(ctx, key, e)
			}
			t.mu.Unlock()
		}
		select {
		case <-e.ready:
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
		if !e.retry {
			return e.m, e.err
		}
	}
}

// fill describes and maps key's segment, publishes the answer in e, and returns it.
func (t *shmTransport) fill(ctx context.Context, key shmKey, e *shmEntry) (*shmMapping, error) {
	m, err := t.open(ctx, key)
	cache := err == nil || errors.Is(err, ErrUnsupported)
	var discard *shmMapping
	t.mu.Lock()
	if t.mu.closed {
		discard, m, err, cache = m, nil, ErrClosed, false
	}
	if !cache {
		if t.mu.maps[key] == e {
			delete(t.mu.maps, key)
		}
		e.retry = !errors.Is(err, ErrClosed) && ctx.Err() != nil
	}
	e.m, e.err = m, err
	close(e.ready)
	t.mu.Unlock()
	if discard != nil {
		discard.unmap(ErrClosed)
	}
	return m, err
}

// forget drops m, which key mapped, from the cache and unmaps it once no copy holds it.
func (t *shmTransport) forget(key shmKey, m *shmMapping, why error) {
	t.mu.Lock()
	if e := t.mu.maps[key]; e != nil && e.m == m {
		delete(t.mu.maps, key)
	}
	t.mu.Unlock()
	m.unmap(why)
}

// open asks the peer to describe key's segment, then maps it.
func (t *shmTransport) open(ctx context.Context, key shmKey) (*shmMapping, error) {
	info, err := t.describe(ctx, key.addr, key.segment)
	if err != nil {
		if errors.Is(err, ErrProtocol) {
			// The peer did not understand or botched the describe: it will not get better.
			return nil, fmt.Errorf("%w: describe %s/%s: %w", ErrUnsupported, key.addr, key.segment, err)
		}
		return nil, fmt.Errorf("describe %s/%s: %w", key.addr, key.segment, err)
	}
	m, err := mapShm(info)
	if err != nil {
		return nil, fmt.Errorf("shm %s/%s: %w", key.addr, key.segment, err)
	}
	return m, nil
}

// mapShm maps the segment info describes, if its owner runs on this host and this process may
// open its fd. Failures wrap ErrUnsupported, except an owner that exits while being mapped
// (ErrUnavailable).
func mapShm(info shmInfo) (*shmMapping, error) {
	boot, err := hostBootID()
	if err != nil {
		return nil, fmt.Errorf("%w: boot id: %w", ErrUnsupported, err)
	}
	if info.bootID != boot {
		return nil, fmt.Errorf("%w: peer runs on another host (boot id %q)", ErrUnsupported, info.bootID)
	}
	if info.size > math.MaxInt64 || info.pid == 0 || info.pid > math.MaxInt32 || info.fd > math.MaxInt32 {
		return nil, fmt.Errorf("%w: implausible describe: pid %d, fd %d, size %d", ErrUnsupported, info.pid, info.fd, info.size)
	}
	// The pidfd first: if /proc/<pid>/fd/<fd> then turns out to be the described file, the pidfd
	// is known to name its owner and not a later process that reused the pid.
	pidfd, err := unix.PidfdOpen(int(info.pid), 0)
	if err != nil {
		return nil, fmt.Errorf("%w: pidfd_open %d: %w", ErrUnsupported, info.pid, err)
	}
	m, err := mapOwned(info, pidfd)
	if err != nil {
		unix.Close(pidfd)
		return nil, err
	}
	return m, nil
}

func mapOwned(info shmInfo, pidfd int) (*shmMapping, error) {
	path := fmt.Sprintf("/proc/%d/fd/%d", info.pid, info.fd)
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: open %s: %w", ErrUnsupported, path, err)
	}
	defer unix.Close(fd) // the mapping keeps the file alive
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("%w: fstat %s: %w", ErrUnsupported, path, err)
	}
	if uint64(st.Dev) != info.dev || st.Ino != info.ino {
		// Another pid namespace shares our boot id, but its pid names some other process here.
		return nil, fmt.Errorf("%w: %s is not the described file (dev %d ino %d, want dev %d ino %d)",
			ErrUnsupported, path, st.Dev, st.Ino, info.dev, info.ino)
	}
	if st.Size < int64(info.size) {
		return nil, fmt.Errorf("%w: %s holds %d bytes, segment has %d", ErrUnsupported, path, st.Size, info.size)
	}
	if exited(pidfd) {
		return nil, fmt.Errorf("%w: shm peer pid %d exited", ErrUnavailable, info.pid)
	}
	m := &shmMapping{pidfd: pidfd}
	if info.size > 0 {
		m.mem, err = unix.Mmap(fd, 0, int(info.size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			return nil, fmt.Errorf("%w: mmap %s (%d bytes): %w", ErrUnsupported, path, info.size, err)
		}
		_ = unix.Madvise(m.mem, unix.MADV_HUGEPAGE) // best effort, as the owner does
	}
	return m, nil
}

// unmap releases m once no copy holds it. Ops that still hold m fail with why.
func (m *shmMapping) unmap(why error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.gone != nil {
		return
	}
	m.gone = why
	if m.mem != nil {
		_ = unix.Munmap(m.mem)
		m.mem = nil
	}
	_ = unix.Close(m.pidfd)
}

// exited reports whether the process behind pidfd has exited (its pidfd polls readable). An
// error counts as exited: the caller then drops the mapping and describes afresh.
func exited(pidfd int) bool {
	fds := [1]unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	var now unix.Timespec // zero: do not wait (unix.Poll would allocate it)
	for {
		n, err := unix.Ppoll(fds[:], &now, nil)
		if err == unix.EINTR {
			continue
		}
		return err != nil || n > 0
	}
}

// Close unmaps every mapping (waiting for copies in flight) and makes later Do fail with ErrClosed.
func (t *shmTransport) Close() error {
	t.mu.Lock()
	t.mu.closed = true
	var ms []*shmMapping
	for _, e := range t.mu.maps {
		if e.m != nil {
			ms = append(ms, e.m)
		}
	}
	t.mu.maps = nil
	t.mu.Unlock()
	for _, m := range ms {
		m.unmap(ErrClosed)
	}
	return nil
}
