package tiers

import (
	"fmt"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/tidepool-kv/tidepool/engine"
)

// HBMTier is GPU memory: one cudaMalloc of the tier's capacity on one CUDA
// device. Its segment is not Mapped: the bytes are not addressable by the
// host, so ReadAt and WriteAt stage them through the caller's buffer
// (cudaMemcpy device <-> host), and peers reach them only through the engine.
//
// An emulated HBM tier (NewHBMEmulated) keeps its bytes in host memory but is
// otherwise the same type, reached only through ReadAt and WriteAt, so hosts
// without a GPU exercise the same placement, tiering and transfer paths. Its
// name always ends in "-emulated", so every status output says so.
//
// HBMTier is safe for concurrent use. Close must not race with the engine
// still serving the segment; accesses after Close fail with engine.ErrClosed.
type HBMTier struct {
	name     string
	capacity int64
	device   int // CUDA device; -1 when emulated
	emulated bool

	mu struct {
		sync.RWMutex // read-held by every access, held by Close
		mem          hbmMemory
	}
}

var (
	_ Tier           = (*HBMTier)(nil)
	_ engine.Segment = (*HBMTier)(nil)
)

// emulatedSuffix ends the name of every emulated HBM tier.
const emulatedSuffix = "-emulated"

// hbmMemory is where an HBM tier's bytes live: device memory, or host memory
// standing in for it. The tier checks bounds and closing; implementations copy.
type hbmMemory interface {
	read(p []byte, off int64) error
	write(off int64, p []byte) error
	free() error
}

// NewHBM allocates capacity bytes of device memory on CUDA device device. On
// a host without a usable CUDA runtime or device the error wraps ErrNoGPU;
// use NewHBMEmulated there.
func NewHBM(name string, device int, capacity int64) (*HBMTier, error) {
	if err := validHBM(name, capacity); err != nil {
		return nil, err
	}
	if device < 0 {
		return nil, fmt.Errorf("hbm tier %q: device must be 0 or more, got %d", name, device)
	}
	cuda, err := loadCUDA()
	if err != nil {
		return nil, fmt.Errorf("hbm tier %q: %w", name, err)
	}
	return newHBM(name, device, capacity, cuda)
}

// newHBM is NewHBM over a loaded CUDA runtime (a fake one in tests).
func newHBM(name string, device int, capacity int64, cuda *cudaRuntime) (*HBMTier, error) {
	n, err := cuda.deviceCount()
	if err != nil {
		return nil, fmt.Errorf("hbm tier %q: %w", name, err)
	}
	if device >= n {
		return nil, fmt.Errorf("hbm tier %q: no CUDA device %d (this host has %d)", name, device, n)
	}
	ptr, err := cuda.alloc(device, capacity)
	if err != nil {
		return nil, fmt.Errorf("hbm tier %q: allocate %d bytes on CUDA device %d: %w", name, capacity, device, err)
	}
	t := &HBMTier{name: name, capacity: capacity, device: device}
	t.mu.mem = &deviceMemory{cuda: cuda, device: device, ptr: ptr}
	return t, nil
}

// NewHBMEmulated is an HBM tier of capacity bytes of host memory, for hosts
// without a GPU. Its Kind is HBM and Emulated reports true; "-emulated" is
// appended to name unless name already ends with it.
func NewHBMEmulated(name string, capacity int64) (*HBMTier, error) {
	if !strings.HasSuffix(name, emulatedSuffix) {
		name += emulatedSuffix
	}
	if err := validHBM(name, capacity); err != nil {
		return nil, err
	}
	if int64(int(capacity)) != capacity {
		return nil, fmt.Errorf("hbm tier %q: capacity %d does not fit this host's address space", name, capacity)
	}
	// Private and anonymous: unlike a DRAM tier there is no fd to share, as
	// there is none for device memory. Pages are committed lazily.
	mem, err := unix.Mmap(-1, 0, int(capacity), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("hbm tier %q: mmap %d bytes: %w", name, capacity, err)
	}
	_ = unix.Madvise(mem, unix.MADV_HUGEPAGE)
	t := &HBMTier{name: name, capacity: capacity, device: -1, emulated: true}
	t.mu.mem = hostMemory(mem)
	return t, nil
}

func validHBM(name string, capacity int64) error {
	if name == "" || len(name) > engine.MaxSegmentName {
		return fmt.Errorf("hbm tier %q: name must be 1..%d bytes", name, engine.MaxSegmentName)
	}
	if capacity <= 0 {
		return fmt.Errorf("hbm tier %q: capacity must be positive, got %d", name, capacity)
	}
	return nil
}

func (t *HBMTier) Kind() Kind              { return HBM }
func (t *HBMTier) Name() string            { return t.name }
func (t *HBMTier) Capacity() int64         { return t.capacity }
func (t *HBMTier) Size() int64             { return t.capacity }
func (t *HBMTier) Segment() engine.Segment { return t }

// Emulated reports whether the tier is host memory standing in for HBM.
func (t *HBMTier) Emulated() bool { return t.emulated }

// Device is the CUDA device the tier's memory is on, -1 when emulated.
func (t *HBMTier) Device() int { return t.device }

// String describes the tier, for example
// "hbm0 (hbm on CUDA device 0, 1073741824 bytes)" or
// "hbm0-emulated (hbm-emulated in host memory, 1073741824 bytes)".
func (t *HBMTier) String() string {
	if t.emulated {
		return fmt.Sprintf("%s (hbm-emulated in host memory, %d bytes)", t.name, t.capacity)
	}
	return fmt.Sprintf("%s (hbm on CUDA device %d, %d bytes)", t.name, t.device, t.capacity)
}

// ReadAt copies the tier's bytes at off into p: device to host. It never
// returns a short read: a range that does not fit fails with ErrOutOfRange.
func (t *HBMTier) ReadAt(p []byte, off int64) (int, error) {
	return t.access("read", p, off, func(m hbmMemory) error { return m.read(p, off) })
}

// WriteAt copies p into the tier at off: host to device.
func (t *HBMTier) WriteAt(p []byte, off int64) (int, error) {
	return t.access("write", p, off, func(m hbmMemory) error { return m.write(off, p) })
}

// access runs one copy while Close is held off.
func (t *HBMTier) access(what string, p []byte, off int64, copyFn func(hbmMemory) error) (int, error) {
	if err := t.inRange(len(p), off); err != nil {
		return 0, err
	}
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.mu.mem == nil {
		return 0, fmt.Errorf("hbm tier %q: %w", t.name, engine.ErrClosed)
	}
	if err := copyFn(t.mu.mem); err != nil {
		return 0, fmt.Errorf("hbm tier %q: %s %d bytes at %d: %w", t.name, what, len(p), off, err)
	}
	return len(p), nil
}

func (t *HBMTier) inRange(n int, off int64) error {
	if off < 0 || off > t.capacity-int64(n) {
		return fmt.Errorf("%w: %d bytes at %d in %d", ErrOutOfRange, n, off, t.capacity)
	}
	return nil
}

// Close frees the memory; it waits for accesses in progress. Closing again
// does nothing.
func (t *HBMTier) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.mu.mem == nil {
		return nil
	}
	err := t.mu.mem.free()
	t.mu.mem = nil
	if err != nil {
		return fmt.Errorf("hbm tier %q: %w", t.name, err)
	}
	return nil
}

// deviceMemory is one cudaMalloc allocation on one device.
type deviceMemory struct {
	cuda   *cudaRuntime
	device int
	ptr    uintptr
}

func (m *deviceMemory) read(p []byte, off int64) error {
	return m.cuda.fromDevice(m.device, p, m.ptr+uintptr(off))
}

func (m *deviceMemory) write(off int64, p []byte) error {
	return m.cuda.toDevice(m.device, m.ptr+uintptr(off), p)
}

func (m *deviceMemory) free() error { return m.cuda.release(m.device, m.ptr) }

// hostMemory is an anonymous mapping standing in for device memory.
type hostMemory []byte

func (m hostMemory) read(p []byte, off int64) error  { copy(p, m[off:]); return nil }
func (m hostMemory) write(off int64, p []byte) error { copy(m[off:], p); return nil }
func (m hostMemory) free() error                     { return unix.Munmap(m) }
