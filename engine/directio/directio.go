// Package directio reads and writes files opened with O_DIRECT from
// buffers of any alignment. O_DIRECT needs the offset, the length and the
// buffer's address to be multiples of the disk's block; where the caller's
// are not, the bytes bounce through a pool of aligned buffers, so an SSD
// tier's I/O never goes through the page cache (which would both take
// memory from the pool and make a benchmark of the tier measure RAM).
package directio

import (
	"errors"
	"io"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Align is the alignment O_DIRECT needs: the page size, a multiple of the
// logical block size of the disks SSD tiers live on.
const Align = 4096

// bounceSize is the size of one bounce buffer; larger accesses loop.
const bounceSize = 1 << 20

// ErrUnaligned: a write must start on a block, and its padded end must be
// within the file; such a write must go through the page cache.
var ErrUnaligned = errors.New("directio: write not on whole blocks of the file")

var bounces = sync.Pool{New: func() any {
	b := make([]byte, bounceSize+Align)
	off := Align - int(uintptr(unsafe.Pointer(unsafe.SliceData(b)))%Align)
	return (*[bounceSize]byte)(b[off%Align:])
}}

// Aligned reports whether p at off can go to the disk as it is.
func Aligned(p []byte, off int64) bool {
	addr := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
	return off%Align == 0 && len(p)%Align == 0 && addr%Align == 0
}

// ReadAt reads len(p) bytes at off from fd, which is open with O_DIRECT,
// and reports whether it bounced.
func ReadAt(fd int, p []byte, off int64) (bounced bool, err error) {
	if Aligned(p, off) {
		return false, All(fd, false, p, off)
	}
	b := bounces.Get().(*[bounceSize]byte)
	defer bounces.Put(b)
	for len(p) > 0 {
		lo := off &^ (Align - 1)
		skip := int(off - lo)
		n := min(bounceSize, roundUp(skip+len(p)))
		// The last block may run past the end of the file: a read there is
		// short, and only the bytes asked for must be there.
		got, err := upTo(fd, b[:n], lo)
		if err != nil {
			return true, err
		}
		if want := min(n, skip+len(p)); got < want {
			return true, io.ErrUnexpectedEOF
		}
		c := copy(p, b[skip:min(n, got)])
		p, off = p[c:], off+int64(c)
	}
	return true, nil
}

// upTo preads b at off until it is full or the file ends, and returns how
// much it read.
func upTo(fd int, b []byte, off int64) (int, error) {
	got := 0
	for got < len(b) {
		n, err := unix.Pread(fd, b[got:], off+int64(got))
		switch {
		case err == unix.EINTR:
			continue
		case err != nil:
			return got, err
		case n == 0:
			return got, nil
		}
		got += n
	}
	return got, nil
}

// WriteAt writes p at off to fd, which is open with O_DIRECT and size
// bytes long, and reports whether it bounced. off must be a multiple of
// Align; if the length is not, the last block is padded with zeros, so the
// caller must own the rest of that block (on an SSD tier an object starts
// on a block and its extent is rounded up to one; a write that ends between
// blocks ends at its object's end), and the block must end within the file.
func WriteAt(fd int, p []byte, off, size int64) (bounced bool, err error) {
	if off%Align != 0 || off+int64(roundUp(len(p))) > size {
		return false, ErrUnaligned
	}
	if Aligned(p, off) {
		return false, All(fd, true, p, off)
	}
	b := bounces.Get().(*[bounceSize]byte)
	defer bounces.Put(b)
	for len(p) > 0 {
		c := copy(b[:], p)
		n := roundUp(c)
		clear(b[c:n])
		if err := All(fd, true, b[:n], off); err != nil {
			return true, err
		}
		p, off = p[c:], off+int64(c)
	}
	return true, nil
}

func roundUp(n int) int { return (n + Align - 1) &^ (Align - 1) }

// All preads b from, or pwrites b to, fd at off, all of it: short
// transfers continue, EINTR retries. It is the plain path too (a file
// opened without O_DIRECT).
func All(fd int, write bool, b []byte, off int64) error {
	for len(b) > 0 {
		var n int
		var err error
		if write {
			n, err = unix.Pwrite(fd, b, off)
		} else {
			n, err = unix.Pread(fd, b, off)
		}
		switch {
		case err == unix.EINTR:
			continue
		case err != nil:
			return err
		case n == 0 && write:
			return io.ErrShortWrite
		case n == 0:
			return io.ErrUnexpectedEOF
		}
		b, off = b[n:], off+int64(n)
	}
	return nil
}

func uintptrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }
