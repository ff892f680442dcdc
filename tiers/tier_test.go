package tiers

import (
	"bytes"
	"errors"
	"testing"

	"github.com/tidepool-kv/tidepool/engine"
)

func TestParseSize(t *testing.T) {
	tests := []struct {
		in   string
		want int64
		ok   bool
	}{
		{"4096", 4096, true},
		{"512MiB", 512 << 20, true},
		{"8GiB", 8 << 30, true},
		{"1G", 1 << 30, true},
		{"64KiB", 64 << 10, true},
		{"2TiB", 2 << 40, true},
		{" 1MiB ", 1 << 20, true},
		{"", 0, false},
		{"0", 0, false},
		{"-1GiB", 0, false},
		{"1.5GiB", 0, false},
		{"GiB", 0, false},
		{"12XB", 0, false},
		{"99999999999TiB", 0, false},
	}
	for _, tc := range tests {
		got, err := ParseSize(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d, ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

// testTier is the suite every Tier implementation passes.
func testTier(t *testing.T, tier Tier, kind Kind, capacity int64) {
	t.Helper()
	if tier.Kind() != kind || tier.Capacity() != capacity {
		t.Fatalf("kind %v capacity %d, want %v %d", tier.Kind(), tier.Capacity(), kind, capacity)
	}
	seg := tier.Segment()
	if seg.Size() != capacity {
		t.Fatalf("segment size %d, want %d", seg.Size(), capacity)
	}
	data := bytes.Repeat([]byte("tidepool"), 512)
	for _, off := range []int64{0, 12345, capacity - int64(len(data))} {
		if n, err := seg.WriteAt(data, off); err != nil || n != len(data) {
			t.Fatalf("WriteAt(%d) = %d, %v", off, n, err)
		}
		got := make([]byte, len(data))
		if n, err := seg.ReadAt(got, off); err != nil || n != len(data) || !bytes.Equal(got, data) {
			t.Fatalf("ReadAt(%d) = %d, %v; bytes equal: %v", off, n, err, bytes.Equal(got, data))
		}
	}
	for _, off := range []int64{-1, capacity - 1, capacity} {
		if _, err := seg.WriteAt(data, off); !errors.Is(err, ErrOutOfRange) {
			t.Errorf("WriteAt(%d) error %v, want ErrOutOfRange", off, err)
		}
		if _, err := seg.ReadAt(data, off); !errors.Is(err, ErrOutOfRange) {
			t.Errorf("ReadAt(%d) error %v, want ErrOutOfRange", off, err)
		}
	}
	if err := tier.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := tier.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func TestDRAM(t *testing.T) {
	const capacity = 8 << 20
	tier, err := NewDRAM("dram0", capacity)
	if err != nil {
		t.Fatal(err)
	}
	if m, ok := tier.Segment().(engine.Mapped); !ok || len(m.Bytes()) != capacity {
		t.Fatal("the DRAM segment must be Mapped over its whole capacity")
	}
	testTier(t, tier, DRAM, capacity)
}

func TestDRAMInvalid(t *testing.T) {
	for _, c := range []int64{0, -1} {
		if _, err := NewDRAM("bad", c); err == nil {
			t.Errorf("NewDRAM(%d) succeeded", c)
		}
	}
}
