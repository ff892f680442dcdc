package tiers

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"strings"
	"testing"
)

// FuzzSSDObjectValue decodes arbitrary bytes as an SSD index entry, as a restarted store does:
// a value decodes or fails with errBadValue, and what decodes encodes (in this version) to a value
// that decodes to the same object. decodeString, on the same bytes, returns a suffix of them.
func FuzzSSDObjectValue(f *testing.F) {
	for _, o := range []SSDObject{
		{},
		{Offset: 4096, Size: 1 << 20, Checksum: 0xdeadbeef},
		{Offset: math.MaxUint64, Size: math.MaxUint64, Checksum: math.MaxUint32, HardPinned: true, SoftPinUntil: math.MinInt64, Parent: "p", Tenant: "t"},
		{SoftPinUntil: math.MaxInt64, Parent: strings.Repeat("k", MaxSSDIndexKey), Tenant: "tenant"},
	} {
		f.Add(appendObjectValue(nil, o))
	}
	v1 := binary.AppendUvarint([]byte{ssdValueV1}, 8192)
	v1 = binary.AppendUvarint(v1, 512)
	f.Add(binary.LittleEndian.AppendUint32(v1, 7))
	f.Add([]byte{})
	f.Add([]byte{ssdValueVersion, 0x80, 0x00, 0, 1, 2, 3, 4, 0, 0, 0, 0}) // an overlong offset
	f.Fuzz(func(t *testing.T, v []byte) {
		if s, rest, err := decodeString(v, "parent"); err == nil {
			if len(s) > MaxSSDIndexKey || !bytes.HasSuffix(v, rest) || len(s)+len(rest) >= len(v) {
				t.Fatalf("decodeString(%x) = %d bytes, %d left", v, len(s), len(rest))
			}
		} else if !errors.Is(err, errBadValue) {
			t.Fatalf("decodeString: %v", err)
		}
		o, err := decodeObjectValue(v)
		if err != nil {
			if !errors.Is(err, errBadValue) {
				t.Fatalf("decodeObjectValue: %v", err)
			}
			return
		}
		if o.Key != "" || len(o.Parent) > MaxSSDIndexKey || len(o.Tenant) > MaxSSDIndexKey {
			t.Fatalf("decoded %x as %+v", v, o)
		}
		enc := appendObjectValue(nil, o)
		again, err := decodeObjectValue(enc)
		if err != nil || again != o {
			t.Fatalf("decoded %x as %+v, which encodes as %x, which decodes as %+v, %v", v, o, enc, again, err)
		}
		if !bytes.Equal(appendObjectValue(nil, again), enc) {
			t.Fatalf("%+v encodes two ways", o)
		}
	})
}
