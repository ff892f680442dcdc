package trace

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"
)

func TestReadWrite(t *testing.T) {
	in := `{"timestamp": 20, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}

{"timestamp": 10, "input_length": 512, "output_length": 7, "hash_ids": [0]}
{"timestamp": 20, "input_length": 600, "output_length": 9, "hash_ids": [0, 3]}
`
	reqs, err := Read(strings.NewReader(in), 0)
	if err != nil {
		t.Fatal(err)
	}
	want := []Request{
		{Timestamp: 10, InputLength: 512, OutputLength: 7, HashIDs: []int64{0}},
		{Timestamp: 20, InputLength: 1100, OutputLength: 5, HashIDs: []int64{0, 1, 2}},
		{Timestamp: 20, InputLength: 600, OutputLength: 9, HashIDs: []int64{0, 3}},
	}
	if !reflect.DeepEqual(reqs, want) {
		t.Fatalf("read %+v, want %+v (by timestamp, ties in file order)", reqs, want)
	}
	var buf bytes.Buffer
	if err := Write(&buf, reqs); err != nil {
		t.Fatal(err)
	}
	again, err := Read(&buf, 0)
	if err != nil || !reflect.DeepEqual(again, want) {
		t.Fatalf("round trip: %+v, %v", again, err)
	}
	if first, err := Read(strings.NewReader(in), 1); err != nil || len(first) != 1 {
		t.Fatalf("max 1: %+v, %v", first, err)
	}
	if n := Distinct(reqs); n != 4 {
		t.Errorf("distinct blocks %d, want 4", n)
	}
	if got := want[1].Tokens(3); got != 1100 {
		t.Errorf("tokens of 3 blocks of a 1100-token prompt: %d", got)
	}
}

func TestReadRefuses(t *testing.T) {
	for _, tc := range []struct{ name, in string }{
		{"not JSON", "{\"timestamp\": 1,\n"},
		{"unknown field", `{"timestamp": 1, "input_length": 512, "hash_ids": [1], "prompt": "x"}`},
		{"negative", `{"timestamp": -1, "input_length": 512, "hash_ids": [1]}`},
		{"more blocks than tokens", `{"timestamp": 1, "input_length": 512, "hash_ids": [1, 2]}`},
		{"line too long", `{"hash_ids": [` + strings.Repeat("1,", 1<<20) + `1]}`},
	} {
		_, err := Read(strings.NewReader(tc.in), 0)
		if !errors.Is(err, ErrFormat) {
			t.Errorf("%s: %v, want ErrFormat", tc.name, err)
		}
	}
}

func TestGenerate(t *testing.T) {
	cfg := GenConfig{Requests: 2000, Seed: 7}
	a, b := Generate(cfg), Generate(cfg)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("the same config made two traces")
	}
	if reflect.DeepEqual(a, Generate(GenConfig{Requests: 2000, Seed: 8})) {
		t.Fatal("two seeds made one trace")
	}
	next := int64(0)
	chains := map[string]bool{}
	extended := 0
	for i, r := range a {
		if err := r.valid(); err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if i > 0 && r.Timestamp < a[i-1].Timestamp {
			t.Fatalf("request %d arrives before %d", i, i-1)
		}
		for _, id := range r.HashIDs {
			if id > next {
				t.Fatalf("request %d: id %d before %d was used (ids are consecutive by first use)", i, id, next)
			}
			if id == next {
				next++
			}
		}
		// A conversation's turn extends an earlier prompt.
		for n := len(r.HashIDs) - 1; n > 0; n-- {
			if chains[key(r.HashIDs[:n])] {
				extended++
				break
			}
		}
		chains[key(r.HashIDs)] = true
	}
	if extended < len(a)/10 {
		t.Errorf("%d of %d requests extend an earlier prompt", extended, len(a))
	}
}

func key(ids []int64) string {
	var b strings.Builder
	for _, id := range ids {
		b.WriteString(string(rune(id)))
	}
	return b.String()
}

func TestPolicies(t *testing.T) {
	reqs := []Request{
		{InputLength: 1536, HashIDs: []int64{1, 2, 3}},
		{InputLength: 1024, HashIDs: []int64{1, 2}},
		{InputLength: 1000, HashIDs: []int64{4, 5}},
		{InputLength: 1536, HashIDs: []int64{1, 2, 3}},
	}
	for _, tc := range []struct {
		name     string
		policy   func([]Request, int) Result
		capacity int
		hits     int64
	}{
		// LRU of 3: [1 2 3]; [1 2] hit 2; [4 5] evicts 3 and 2 (the
		// deepest of the oldest first) ... leaves 1 4 5: [1 2 3] hits 1.
		{"LRU 3", LRU, 3, 3},
		// Belady of 3 keeps 1 2 3 (used again) and admits neither 4 nor 5
		// (never used again): the last request hits all three.
		{"Belady 3", Belady, 3, 5},
		{"LRU 0", LRU, 0, 0},
		{"Belady 0", Belady, 0, 0},
		// Room for everything: only first uses miss.
		{"LRU 10", LRU, 10, 5},
		{"Belady 10", Belady, 10, 5},
	} {
		r := tc.policy(reqs, tc.capacity)
		if r.HitBlocks != tc.hits || r.Blocks != 10 || r.Requests != 4 {
			t.Errorf("%s: %+v, want %d hit blocks of 10", tc.name, r, tc.hits)
		}
	}
	if r := LRU(reqs, 10); r.HitTokens != 1024+1536 || r.Tokens != 1536+1024+1000+1536 {
		t.Errorf("LRU 10 tokens: %+v", r)
	}
}

// TestBeladyAboveLRU: on generated traces, at every capacity from 2% to
// 50% of the distinct blocks, Belady's hits are at least LRU's.
func TestBeladyAboveLRU(t *testing.T) {
	for _, seed := range []uint64{1, 2, 3} {
		reqs := Generate(GenConfig{Requests: 3000, Seed: seed})
		distinct := Distinct(reqs)
		for _, frac := range []float64{0.02, 0.05, 0.1, 0.2, 0.5} {
			c := max(1, int(frac*float64(distinct)))
			l, b := LRU(reqs, c), Belady(reqs, c)
			if b.HitBlocks < l.HitBlocks {
				t.Errorf("seed %d, capacity %d (%.0f%%): Belady %d hit blocks, LRU %d", seed, c, 100*frac, b.HitBlocks, l.HitBlocks)
			}
		}
	}
}
