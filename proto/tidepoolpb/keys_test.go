package tidepoolpb

import (
	"slices"
	"strings"
	"testing"
)

func TestPackedKeys(t *testing.T) {
	for _, keys := range [][]string{
		{"a"},
		{"kv/model/0001", "kv/model/0002", "é", strings.Repeat("k", 4096)},
		{"ab", "", "c"}, // an empty key survives packing; the server refuses it
		{"\xff\xfe"},    // not UTF-8: packed keys carry any bytes
	} {
		r := &LookupRequest{Keys: []string{"stale"}}
		r.PackKeys(keys)
		if len(r.Keys) != 0 {
			t.Fatalf("PackKeys left Keys %q", r.Keys)
		}
		got, err := r.ChainKeys(len(keys))
		if err != nil || !slices.Equal(got, keys) {
			t.Fatalf("ChainKeys() = %q, %v; want %q", got, err, keys)
		}
		if _, err := r.ChainKeys(len(keys) - 1); err == nil {
			t.Fatalf("%d keys passed a limit of %d", len(keys), len(keys)-1)
		}
	}
	listed := &LookupRequest{Keys: []string{"a", "b"}}
	if got, err := listed.ChainKeys(2); err != nil || !slices.Equal(got, listed.Keys) {
		t.Fatalf("listed keys: %q, %v", got, err)
	}
	for name, r := range map[string]*LookupRequest{
		"both forms":          {Keys: []string{"a"}, PackedKeys: []byte("b"), KeyLengths: []uint32{1}},
		"a length past bytes": {PackedKeys: []byte("ab"), KeyLengths: []uint32{1, 2}},
		"a huge length":       {PackedKeys: []byte("ab"), KeyLengths: []uint32{1<<32 - 1}},
		"bytes left over":     {PackedKeys: []byte("abc"), KeyLengths: []uint32{1, 1}},
		"bytes, no lengths":   {PackedKeys: []byte("abc")},
	} {
		if keys, err := r.ChainKeys(16); err == nil {
			t.Errorf("%s: ChainKeys() = %q, want an error", name, keys)
		}
	}
}
