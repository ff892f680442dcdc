package tiers

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// committed is how many bytes of the tier's memfd hold pages.
func committed(t *testing.T, d *DRAMTier) int64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(d.ShareFD(), &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

func TestDRAMPrefault(t *testing.T) {
	const size = 3*prefaultChunk + 4096
	d, err := NewDRAM("pf", size)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if n := committed(t, d); n != 0 {
		t.Fatalf("a new tier holds %d bytes of pages, want none until written", n)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := d.Prefault(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Prefault with a canceled context = %v", err)
	}
	if err := d.Prefault(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := committed(t, d); n != size {
		t.Fatalf("after Prefault %d bytes hold pages, want %d", n, size)
	}
	// Bytes written before or after stay as written.
	if _, err := d.WriteAt([]byte("kv"), size-2); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 2)
	if _, err := d.ReadAt(buf, size-2); err != nil || string(buf) != "kv" {
		t.Fatalf("read back %q, %v", buf, err)
	}
}

// After Prefault another mapping of the memfd (a same-host client's) maps
// the pages around each one it reads: they are written, not just
// committed, so the kernel's fault-around takes them.
func TestDRAMPrefaultWritesPages(t *testing.T) {
	const size = 4 << 20
	d, err := NewDRAM("pfw", size)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := d.Prefault(context.Background()); err != nil {
		t.Fatal(err)
	}
	peer, err := unix.Mmap(d.ShareFD(), 0, size, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(peer)
	sum := 0
	for off := 0; off < size; off += 64 << 10 {
		sum += int(peer[off])
	}
	if sum != 0 {
		t.Fatalf("prefaulted memory is not zero")
	}
	rss := mappedBytes(t, peer)
	// One page per read would be 64 pages; fault-around maps 16 each.
	if rss < size/2 {
		t.Fatalf("64 reads mapped %d bytes of the tier's pages, want most of %d (its pages are not written)", rss, size)
	}
}

// mappedBytes is the Rss of the mapping that starts at mem, from
// /proc/self/smaps.
func mappedBytes(t *testing.T, mem []byte) int64 {
	t.Helper()
	smaps, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		t.Skipf("no /proc/self/smaps: %v", err)
	}
	start := fmt.Sprintf("%x-", uintptr(unsafe.Pointer(&mem[0])))
	in := false
	for _, line := range strings.Split(string(smaps), "\n") {
		if strings.HasPrefix(line, start) {
			in = true
			continue
		}
		if in && strings.HasPrefix(line, "Rss:") {
			var kb int64
			if _, err := fmt.Sscanf(strings.TrimPrefix(line, "Rss:"), "%d kB", &kb); err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatalf("mapping at %s not in /proc/self/smaps", start)
	return 0
}
