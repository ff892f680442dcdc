package kvhash

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"reflect"
	"strings"
	"testing"
)

// vector is one case of testdata/vectors.json, which testdata/vectors.py
// writes.
type vector struct {
	Name           string          `json:"name"`
	Scheme         Scheme          `json:"scheme"`
	BlockSize      int             `json:"block_size"`
	Seed           string          `json:"seed"`
	Tokens         []uint32        `json:"tokens"`
	ExtraKeys      json.RawMessage `json:"extra_keys"`       // every block's, or null
	BlockExtraKeys json.RawMessage `json:"block_extra_keys"` // per block, or null
	Root           string          `json:"root"`
	Hashes         []string        `json:"hashes"`
}

func loadVectors(t testing.TB) []vector {
	t.Helper()
	data, err := os.ReadFile("testdata/vectors.json")
	if err != nil {
		t.Fatal(err)
	}
	var f struct{ Cases []vector }
	if err := json.Unmarshal(data, &f); err != nil {
		t.Fatal(err)
	}
	if len(f.Cases) == 0 {
		t.Fatal("no vectors")
	}
	return f.Cases
}

// extra builds the per-block extra keys of a vector.
func (v vector) extra(t testing.TB) [][]any {
	t.Helper()
	if len(v.BlockExtraKeys) > 0 && string(v.BlockExtraKeys) != "null" {
		e, err := ParseBlockExtraKeys(v.BlockExtraKeys)
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	if len(v.ExtraKeys) == 0 {
		return nil
	}
	keys, err := ParseExtraKeys(v.ExtraKeys)
	if err != nil {
		t.Fatal(err)
	}
	if keys == nil {
		return nil
	}
	e := make([][]any, len(v.Tokens)/v.BlockSize)
	for i := range e {
		e[i] = keys
	}
	return e
}

func TestVectors(t *testing.T) {
	seen := map[Scheme]int{}
	for _, v := range loadVectors(t) {
		seen[v.Scheme]++
		t.Run(string(v.Scheme)+"/"+v.Name, func(t *testing.T) {
			h, err := New(Config{Scheme: v.Scheme, BlockSize: v.BlockSize, Seed: v.Seed})
			if err != nil {
				t.Fatal(err)
			}
			if v.Root != "" && h.Root().String() != v.Root {
				t.Errorf("root %s, want %s", h.Root(), v.Root)
			}
			got, err := h.Hash(nil, v.Tokens, v.extra(t))
			if err != nil {
				t.Fatal(err)
			}
			if s := hexes(got); !reflect.DeepEqual(s, v.Hashes) {
				t.Fatalf("hashes\n%s\nwant\n%s", strings.Join(s, "\n"), strings.Join(v.Hashes, "\n"))
			}
			// Extending a chain from any block gives the rest of it.
			bs := v.BlockSize
			extra := v.extra(t)
			for i := 1; i < len(got); i++ {
				var rest [][]any
				if i < len(extra) {
					rest = extra[i:]
				}
				tail, err := h.Hash(got[i-1], v.Tokens[i*bs:], rest)
				if err != nil {
					t.Fatal(err)
				}
				if s := hexes(tail); !reflect.DeepEqual(s, v.Hashes[i:]) {
					t.Fatalf("from block %d: %q, want %q", i, s, v.Hashes[i:])
				}
			}
		})
	}
	for _, s := range Schemes() {
		if seen[s] < 3 {
			t.Errorf("%d vectors for %s, want at least 3", seen[s], s)
		}
	}
}

func hexes(hs []Hash) []string {
	s := make([]string, len(hs))
	for i, h := range hs {
		s[i] = h.String()
	}
	return s
}

func TestDefaultsAndErrors(t *testing.T) {
	for s, want := range map[Scheme]int{VLLMSHA256CBOR: 16, SGLangSHA256: 64, XXH3: 64} {
		h, err := New(Config{Scheme: s})
		if err != nil {
			t.Fatal(err)
		}
		if h.BlockSize() != want {
			t.Errorf("%s default block size %d, want %d", s, h.BlockSize(), want)
		}
	}
	tests := []struct {
		cfg  Config
		want error
	}{
		{Config{Scheme: "md5"}, ErrScheme},
		{Config{}, ErrScheme},
		{Config{Scheme: XXH3, BlockSize: -1}, ErrBlockSize},
		{Config{Scheme: SGLangSHA256, Seed: "1"}, ErrSeed},
		{Config{Scheme: XXH3, Seed: "-1"}, ErrSeed},
		{Config{Scheme: XXH3, Seed: "18446744073709551616"}, ErrSeed},
		{Config{Scheme: VLLMSHA256CBOR, Seed: "\xff"}, ErrSeed},
	}
	for _, tc := range tests {
		if _, err := New(tc.cfg); !errors.Is(err, tc.want) {
			t.Errorf("New(%+v) error %v, want %v", tc.cfg, err, tc.want)
		}
	}

	v, _ := New(Config{Scheme: VLLMSHA256CBOR, BlockSize: 2})
	s, _ := New(Config{Scheme: SGLangSHA256, BlockSize: 2})
	if _, err := s.Hash(nil, []uint32{1, 2}, [][]any{{"lora"}}); !errors.Is(err, ErrExtraKeys) {
		t.Errorf("sglang with extra keys: %v, want ErrExtraKeys", err)
	}
	if _, err := s.Hash(nil, []uint32{1, 2}, [][]any{nil}); err != nil {
		t.Errorf("sglang with nil extra keys: %v", err)
	}
	if _, err := v.Hash(nil, []uint32{1, 2}, [][]any{{1.5}}); !errors.Is(err, ErrExtraKeys) {
		t.Errorf("vllm with a float extra key: %v, want ErrExtraKeys", err)
	}
	if _, err := v.Hash(make(Hash, 8), []uint32{1, 2}, nil); !errors.Is(err, ErrParent) {
		t.Errorf("vllm with an 8-byte parent: %v, want ErrParent", err)
	}
	if got, err := v.Hash(nil, []uint32{1}, nil); err != nil || len(got) != 0 {
		t.Errorf("one token in blocks of 2: %v, %v; want no hashes", got, err)
	}
	if _, err := Tokens([]int{0, 1 << 32}); !errors.Is(err, ErrToken) {
		t.Errorf("Tokens(2^32): %v, want ErrToken", err)
	}
	if _, err := Tokens([]int{-1}); !errors.Is(err, ErrToken) {
		t.Errorf("Tokens(-1): %v, want ErrToken", err)
	}
	if got, err := Tokens([]int{0, 1<<32 - 1}); err != nil || !reflect.DeepEqual(got, []uint32{0, 1<<32 - 1}) {
		t.Errorf("Tokens = %v, %v", got, err)
	}
}

func TestParseExtraKeys(t *testing.T) {
	tests := []struct {
		in   string
		want []any
		err  bool
	}{
		{`null`, nil, false},
		{`[]`, []any{}, false},
		{`["lora", ["mm", -2], 18446744073709551615, true, null]`,
			[]any{"lora", []any{"mm", int64(-2)}, uint64(18446744073709551615), true, nil}, false},
		{`"lora"`, nil, true},
		{`[1.5]`, nil, true},
		{`[1e3]`, nil, true},
		{`[18446744073709551616]`, nil, true},
		{`[{"a": 1}]`, nil, true},
		{`[1] [2]`, nil, true},
		{`[1`, nil, true},
	}
	for _, tc := range tests {
		got, err := ParseExtraKeys([]byte(tc.in))
		if tc.err {
			if !errors.Is(err, ErrExtraKeys) {
				t.Errorf("ParseExtraKeys(%s) error %v, want ErrExtraKeys", tc.in, err)
			}
			continue
		}
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ParseExtraKeys(%s) = %#v, %v; want %#v", tc.in, got, err, tc.want)
		}
	}
	got, err := ParseBlockExtraKeys([]byte(`[["salt"], null, []]`))
	if want := [][]any{{"salt"}, nil, {}}; err != nil || !reflect.DeepEqual(got, want) {
		t.Errorf("ParseBlockExtraKeys = %#v, %v; want %#v", got, err, want)
	}
	for _, in := range []string{`null`, `["salt"]`, `[1]`} {
		if _, err := ParseBlockExtraKeys([]byte(in)); !errors.Is(err, ErrExtraKeys) {
			t.Errorf("ParseBlockExtraKeys(%s) error %v, want ErrExtraKeys", in, err)
		}
	}
}

func BenchmarkHash1024Blocks(b *testing.B) {
	for _, s := range Schemes() {
		b.Run(string(s), func(b *testing.B) {
			h, err := New(Config{Scheme: s, Seed: map[Scheme]string{VLLMSHA256CBOR: "0"}[s]})
			if err != nil {
				b.Fatal(err)
			}
			tokens := make([]uint32, 1024*h.BlockSize())
			for i := range tokens {
				tokens[i] = uint32(i * 2654435761)
			}
			b.SetBytes(int64(4 * len(tokens)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := h.Hash(nil, tokens, nil); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func ExampleNamespace_Blocks() {
	h, _ := New(Config{Scheme: XXH3, BlockSize: 2})
	ns := Namespace{Scheme: XXH3, Model: "meta-llama/Llama-3.1-8B", Tenant: "acme"}
	blocks, _ := ns.Blocks(h, nil, []uint32{1, 2, 3, 4, 5}, nil)
	for _, b := range blocks {
		fmt.Printf("%s (parent %q)\n", b.Key, b.Parent)
	}
	// Output:
	// kv/xxh3-64/meta-llama%2FLlama-3.1-8B/acme/9581a6bbf9cef45a (parent "")
	// kv/xxh3-64/meta-llama%2FLlama-3.1-8B/acme/51bdd8da9da7a8e2 (parent "kv/xxh3-64/meta-llama%2FLlama-3.1-8B/acme/9581a6bbf9cef45a")
}
