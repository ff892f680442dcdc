package engine

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// shmTransport is the same-host Transport for memory. It maps a peer's Shareable segment (the
// peer's memfd, opened through /proc/<pid>/fd/<fd>) into this process, so a read or write is one
// memcpy between op.Buf and the peer's memory. FileBacked segments are the file transport's: shm
// answers ErrUnsupported for them.
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
	warm     bool // touch each new mapping's pages in the background (see warm)
	cache    handleCache[*shmMapping]
}

// shmKey names what the same-host transports cache: a segment as reached over one rail.
type shmKey struct{ addr, segment string }

// shmMapping is one peer segment mapped into this process.
type shmMapping struct {
	mu    sync.RWMutex // read-held across every copy, write-held to unmap
	mem   []byte       // the peer's segment; nil once unmapped (or for an empty segment)
	pidfd int          // the owner; it polls readable once the owner has exited
	gone  error        // non-nil once unmapped: what Do returns for ops that still hold m

	warmed   atomic.Int64  // how far from the start warm has touched
	warmDone chan struct{} // closed when warm returns; nil if it never ran
}

func newShmTransport(desc func(ctx context.Context, addr, segment string) (shmInfo, error), warm bool) *shmTransport {
	t := &shmTransport{describe: desc, warm: warm}
	t.cache.init(t.open)
	return t
}

func (t *shmTransport) Name() string { return "shm" }

// Do copies op.Buf to or from the peer segment's memory.
func (t *shmTransport) Do(ctx context.Context, op *Op) error {
	key, err := sameHostKey(ctx, op)
	if err != nil {
		return err
	}
	m, err := t.cache.get(ctx, key)
	if err != nil {
		return err
	}
	return t.copy(key, m, op)
}

// ShmWarmth says how much peer memory an engine's shm transport has
// mapped, and how much of it its background warm has still to touch.
type ShmWarmth struct{ Mapped, Cold int64 }

// ShmWarmth reports this engine's shared-memory mappings; zero without the
// shm transport. Cold stays 0 with Config.NoShmWarm.
func (e *Engine) ShmWarmth() ShmWarmth {
	var w ShmWarmth
	if e.shm == nil {
		return w
	}
	c := &e.shm.cache
	c.mu.RLock()
	defer c.mu.RUnlock()
	for _, ent := range c.mu.m {
		select {
		case <-ent.ready:
		default:
			continue
		}
		if m := ent.h; m != nil {
			m.mu.RLock()
			n := int64(len(m.mem))
			m.mu.RUnlock()
			w.Mapped += n
			if m.warmDone != nil {
				w.Cold += max(n-m.warmed.Load(), 0)
			}
		}
	}
	return w
}

// sameHostKey checks what the same-host transports check before any lookup, and returns the
// cache key of op's segment: the rail the op travels over, or the target's first rail.
func sameHostKey(ctx context.Context, op *Op) (shmKey, error) {
	if n := len(op.Target.Segment); n == 0 || n > MaxSegmentName {
		return shmKey{}, fmt.Errorf("%w: segment name of %d bytes", ErrInvalid, n)
	}
	if op.Kind != OpRead && op.Kind != OpWrite {
		return shmKey{}, fmt.Errorf("%w: op kind %d", ErrInvalid, op.Kind)
	}
	if err := ctx.Err(); err != nil {
		return shmKey{}, context.Cause(ctx)
	}
	key := shmKey{addr: op.Rail, segment: op.Target.Segment}
	if key.addr == "" {
		key.addr, _, _ = strings.Cut(op.Target.Endpoint, ",") // Rails()[0], without allocating
	}
	return key, nil
}

// copyCached does op at once if its segment's mapping is cached, without
// the liveness check: the caller checks the peer once after a batch of
// such copies (landed), which also proves each copy landed in a live
// peer's memory. handled false means op must take Do.
func (t *shmTransport) copyCached(op *Op) (key shmKey, m *shmMapping, handled bool, err error) {
	key, err = sameHostKey(context.Background(), op)
	if err != nil {
		return key, nil, false, nil
	}
	t.cache.mu.RLock()
	e := t.cache.mu.m[key]
	t.cache.mu.RUnlock()
	if e == nil {
		return key, nil, false, nil
	}
	select {
	case <-e.ready:
	default:
		return key, nil, false, nil
	}
	if e.err != nil || e.retry {
		return key, nil, false, nil
	}
	m = e.h
	m.mu.RLock()
	defer m.mu.RUnlock()
	if m.gone != nil {
		return key, nil, false, nil
	}
	n := int64(len(op.Buf))
	if !inRange(op.Offset, n, int64(len(m.mem))) {
		return key, m, true, fmt.Errorf("%w: %s %d+%d of %q (size %d)", ErrOutOfRange, op.Kind, op.Offset, n, key.segment, len(m.mem))
	}
	m.move(op)
	return key, m, true, nil
}

// landed reports whether copies made through m by copyCached reached a
// live peer; if the peer has exited it drops the mapping and says why.
func (t *shmTransport) landed(key shmKey, m *shmMapping) error {
	m.mu.RLock()
	gone := m.gone
	dead := gone == nil && exited(m.pidfd)
	m.mu.RUnlock()
	switch {
	case gone != nil:
		return gone
	case dead:
		why := fmt.Errorf("%w: shm peer %s (segment %q) exited", ErrUnavailable, key.addr, key.segment)
		t.cache.forget(key, m, why)
		return why
	}
	return nil
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
		t.cache.forget(key, m, why)
		return why
	}
	n := int64(len(op.Buf))
	if !inRange(op.Offset, n, int64(len(m.mem))) {
		size := len(m.mem)
		m.mu.RUnlock()
		return fmt.Errorf("%w: %s %d+%d of %q (size %d)", ErrOutOfRange, op.Kind, op.Offset, n, key.segment, size)
	}
	m.move(op)
	m.mu.RUnlock()
	return nil
}

// faultAround is the span the kernel maps on a read fault of a page
// already in a shared file's page cache (its fault_around_bytes, 64 KiB
// by default); a write fault maps one page.
const faultAround = 64 << 10

// move copies op's bytes (in range, m read-held). Before a write it reads
// one word of each fault-around span of the destination: this process's
// page tables of the peer's memory start empty, and a 64 KiB write into
// fresh ones then takes one fault instead of sixteen: 7 us for the whole
// copy here instead of 23. (The peer's pages are writable once mapped:
// shmem asks no write notification.)
func (m *shmMapping) move(op *Op) {
	mem := m.mem[op.Offset : op.Offset+int64(len(op.Buf))]
	if op.Kind == OpRead {
		copy(op.Buf, mem)
		return
	}
	// The mapping starts page aligned, so each word read lies in it.
	end := op.Offset + int64(len(mem))
	for at := op.Offset &^ 3; at < end; at = (at + faultAround) &^ (faultAround - 1) {
		atomic.LoadUint32((*uint32)(unsafe.Pointer(&m.mem[at])))
	}
	copy(mem, op.Buf)
}

// handle is what a same-host transport caches for one peer segment: a mapping (shm) or open
// fds (file). release frees it once no op holds it; ops that still hold it fail with why.
type handle interface {
	comparable
	release(why error)
}

// handleCache holds, per shmKey, a handle or the error that says the transport cannot reach the
// segment. The op that misses creates the entry and fills it with open (so a handle is made
// once); others wait for it. Failures worth retrying (peer down, segment not found) are not
// cached: their entry is removed before it is published.
type handleCache[H handle] struct {
	open func(ctx context.Context, key shmKey) (H, error)

	mu struct {
		sync.RWMutex
		closed bool
		m      map[shmKey]*cacheEntry[H]
	}
}

// cacheEntry is the cached answer for one key.
type cacheEntry[H handle] struct {
	ready chan struct{} // closed once h or err is set; they are written under handleCache.mu
	h     H
	err   error
	retry bool // the filler gave up because its own ctx ended: waiters try again themselves
}

func (c *handleCache[H]) init(open func(ctx context.Context, key shmKey) (H, error)) {
	c.open = open
	c.mu.m = make(map[shmKey]*cacheEntry[H])
}

// get returns key's handle, opening it on a miss, or the cached reason there is none.
func (c *handleCache[H]) get(ctx context.Context, key shmKey) (H, error) {
	var zero H
	for {
		c.mu.RLock()
		closed, e := c.mu.closed, c.mu.m[key]
		c.mu.RUnlock()
		if closed {
			return zero, ErrClosed
		}
		if e == nil {
			c.mu.Lock()
			if c.mu.closed {
				c.mu.Unlock()
				return zero, ErrClosed
			}
			if e = c.mu.m[key]; e == nil {
				e = &cacheEntry[H]{ready: make(chan struct{})}
				c.mu.m[key] = e
				c.mu.Unlock()
				return c.fill(ctx, key, e)
			}
			c.mu.Unlock()
		}
		select {
		case <-e.ready:
		case <-ctx.Done():
			return zero, context.Cause(ctx)
		}
		if !e.retry {
			return e.h, e.err
		}
	}
}

// fill opens key's handle, publishes the answer in e, and returns it.
func (c *handleCache[H]) fill(ctx context.Context, key shmKey, e *cacheEntry[H]) (H, error) {
	var zero H
	h, err := c.open(ctx, key)
	cache := err == nil || errors.Is(err, ErrUnsupported)
	discard := zero
	c.mu.Lock()
	if c.mu.closed {
		discard, h, err, cache = h, zero, ErrClosed, false
	}
	if !cache {
		if c.mu.m[key] == e {
			delete(c.mu.m, key)
		}
		e.retry = !errors.Is(err, ErrClosed) && ctx.Err() != nil
	}
	e.h, e.err = h, err
	close(e.ready)
	c.mu.Unlock()
	if discard != zero {
		discard.release(ErrClosed)
	}
	return h, err
}

// forget drops h, which key held, from the cache and releases it once no op holds it.
func (c *handleCache[H]) forget(key shmKey, h H, why error) {
	c.mu.Lock()
	if e := c.mu.m[key]; e != nil && e.h == h {
		delete(c.mu.m, key)
	}
	c.mu.Unlock()
	h.release(why)
}

// close releases every handle (waiting for ops in flight) and makes later gets fail with
// ErrClosed. It is idempotent.
func (c *handleCache[H]) close() {
	var zero H
	c.mu.Lock()
	c.mu.closed = true
	var hs []H
	for _, e := range c.mu.m {
		if e.h != zero {
			hs = append(hs, e.h)
		}
	}
	c.mu.m = nil
	c.mu.Unlock()
	for _, h := range hs {
		h.release(ErrClosed)
	}
}

// open asks the peer to describe key's segment, then maps it.
func (t *shmTransport) open(ctx context.Context, key shmKey) (*shmMapping, error) {
	info, err := describeKind(ctx, t.describe, key, segMemory)
	if err != nil {
		return nil, err
	}
	m, err := mapShm(info)
	if err != nil {
		return nil, fmt.Errorf("shm %s/%s: %w", key.addr, key.segment, err)
	}
	if t.warm && len(m.mem) > 0 {
		m.warmDone = make(chan struct{})
		go m.warm()
	}
	return m, nil
}

// describeKind asks the peer to describe key's segment, for a transport that serves segments of
// kind want: another kind fails with ErrUnsupported, to be cached.
func describeKind(ctx context.Context, describe func(ctx context.Context, addr, segment string) (shmInfo, error),
	key shmKey, want segKind) (shmInfo, error) {
	info, err := describe(ctx, key.addr, key.segment)
	if err != nil {
		if errors.Is(err, ErrProtocol) {
			// The peer did not understand or botched the describe: it will not get better.
			return shmInfo{}, fmt.Errorf("%w: describe %s/%s: %w", ErrUnsupported, key.addr, key.segment, err)
		}
		return shmInfo{}, fmt.Errorf("describe %s/%s: %w", key.addr, key.segment, err)
	}
	if info.kind != want {
		return shmInfo{}, fmt.Errorf("%w: %s/%s is a %v segment, this transport serves %v ones",
			ErrUnsupported, key.addr, key.segment, info.kind, want)
	}
	return info, nil
}

// mapShm maps the segment info describes, if its owner runs on this host and this process may
// open its fd. Failures wrap ErrUnsupported, except an owner that exits while being mapped
// (ErrUnavailable).
func mapShm(info shmInfo) (*shmMapping, error) {
	fd, pidfd, err := openOwned(info)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd) // the mapping keeps the file alive
	m := &shmMapping{pidfd: pidfd}
	if info.size > 0 {
		m.mem, err = unix.Mmap(fd, 0, int(info.size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			unix.Close(pidfd)
			return nil, fmt.Errorf("%w: mmap /proc/%d/fd/%d (%d bytes): %w", ErrUnsupported, info.pid, info.fd, info.size, err)
		}
		_ = unix.Madvise(m.mem, unix.MADV_HUGEPAGE) // best effort, as the owner does
	}
	return m, nil
}

// openOwned opens, read-write, the file info describes through /proc/<pid>/fd/<fd>, if its
// owner runs on this host and this process may open it, and checks that it is the described
// file and holds the segment. It returns that fd and a pidfd of the owner, both the caller's to
// close. Failures wrap ErrUnsupported, except an owner that exits meanwhile (ErrUnavailable).
func openOwned(info shmInfo) (fd, pidfd int, err error) {
	boot, err := hostBootID()
	if err != nil {
		return -1, -1, fmt.Errorf("%w: boot id: %w", ErrUnsupported, err)
	}
	if info.bootID != boot {
		return -1, -1, fmt.Errorf("%w: peer runs on another host (boot id %q)", ErrUnsupported, info.bootID)
	}
	if info.size > math.MaxInt64 || info.pid == 0 || info.pid > math.MaxInt32 || info.fd > math.MaxInt32 {
		return -1, -1, fmt.Errorf("%w: implausible describe: pid %d, fd %d, size %d", ErrUnsupported, info.pid, info.fd, info.size)
	}
	// The pidfd first: if /proc/<pid>/fd/<fd> then turns out to be the described file, the pidfd
	// is known to name its owner and not a later process that reused the pid.
	pidfd, err = unix.PidfdOpen(int(info.pid), 0)
	if err != nil {
		return -1, -1, fmt.Errorf("%w: pidfd_open %d: %w", ErrUnsupported, info.pid, err)
	}
	fd, err = openChecked(info, pidfd)
	if err != nil {
		unix.Close(pidfd)
		return -1, -1, err
	}
	return fd, pidfd, nil
}

func openChecked(info shmInfo, pidfd int) (int, error) {
	path := fmt.Sprintf("/proc/%d/fd/%d", info.pid, info.fd)
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		if exited(pidfd) { // not cached: a restarted owner may well be reachable
			return -1, fmt.Errorf("%w: same-host peer pid %d exited", ErrUnavailable, info.pid)
		}
		return -1, fmt.Errorf("%w: open %s: %w", ErrUnsupported, path, err)
	}
	var st unix.Stat_t
	err = unix.Fstat(fd, &st)
	switch {
	case err != nil:
		err = fmt.Errorf("%w: fstat %s: %w", ErrUnsupported, path, err)
	case uint64(st.Dev) != info.dev || st.Ino != info.ino:
		// Another pid namespace shares our boot id, but its pid names some other process here.
		err = fmt.Errorf("%w: %s is not the described file (dev %d ino %d, want dev %d ino %d)",
			ErrUnsupported, path, st.Dev, st.Ino, info.dev, info.ino)
	case st.Size < int64(info.size):
		err = fmt.Errorf("%w: %s holds %d bytes, segment has %d", ErrUnsupported, path, st.Size, info.size)
	case exited(pidfd):
		err = fmt.Errorf("%w: same-host peer pid %d exited", ErrUnavailable, info.pid)
	}
	if err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// release unmaps m once no copy holds it, and waits for its warm to stop.
// Ops that still hold m fail with why.
func (m *shmMapping) release(why error) {
	m.mu.Lock()
	if m.gone == nil {
		m.gone = why
		if m.mem != nil {
			_ = unix.Munmap(m.mem)
			m.mem = nil
		}
		_ = unix.Close(m.pidfd)
	}
	m.mu.Unlock()
	if m.warmDone != nil {
		<-m.warmDone
	}
}

// warmChunk is how much of a mapping warm touches per hold of its read
// lock, so that an unmap waits for no more than that (about 1 ms here).
const warmChunk = 1 << 20

// warm reads one word of each page of the mapping that the peer's memory
// holds, front to back, so that the first copy into or out of a page does
// not take its faults. A process's page tables of the peer's memory start
// empty; on a VM whose host shadows them (this one), the first touch of
// each 4 KiB page costs about 4 us beyond the guest's own fault, so a
// 1 MiB put into fresh pages took 1.8 ms instead of 0.6, and a batch of
// 128 puts of 4 KiB half a millisecond of CPU. Puts land all over a
// store's memory as its space is reused, so a long-running client maps
// all of it in the end anyway: warming takes the cost once, off the put
// path. Pages the peer has not committed (a tier without --prefault) are
// left alone: a read would commit them, charged to this process. It stops
// when the mapping is released.
func (m *shmMapping) warm() {
	defer close(m.warmDone)
	page := os.Getpagesize()
	held := make([]byte, warmChunk/page)
	for off := 0; ; off += warmChunk {
		m.mu.RLock()
		if m.gone != nil || off >= len(m.mem) {
			m.mu.RUnlock()
			return
		}
		chunk := m.mem[off:min(off+warmChunk, len(m.mem))]
		pages := held[:(len(chunk)+page-1)/page]
		if mincore(chunk, pages) != nil {
			clear(pages) // cannot tell: touch nothing
		}
		for i, in := range pages {
			if in&1 != 0 {
				atomic.LoadUint32((*uint32)(unsafe.Pointer(&chunk[i*page])))
			}
		}
		m.mu.RUnlock()
		m.warmed.Store(int64(off + len(chunk)))
	}
}

// mincore reports, a byte a page, which pages of mem the backing file holds
// (bit 0); x/sys/unix does not wrap it.
func mincore(mem, vec []byte) error {
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&mem[0])), uintptr(len(mem)), uintptr(unsafe.Pointer(&vec[0])))
	if errno != 0 {
		return errno
	}
	return nil
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
	t.cache.close()
	return nil
}
