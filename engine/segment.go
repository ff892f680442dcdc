package engine

import (
	"fmt"
	"sync"
)

// Segment is a named range of bytes this node serves to peers. ReadAt and WriteAt must be safe
// for concurrent use on disjoint ranges; the engine checks bounds against Size before calling them.
type Segment interface {
	Name() string
	Size() int64
	ReadAt(p []byte, off int64) (int, error)
	WriteAt(p []byte, off int64) (int, error)
}

// Mapped is implemented by memory-backed segments. The server then reads incoming payloads
// straight into Bytes()[off:off+n] and sends responses straight from it, with no intermediate
// copy. Bytes must return the same slice for the life of the registration, len(Bytes()) >= Size().
type Mapped interface {
	Bytes() []byte
}

// Shareable is implemented by segments that co-located peers can reach directly: map (the shm
// transport) or, if the segment is also FileBacked, pread and pwrite (the file transport).
// ShareFD returns the fd of a memfd (or file) whose bytes [0, Size()) are the segment's bytes,
// mapped MAP_SHARED by the owner unless the segment is FileBacked, so a write through any
// mapping (or pwrite) is seen through all of them; or -1 if it can no longer be shared. The fd
// must stay open, and keep those bytes, for the life of the registration.
type Shareable interface {
	ShareFD() int
}

// FileBacked is implemented by Shareable segments whose fd is a file on a disk, not memory: an
// SSD tier's preallocated file, read and written with pread and pwrite. FileBacked returning true
// tells same-host peers not to map the fd (the shm transport) but to pread and pwrite it at the
// op's offset (the file transport), with O_DIRECT when an op is aligned. The fd is then opened
// by peers through /proc, so it must be a regular file, at least Size() bytes long, whose
// bytes [0, Size()) are the segment's.
type FileBacked interface {
	FileBacked() bool
}

// MaxSegmentName is the longest segment name the wire format carries.
const MaxSegmentName = 255

// MemSegment is a Segment over a byte slice; it implements Mapped. It serves tests and any tier
// whose memory is a plain slice (heap, mmap, memfd).
type MemSegment struct {
	name string
	buf  []byte
}

// NewMemSegment returns a segment named name over buf. The segment aliases buf: the caller
// allocates it (make, mmap) and keeps ownership of its lifetime.
func NewMemSegment(name string, buf []byte) *MemSegment {
	return &MemSegment{name: name, buf: buf}
}

func (m *MemSegment) Name() string  { return m.name }
func (m *MemSegment) Size() int64   { return int64(len(m.buf)) }
func (m *MemSegment) Bytes() []byte { return m.buf }

// ReadAt never returns a short read: a range that does not fit fails whole with ErrOutOfRange.
func (m *MemSegment) ReadAt(p []byte, off int64) (int, error) {
	if !inRange(off, int64(len(p)), m.Size()) {
		return 0, fmt.Errorf("%w: read %d+%d of %q (size %d)", ErrOutOfRange, off, len(p), m.name, len(m.buf))
	}
	return copy(p, m.buf[off:]), nil
}

func (m *MemSegment) WriteAt(p []byte, off int64) (int, error) {
	if !inRange(off, int64(len(p)), m.Size()) {
		return 0, fmt.Errorf("%w: write %d+%d of %q (size %d)", ErrOutOfRange, off, len(p), m.name, len(m.buf))
	}
	return copy(m.buf[off:], p), nil
}

// inRange reports whether [off, off+n) lies within [0, size), without overflowing.
func inRange(off, n, size int64) bool {
	return off >= 0 && n >= 0 && off <= size && n <= size-off
}

// segments is the set of segments an engine serves, by name.
type segments struct {
	mu sync.RWMutex
	m  map[string]Segment
}

func (s *segments) add(seg Segment) error {
	name := seg.Name()
	if name == "" || len(name) > MaxSegmentName {
		return fmt.Errorf("%w: segment name must be 1..%d bytes, got %d", ErrInvalid, MaxSegmentName, len(name))
	}
	if seg.Size() < 0 {
		return fmt.Errorf("%w: segment %q has negative size", ErrInvalid, name)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.m[name]; ok {
		return fmt.Errorf("%w: %q", ErrExists, name)
	}
	if s.m == nil {
		s.m = make(map[string]Segment)
	}
	s.m[name] = seg
	return nil
}

func (s *segments) remove(name string) {
	s.mu.Lock()
	delete(s.m, name)
	s.mu.Unlock()
}

// get takes the name as bytes: the map lookup with string(name) does not allocate.
func (s *segments) get(name []byte) Segment {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.m[string(name)]
}

// lookup is get for a name held as a string.
func (s *segments) lookup(name string) Segment {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.m[name]
}
