package tiers

import (
	"context"
	"errors"
	"testing"

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
