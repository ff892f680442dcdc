package ticket

import (
	"bytes"
	"errors"
	"testing"
)

func testKey(t testing.TB, segment string) *Key {
	t.Helper()
	k, err := SegmentKey(bytes.Repeat([]byte{7}, NodeKeySize), segment)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestRoundTrip(t *testing.T) {
	k := testKey(t, "a/dram@1")
	in := Ticket{Op: Write, ID: 1<<64 - 1, Off: 1 << 40, Len: 4096, Expiry: 1234567890123}
	b := k.Sign(in)
	if len(b) != Size {
		t.Fatalf("%d bytes", len(b))
	}
	out, err := k.Open(b)
	if err != nil || out != in {
		t.Fatalf("Open = %+v, %v; want %+v", out, err, in)
	}
}

func TestCheck(t *testing.T) {
	k := testKey(t, "a/dram@1")
	b := k.Sign(Ticket{Op: Write, ID: 9, Off: 4096, Len: 8192, Expiry: 1000})
	other := testKey(t, "a/dram@2").Sign(Ticket{Op: Write, ID: 9, Off: 4096, Len: 8192, Expiry: 1000})
	flipped := bytes.Clone(b)
	flipped[8] ^= 1 // the length
	for _, tc := range []struct {
		name   string
		ticket []byte
		op     Op
		off, n uint64
		now    int64
		want   error
	}{
		{"whole extent", b, Write, 4096, 8192, 999, nil},
		{"inside", b, Write, 8192, 100, 0, nil},
		{"empty at end", b, Write, 12288, 0, 0, nil},
		{"read with a write ticket", b, Read, 4096, 1, 0, ErrOp},
		{"expired", b, Write, 4096, 1, 1000, ErrExpired},
		{"before", b, Write, 4095, 1, 0, ErrExtent},
		{"past end", b, Write, 12287, 2, 0, ErrExtent},
		{"wrapping", b, Write, 1<<64 - 1, 2, 0, ErrExtent},
		{"huge", b, Write, 4096, 1 << 63, 0, ErrExtent},
		{"other segment", other, Write, 4096, 1, 0, ErrForged},
		{"field changed", flipped, Write, 4096, 1, 0, ErrForged},
		{"short", b[:Size-1], Write, 4096, 1, 0, ErrMalformed},
		{"none", nil, Write, 4096, 1, 0, ErrMalformed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := k.Check(tc.ticket, tc.op, tc.off, tc.n, tc.now)
			if !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
				t.Fatalf("Check = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestSegmentKeyRefusesBadNodeKey(t *testing.T) {
	if _, err := SegmentKey(make([]byte, 16), "s"); err == nil {
		t.Fatal("a 16-byte node key was accepted")
	}
}

func BenchmarkSign(b *testing.B) {
	k := testKey(b, "a/dram@1")
	buf := make([]byte, 0, Size)
	for i := range b.N {
		buf = k.Append(buf[:0], Ticket{Op: Read, Off: uint64(i), Len: 4096, Expiry: 1})
	}
}

func BenchmarkCheck(b *testing.B) {
	k := testKey(b, "a/dram@1")
	t := k.Sign(Ticket{Op: Read, Off: 0, Len: 1 << 30, Expiry: 1 << 62})
	for i := range b.N {
		if _, err := k.Check(t, Read, uint64(i%1024)*4096, 4096, 1); err != nil {
			b.Fatal(err)
		}
	}
}
