package directio

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// openDirect makes a file of size bytes and opens it with O_DIRECT, or
// skips where the file system refuses it.
func openDirect(t *testing.T, size int64) (fd int, path string) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(path, make([]byte, size), 0o644); err != nil {
		t.Fatal(err)
	}
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_DIRECT|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Skipf("O_DIRECT not available here: %v", err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd, path
}

// TestBounce: reads of any offset, length and address, and writes that
// start on a block, land and read back byte for byte; only unaligned ones
// bounce; a write's partial last block is zero-padded and never grows the
// file; a write that does not start on a block, or whose padding would pass
// the end of the file, is refused.
func TestBounce(t *testing.T) {
	const size = 3<<20 + 1000 // a partial last block
	fd, path := openDirect(t, size)
	r := rand.New(rand.NewPCG(1, 2))
	model := make([]byte, size)
	aligned := func(n int) []byte {
		b := make([]byte, n+Align)
		skip := (Align - int(uintptrOf(b)%Align)) % Align
		return b[skip : skip+n]
	}
	for i := range 200 {
		off := int64(r.IntN(size/Align)) * Align
		n := 1 + r.IntN(min(size-int(off), 2*bounceSize+10))
		p := aligned(n + 1)[:n]
		if i%2 == 1 {
			p = aligned(n + 1)[1 : n+1]
		}
		for j := range p {
			p[j] = byte(r.Uint32())
		}
		bounced, err := WriteAt(fd, p, off, size)
		if pad := off + int64((n+Align-1)/Align*Align); pad > size {
			if !errors.Is(err, ErrUnaligned) {
				t.Fatalf("write of %d at %d, padding past the end: %v", n, off, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("write of %d at %d: %v", n, off, err)
		}
		if bounced != !Aligned(p, off) {
			t.Fatalf("write of %d at %d from %d: bounced %v", n, off, uintptrOf(p)%Align, bounced)
		}
		copy(model[off:], p)
		clear(model[off+int64(n) : min(size, off+int64((n+Align-1)/Align*Align))])

		roff := int64(r.IntN(size))
		rn := 1 + r.IntN(size-int(roff))
		got := make([]byte, rn)
		if _, err := ReadAt(fd, got, roff); err != nil {
			t.Fatalf("read of %d at %d: %v", rn, roff, err)
		}
		if !bytes.Equal(got, model[roff:roff+int64(rn)]) {
			t.Fatalf("read of %d at %d after write of %d at %d: bytes differ", rn, roff, n, off)
		}
	}
	if st, err := os.Stat(path); err != nil || st.Size() != size {
		t.Fatalf("file is %v bytes, %v; want %d", st.Size(), err, size)
	}
	if _, err := WriteAt(fd, make([]byte, 10), 100, size); !errors.Is(err, ErrUnaligned) {
		t.Fatalf("write at an offset off a block: %v, want ErrUnaligned", err)
	}
	if _, err := ReadAt(fd, make([]byte, 10), size-5); err == nil {
		t.Fatal("a read past the end of the file succeeded")
	}
}
