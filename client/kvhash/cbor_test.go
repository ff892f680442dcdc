package kvhash

import (
	"encoding/hex"
	"errors"
	"math"
	"testing"
)

// TestCBOR checks the encoder against RFC 8949 appendix A and a few heads at
// the edges of each argument width.
func TestCBOR(t *testing.T) {
	tests := []struct {
		v    any
		want string
	}{
		{0, "00"},
		{1, "01"},
		{10, "0a"},
		{23, "17"},
		{24, "1818"},
		{25, "1819"},
		{100, "1864"},
		{1000, "1903e8"},
		{1000000, "1a000f4240"},
		{int64(1000000000000), "1b000000e8d4a51000"},
		{uint64(math.MaxUint64), "1bffffffffffffffff"},
		{-1, "20"},
		{-10, "29"},
		{-100, "3863"},
		{-1000, "3903e7"},
		{false, "f4"},
		{true, "f5"},
		{nil, "f6"},
		{[]byte{}, "40"},
		{[]byte{1, 2, 3, 4}, "4401020304"},
		{"", "60"},
		{"a", "6161"},
		{"IETF", "6449455446"},
		{"\"\\", "62225c"},
		{"\u00fc", "62c3bc"},
		{"\u6c34", "63e6b0b4"},
		{"\U00010151", "64f0908591"},
		{[]any{}, "80"},
		{[]any{1, 2, 3}, "83010203"},
		{[]any{1, []any{2, 3}, []any{4, 5}}, "8301820203820405"},
		{[]any{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25},
			"98190102030405060708090a0b0c0d0e0f101112131415161718181819"},
		// Width edges, not in the appendix.
		{255, "18ff"},
		{256, "190100"},
		{65535, "19ffff"},
		{65536, "1a00010000"},
		{uint32(math.MaxUint32), "1affffffff"},
		{int64(math.MaxUint32 + 1), "1b0000000100000000"},
		{-24, "37"},
		{-25, "3818"},
		{-256, "38ff"},
		{-257, "390100"},
		{int64(math.MinInt64), "3b7fffffffffffffff"},
		{int32(-5), "24"},
		{uint(7), "07"},
	}
	for _, tc := range tests {
		got, err := appendValue(nil, tc.v)
		if err != nil {
			t.Errorf("encode %#v: %v", tc.v, err)
			continue
		}
		if hex.EncodeToString(got) != tc.want {
			t.Errorf("encode %#v = %x, want %s", tc.v, got, tc.want)
		}
	}
}

func TestCBORRefuses(t *testing.T) {
	for _, v := range []any{1.5, map[string]any{}, "\xff", []any{1, struct{}{}}} {
		if _, err := appendValue(nil, v); !errors.Is(err, ErrExtraKeys) {
			t.Errorf("encode %#v: error %v, want ErrExtraKeys", v, err)
		}
	}
}
