package kvhash

import (
	"errors"
	"strings"
	"testing"
)

func TestNamespaceKey(t *testing.T) {
	h := Hash{0xab, 0xcd, 0, 1, 2, 3, 4, 5}
	tests := []struct {
		ns   Namespace
		want string
	}{
		{Namespace{XXH3, "llama", "acme"}, "kv/xxh3-64/llama/acme/abcd000102030405"},
		{Namespace{XXH3, "llama", ""}, "kv/xxh3-64/llama//abcd000102030405"},
		{Namespace{XXH3, "meta-llama/Llama-3.1-8B", "a b"}, "kv/xxh3-64/meta-llama%2FLlama-3.1-8B/a%20b/abcd000102030405"},
		{Namespace{XXH3, "100%", "x/y"}, "kv/xxh3-64/100%25/x%2Fy/abcd000102030405"},
	}
	for _, tc := range tests {
		if err := tc.ns.Validate(); err != nil {
			t.Errorf("%+v: %v", tc.ns, err)
		}
		if got := tc.ns.Key(h); got != tc.want {
			t.Errorf("%+v key %q, want %q", tc.ns, got, tc.want)
		}
	}
	// Escaping keeps namespaces apart: these would collide unescaped.
	a := Namespace{XXH3, "m/t", "x"}.Key(h)
	b := Namespace{XXH3, "m", "t/x"}.Key(h)
	if a == b {
		t.Errorf("namespaces collide on %q", a)
	}

	bad := []struct {
		ns   Namespace
		want error
	}{
		{Namespace{"md5", "m", ""}, ErrScheme},
		{Namespace{XXH3, "", "t"}, ErrNamespace},
		{Namespace{VLLMSHA256CBOR, strings.Repeat("m", MaxKeyLen), ""}, ErrNamespace},
	}
	for _, tc := range bad {
		if err := tc.ns.Validate(); !errors.Is(err, tc.want) {
			t.Errorf("%+v: error %v, want %v", tc.ns, err, tc.want)
		}
	}
}

func TestNamespaceBlocks(t *testing.T) {
	h, err := New(Config{Scheme: VLLMSHA256CBOR, BlockSize: 2, Seed: "0"})
	if err != nil {
		t.Fatal(err)
	}
	ns := Namespace{Scheme: VLLMSHA256CBOR, Model: "m"}
	tokens := []uint32{1, 2, 3, 4, 5, 6, 7}
	blocks, err := ns.Blocks(h, nil, tokens, nil)
	if err != nil {
		t.Fatal(err)
	}
	hashes, _ := h.Hash(nil, tokens, nil)
	if len(blocks) != 3 {
		t.Fatalf("%d blocks, want 3", len(blocks))
	}
	for i, b := range blocks {
		if b.Key != ns.Key(hashes[i]) {
			t.Errorf("block %d key %q, want %q", i, b.Key, ns.Key(hashes[i]))
		}
		want := ""
		if i > 0 {
			want = blocks[i-1].Key
		}
		if b.Parent != want {
			t.Errorf("block %d parent %q, want %q", i, b.Parent, want)
		}
	}
	// Continuing from block 0 links the next block to block 0's key.
	rest, err := ns.Blocks(h, blocks[0].Hash, tokens[2:], nil)
	if err != nil {
		t.Fatal(err)
	}
	if rest[0].Parent != blocks[0].Key || rest[0].Key != blocks[1].Key {
		t.Errorf("continued chain %+v, want parent %q key %q", rest[0], blocks[0].Key, blocks[1].Key)
	}

	if _, err := (Namespace{Scheme: XXH3, Model: "m"}).Blocks(h, nil, tokens, nil); !errors.Is(err, ErrNamespace) {
		t.Errorf("xxh3 namespace with a vllm hasher: %v, want ErrNamespace", err)
	}
}
