package store

import (
	"errors"
	"io"
	"sync/atomic"

	"github.com/tidepool-kv/tidepool/engine"
)

// ioWatch serves a persistent tier's segment and remembers the first read,
// write or sync that failed with an I/O error (a range error is the
// caller's, not the disk's; a closed tier is shutting down): the node reports the segment on its heartbeats, and the
// master takes it out of the pool, so readers go to other replicas and no
// put lands there. One error is enough: a disk that fails a read rarely
// serves the next one better, and a flapping one is worse than none.
type ioWatch struct {
	engine.Segment
	failed atomic.Pointer[error]
}

func (w *ioWatch) ReadAt(p []byte, off int64) (int, error) {
	n, err := w.Segment.ReadAt(p, off)
	w.check(err)
	return n, err
}

func (w *ioWatch) WriteAt(p []byte, off int64) (int, error) {
	n, err := w.Segment.WriteAt(p, off)
	w.check(err)
	return n, err
}

func (w *ioWatch) check(err error) {
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, engine.ErrOutOfRange) && !errors.Is(err, engine.ErrClosed) {
		w.failed.CompareAndSwap(nil, &err)
	}
}

// err is the first I/O error, or nil.
func (w *ioWatch) err() error {
	if p := w.failed.Load(); p != nil {
		return *p
	}
	return nil
}

// The optional interfaces pass through, so the fast paths stay.

func (w *ioWatch) Bytes() []byte {
	if m, ok := w.Segment.(engine.Mapped); ok {
		return m.Bytes()
	}
	return nil
}

func (w *ioWatch) ShareFD() int {
	if s, ok := w.Segment.(engine.Shareable); ok {
		return s.ShareFD()
	}
	return -1
}

func (w *ioWatch) FileBacked() bool {
	f, ok := w.Segment.(engine.FileBacked)
	return ok && f.FileBacked()
}
