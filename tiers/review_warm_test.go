package tiers

import (
	"bytes"
	"context"
	"errors"
	"os"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Review of the DRAM prefault's kernel touch (02cd7f4).

// openFDs counts this process's open fds.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip(err)
	}
	return len(ents)
}

// TestReviewKernelTouchSizes: kernelTouch over mappings of odd sizes (less
// than a page, not a multiple of it, more than iovMax pages) returns nil
// and leaves the pipe empty. (Passes.)
func TestReviewKernelTouchSizes(t *testing.T) {
	page := os.Getpagesize()
	var pipe [2]int
	if err := unix.Pipe2(pipe[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pipe[0])
	defer unix.Close(pipe[1])
	for _, size := range []int{1, page - 1, page, page + 1, 1024 * page, 1024*page + 1, 3000*page + 7} {
		d, err := NewDRAM("kt", int64(size))
		if err != nil {
			t.Fatal(err)
		}
		if err := kernelTouch(d.mem, pipe); err != nil {
			t.Fatalf("size %d: %v", size, err)
		}
		n, err := unix.IoctlGetInt(pipe[0], unix.TIOCINQ)
		if err != nil || n != 0 {
			t.Fatalf("size %d: %d bytes left in the pipe (%v)", size, n, err)
		}
		d.Close()
	}
}

// TestReviewPrefaultCanceledMidway: a Prefault canceled part way returns
// the context's error and leaks no pipe fd; a later Prefault completes.
// (Passes.)
func TestReviewPrefaultCanceledMidway(t *testing.T) {
	const size = 8 * prefaultChunk
	d, err := NewDRAM("pfc", size)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	before := openFDs(t)
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		for committed(t, d) == 0 {
			time.Sleep(100 * time.Microsecond)
		}
		cancel()
	}()
	if err := d.Prefault(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled midway: %v", err)
	}
	if n := committed(t, d); n == 0 || n == size {
		t.Logf("canceled after %d of %d bytes (not midway; the cancel raced)", n, size)
	}
	if after := openFDs(t); after != before {
		t.Fatalf("%d fds open before, %d after a canceled Prefault", before, after)
	}
	if err := d.Prefault(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := committed(t, d); n != size {
		t.Fatalf("%d of %d bytes committed", n, size)
	}
}

// TestReviewPrefaultBesidePuts: puts that land while Prefault runs keep
// their bytes. (Passes.)
func TestReviewPrefaultBesidePuts(t *testing.T) {
	const size = 4 * prefaultChunk
	d, err := NewDRAM("pfp", size)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	val := bytes.Repeat([]byte{0xa5}, 64<<10)
	var wg sync.WaitGroup
	wg.Go(func() {
		for off := int64(0); off+int64(len(val)) <= size; off += 1 << 20 {
			if _, err := d.WriteAt(val, off); err != nil {
				t.Error(err)
				return
			}
		}
	})
	if err := d.Prefault(context.Background()); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	got := make([]byte, len(val))
	for off := int64(0); off+int64(len(val)) <= size; off += 1 << 20 {
		if _, err := d.ReadAt(got, off); err != nil || !bytes.Equal(got, val) {
			t.Fatalf("put at %d lost beside Prefault (%v)", off, err)
		}
	}
}

// TestReviewPrefaultNeedsAPipe: the kernel touch is an optimization, so a
// process that cannot make a pipe (at its fd limit: a store with many
// connections, or ENFILE host-wide) still commits the whole tier.
func TestReviewPrefaultNeedsAPipe(t *testing.T) {
	const size = 2 * prefaultChunk
	d, err := NewDRAM("pfnp", size)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	var old unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	n := openFDs(t)
	// Hold the lowest free fd numbers up to the limit: no new fd can open.
	lim := unix.Rlimit{Cur: uint64(n + 1), Max: old.Max}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Skip(err)
	}
	var held []int
	for {
		fd, err := unix.Dup(d.fd)
		if err != nil {
			break
		}
		held = append(held, fd)
	}
	perr := d.Prefault(context.Background())
	for _, fd := range held {
		unix.Close(fd)
	}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	if c := committed(t, d); perr != nil || c != size {
		t.Fatalf("Prefault with no fd to spare: err %v, %d of %d bytes committed", perr, c, size)
	}
}
