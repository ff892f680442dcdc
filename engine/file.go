package engine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/tidepool-kv/tidepool/engine/directio"
)

// fileTransport is the same-host Transport for FileBacked segments (an SSD tier's preallocated
// file). It opens the peer's file through /proc/<pid>/fd/<fd>, as shm does, but never maps it:
// an op is a pread or pwrite at its offset, through a second fd opened with O_DIRECT: straight
// between op.Buf and the disk when its offset, length and address are multiples of the block,
// else through an aligned bounce buffer (package directio), so the tier's bytes never sit in the
// page cache. Where O_DIRECT cannot be opened (tmpfs on older kernels) or is refused (a disk with
// larger blocks, a write that does not start on a block), ops are buffered.
//
// It caches what it opens per (rail, segment) as shm caches mappings, negative answers included,
// and polls the owner's pidfd before each op: once the owner has exited the fds are closed, Do
// fails with ErrUnavailable and the next op describes again. Segments that are not FileBacked
// are shm's: file answers ErrUnsupported for them.
type fileTransport struct {
	describe func(ctx context.Context, addr, segment string) (shmInfo, error)
	cache    handleCache[*fileHandle]
	// openDirect reopens fd with O_DIRECT; tests replace it to exercise the buffered fallback.
	openDirect func(fd int) (int, error)

	// Ops served through each path: O_DIRECT from the caller's buffer, O_DIRECT through an
	// aligned bounce buffer, the page cache.
	direct, bounced, buffered atomic.Int64
}

// fileHandle is one peer file opened in this process.
type fileHandle struct {
	mu     sync.RWMutex // read-held across every op, write-held to close
	fd     int          // buffered
	direct int          // O_DIRECT, or -1
	size   int64        // the segment's size, as described
	pidfd  int          // the owner; it polls readable once the owner has exited
	gone   error        // non-nil once closed: what Do returns for ops that still hold h
}

func newFileTransport(desc func(ctx context.Context, addr, segment string) (shmInfo, error)) *fileTransport {
	t := &fileTransport{describe: desc, openDirect: reopenDirect}
	t.cache.init(t.open)
	return t
}

func (t *fileTransport) Name() string { return "file" }

// FileIO counts the ops the file transport (same-host SSD segments) has
// served through each path: O_DIRECT from the caller's buffer, O_DIRECT
// through a bounce buffer, the page cache.
type FileIO struct{ Direct, Bounced, Buffered int64 }

// FileIO says how this engine's same-host SSD ops went; zero without the
// file transport.
func (e *Engine) FileIO() FileIO {
	if e.file == nil {
		return FileIO{}
	}
	return FileIO{e.file.direct.Load(), e.file.bounced.Load(), e.file.buffered.Load()}
}

// Do preads or pwrites op.Buf at op.Offset in the peer's file.
func (t *fileTransport) Do(ctx context.Context, op *Op) error {
	key, err := sameHostKey(ctx, op)
	if err != nil {
		return err
	}
	h, err := t.cache.get(ctx, key)
	if err != nil {
		return err
	}
	return t.io(key, h, op)
}

// io moves op's bytes, holding h open while it does.
func (t *fileTransport) io(key shmKey, h *fileHandle, op *Op) error {
	h.mu.RLock()
	if h.gone != nil {
		h.mu.RUnlock()
		return h.gone
	}
	if exited(h.pidfd) {
		h.mu.RUnlock()
		why := fmt.Errorf("%w: file peer %s (segment %q) exited", ErrUnavailable, key.addr, key.segment)
		t.cache.forget(key, h, why)
		return why
	}
	n := int64(len(op.Buf))
	if !inRange(op.Offset, n, h.size) {
		h.mu.RUnlock()
		return fmt.Errorf("%w: %s %d+%d of %q (size %d)", ErrOutOfRange, op.Kind, op.Offset, n, key.segment, h.size)
	}
	if n == 0 {
		h.mu.RUnlock()
		return nil
	}
	var err error
	var bounced bool
	direct := h.direct >= 0
	if direct {
		if op.Kind == OpRead {
			bounced, err = directio.ReadAt(h.direct, op.Buf, op.Offset)
		} else {
			bounced, err = directio.WriteAt(h.direct, op.Buf, op.Offset, h.size)
		}
		// EINVAL: the disk wants more alignment than directio.Align; ErrUnaligned: a write
		// that does not start on a block. The op is idempotent, so it is safe to do it again
		// through the page cache.
		direct = !errors.Is(err, unix.EINVAL) && !errors.Is(err, directio.ErrUnaligned)
	}
	if !direct {
		err = directio.All(h.fd, op.Kind == OpWrite, op.Buf, op.Offset)
	}
	h.mu.RUnlock()
	switch {
	case !direct:
		t.buffered.Add(1)
	case bounced:
		t.bounced.Add(1)
	default:
		t.direct.Add(1)
	}
	if err != nil {
		return fmt.Errorf("%w: file %s/%s: %s %d+%d: %w", ErrRemote, key.addr, key.segment, op.Kind, op.Offset, n, err)
	}
	return nil
}

// open asks the peer to describe key's segment, then opens its file, buffered and O_DIRECT.
func (t *fileTransport) open(ctx context.Context, key shmKey) (*fileHandle, error) {
	info, err := describeKind(ctx, t.describe, key, segFile)
	if err != nil {
		return nil, err
	}
	fd, pidfd, err := openOwned(info)
	if err != nil {
		return nil, fmt.Errorf("file %s/%s: %w", key.addr, key.segment, err)
	}
	h := &fileHandle{fd: fd, direct: -1, size: int64(info.size), pidfd: pidfd}
	if d, err := t.openDirect(fd); err == nil {
		h.direct = d
	}
	return h, nil
}

// reopenDirect opens the file behind fd again, with O_DIRECT. It reopens this process's own fd,
// so it is the file openOwned checked, whatever the owner has done with its fd since.
func reopenDirect(fd int) (int, error) {
	return unix.Open(fmt.Sprintf("/proc/self/fd/%d", fd), unix.O_RDWR|unix.O_DIRECT|unix.O_CLOEXEC, 0)
}

// release closes h's fds once no op holds it. Ops that still hold h fail with why.
func (h *fileHandle) release(why error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.gone != nil {
		return
	}
	h.gone = why
	_ = unix.Close(h.fd)
	if h.direct >= 0 {
		_ = unix.Close(h.direct)
	}
	_ = unix.Close(h.pidfd)
}

// Close closes every file (waiting for ops in flight) and makes later Do fail with ErrClosed.
func (t *fileTransport) Close() error {
	t.cache.close()
	return nil
}
