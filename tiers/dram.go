package tiers

import (
	"context"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/tidepool-kv/tidepool/engine"
)

// DRAMTier is host memory: one shared mapping of a memfd, so that a later
// same-host transport can map the very same pages into a client.
type DRAMTier struct {
	name string
	fd   int
	mem  []byte
}

var (
	_ Tier             = (*DRAMTier)(nil)
	_ engine.Segment   = (*DRAMTier)(nil)
	_ engine.Mapped    = (*DRAMTier)(nil)
	_ engine.Shareable = (*DRAMTier)(nil)
)

// NewDRAM maps capacity bytes of host memory. Pages are committed lazily by
// the kernel, so an idle tier costs little, until Prefault commits them.
func NewDRAM(name string, capacity int64) (*DRAMTier, error) {
	if capacity <= 0 {
		return nil, fmt.Errorf("dram tier %q: capacity must be positive, got %d", name, capacity)
	}
	fd, err := unix.MemfdCreate("tidepool-"+name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("dram tier %q: memfd_create: %w", name, err)
	}
	if err := unix.Ftruncate(fd, capacity); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("dram tier %q: size memfd to %d bytes: %w", name, capacity, err)
	}
	mem, err := unix.Mmap(fd, 0, int(capacity), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("dram tier %q: mmap %d bytes: %w", name, capacity, err)
	}
	// Transparent huge pages cut TLB misses on multi-MiB KV blocks; best effort.
	_ = unix.Madvise(mem, unix.MADV_HUGEPAGE)
	return &DRAMTier{name: name, fd: fd, mem: mem}, nil
}

// prefaultChunk is how much one step of Prefault commits.
const prefaultChunk = 64 << 20

// Prefault commits every page of the tier ahead of need, so that the first
// write to a page (a put) does not take the fault that allocates and
// zeroes it. It returns when done, when ctx ends, or at the first
// failure (ENOSPC: the host or its memory limit cannot hold the tier).
//
// fallocate commits the pages, but shmem leaves them unwritten (not
// uptodate) and zeroes each at its first fault; a same-host client's read
// fault then maps no neighbours (the kernel's fault-around maps only
// uptodate pages), so each of its writes faulted page by page. Writing
// the pages through this mapping (MADV_POPULATE_WRITE) zeroes them here.
// Kernels before 5.14 lack it; there the pages stay committed only.
//
// Then the kernel reads a byte of each page: on a VM whose host shadows
// the guest's page tables (this project's machines), a page the guest has
// mapped still costs about 4 us at its first touch, once for the guest's
// kernel and once for its user mode, and a 1 MiB put over TCP, which the
// kernel copies into the tier, took 2 ms instead of 0.8 into pages it had
// not touched. A read, unlike a write, is safe beside puts already landing.
// The touch is only for speed: without a pipe, or if a touch fails, the
// pages are still committed.
func (t *DRAMTier) Prefault(ctx context.Context) error {
	var pipe [2]int
	touch := unix.Pipe2(pipe[:], unix.O_CLOEXEC) == nil
	if touch {
		defer unix.Close(pipe[0])
		defer unix.Close(pipe[1])
	}
	populate := true
	for off := int64(0); off < int64(len(t.mem)); off += prefaultChunk {
		if err := ctx.Err(); err != nil {
			return err
		}
		n := min(prefaultChunk, int64(len(t.mem))-off)
		if err := unix.Fallocate(t.fd, 0, off, n); err != nil {
			return fmt.Errorf("dram tier %q: commit pages at %d: %w", t.name, off, err)
		}
		if populate {
			switch err := unix.Madvise(t.mem[off:off+n], unix.MADV_POPULATE_WRITE); {
			case errors.Is(err, unix.EINVAL):
				populate = false
			case err != nil:
				return fmt.Errorf("dram tier %q: write pages at %d: %w", t.name, off, err)
			}
		}
		if touch && kernelTouch(t.mem[off:off+n], pipe) != nil {
			touch = false
		}
	}
	return nil
}

// kernelTouch has the kernel read one byte of each page of mem: a writev
// of a byte per page into pipe, IOV_MAX of them a call (less than a pipe
// holds), then read back out.
func kernelTouch(mem []byte, pipe [2]int) error {
	const iovMax = 1024
	page := os.Getpagesize()
	iov := make([][]byte, 0, iovMax)
	drain := make([]byte, iovMax)
	for at := 0; at < len(mem); {
		iov = iov[:0]
		for ; at < len(mem) && len(iov) < cap(iov); at += page {
			iov = append(iov, mem[at:at+1])
		}
		n, err := unix.Writev(pipe[1], iov)
		if err != nil {
			return err
		}
		for n > 0 {
			m, err := unix.Read(pipe[0], drain[:n])
			if err != nil {
				return err
			}
			n -= m
		}
	}
	return nil
}

func (t *DRAMTier) Kind() Kind              { return DRAM }
func (t *DRAMTier) Name() string            { return t.name }
func (t *DRAMTier) Capacity() int64         { return int64(len(t.mem)) }
func (t *DRAMTier) Size() int64             { return int64(len(t.mem)) }
func (t *DRAMTier) Segment() engine.Segment { return t }

// Bytes returns the whole mapping; the engine reads and writes it in place.
func (t *DRAMTier) Bytes() []byte { return t.mem }

// ShareFD returns the memfd behind the mapping, so same-host clients can map the tier (the
// engine's shm transport); -1 after Close.
func (t *DRAMTier) ShareFD() int { return t.fd }

// ErrOutOfRange reports an access outside a tier.
var ErrOutOfRange = errors.New("tiers: access out of range")

func (t *DRAMTier) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 || off > int64(len(t.mem))-int64(len(p)) {
		return 0, fmt.Errorf("%w: %d bytes at %d in %d", ErrOutOfRange, len(p), off, len(t.mem))
	}
	return copy(p, t.mem[off:]), nil
}

func (t *DRAMTier) WriteAt(p []byte, off int64) (int, error) {
	if off < 0 || off > int64(len(t.mem))-int64(len(p)) {
		return 0, fmt.Errorf("%w: %d bytes at %d in %d", ErrOutOfRange, len(p), off, len(t.mem))
	}
	return copy(t.mem[off:], p), nil
}

// Close unmaps the memory. The engine must no longer serve the segment.
func (t *DRAMTier) Close() error {
	if t.mem == nil {
		return nil
	}
	err := errors.Join(unix.Munmap(t.mem), unix.Close(t.fd))
	t.mem, t.fd = nil, -1
	return err
}
