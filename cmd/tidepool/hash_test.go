package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
)

// TestHashVectors runs `tidepool hash` on every case of the kvhash
// reference vectors, passing tokens both ways.
func TestHashVectors(t *testing.T) {
	data, err := os.ReadFile("../../client/kvhash/testdata/vectors.json")
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Cases []struct {
			Name           string          `json:"name"`
			Scheme         string          `json:"scheme"`
			BlockSize      int             `json:"block_size"`
			Seed           *string         `json:"seed"`
			Tokens         []uint32        `json:"tokens"`
			ExtraKeys      json.RawMessage `json:"extra_keys"`
			BlockExtraKeys json.RawMessage `json:"block_extra_keys"`
			Hashes         []string        `json:"hashes"`
		}
	}
	if err := json.Unmarshal(data, &f); err != nil {
		t.Fatal(err)
	}
	for _, v := range f.Cases {
		args := []string{"hash", "--scheme", v.Scheme, "--block-size", fmt.Sprint(v.BlockSize)}
		if v.Seed != nil {
			args = append(args, "--seed", *v.Seed)
		}
		if len(v.ExtraKeys) > 0 && string(v.ExtraKeys) != "null" {
			args = append(args, "--extra-keys", string(v.ExtraKeys))
		}
		if len(v.BlockExtraKeys) > 0 && string(v.BlockExtraKeys) != "null" {
			args = append(args, "--block-extra-keys", string(v.BlockExtraKeys))
		}
		ids := make([]string, len(v.Tokens))
		for i, tok := range v.Tokens {
			ids[i] = fmt.Sprint(tok)
		}
		want := strings.Join(append(v.Hashes, ""), "\n")
		if len(v.Hashes) == 0 {
			want = ""
		}
		for _, how := range []string{"flag", "stdin"} {
			a, stdin := args, strings.Join(ids, "\n")+"\n"
			if how == "flag" {
				a, stdin = append(args, "--tokens", strings.Join(ids, ",")), ""
			}
			code, stdout, stderr := runCLI(a, stdin, nil)
			if code != 0 || stdout != want {
				t.Errorf("%s %s (%s): exit %d, stderr %q, stdout\n%s\nwant\n%s", v.Scheme, v.Name, how, code, stderr, stdout, want)
			}
		}
	}
}

func TestHashCLI(t *testing.T) {
	// The first two tokens of blocks of 2 under xxh3-64; see kvhash's example.
	const first = "9581a6bbf9cef45a"
	tests := []struct {
		args   []string
		stdin  string
		env    map[string]string
		code   int
		stdout string
		stderr string
	}{
		{[]string{"hash", "--scheme", "xxh3-64", "--block-size", "2", "--tokens", "1,2,3"}, "", nil, 0, first + "\n", ""},
		{[]string{"hash", "--scheme", "xxh3-64", "--block-size", "2"}, "1 2\n3", nil, 0, first + "\n", ""},
		{[]string{"hash", "--scheme", "xxh3-64", "--block-size", "2", "--tokens", "-"}, "1,2", nil, 0, first + "\n", ""},
		{[]string{"hash", "--scheme", "xxh3-64", "--block-size", "2", "--tokens", "1,2", "--keys", "--model", "org/m", "--tenant", "t"}, "", nil, 0,
			"kv/xxh3-64/org%2Fm/t/" + first + "\n", ""},
		// vLLM's seed falls back to $PYTHONHASHSEED.
		{[]string{"hash", "--scheme", "vllm-sha256-cbor", "--block-size", "1", "--tokens", "7"}, "", map[string]string{"PYTHONHASHSEED": "0"}, 0,
			"35f58530134c385607b0186c05d7c8b850dc3df234c5ef75df3526a4d9d85b58\n", ""},
		{[]string{"hash", "--scheme", "vllm-sha256-cbor", "--tokens", "1"}, "", nil, 2, "", "needs vLLM's PYTHONHASHSEED"},
		{[]string{"hash", "--tokens", "1"}, "", nil, 2, "", "--scheme is required"},
		{[]string{"hash", "--scheme", "md5", "--tokens", "1"}, "", nil, 2, "", `unknown scheme "md5"`},
		{[]string{"hash", "--scheme", "xxh3-64", "--block-size", "0", "--tokens", "1"}, "", nil, 2, "", "--block-size must be positive"},
		{[]string{"hash", "--scheme", "xxh3-64", "--tokens", "1,4294967296"}, "", nil, 2, "", `token 1 is "4294967296"`},
		{[]string{"hash", "--scheme", "xxh3-64"}, "1\n-2\n", nil, 1, "", "tidepool hash: stdin: kvhash: token id out of range: token 1"},
		{[]string{"hash", "--scheme", "xxh3-64", "--seed", "x", "--tokens", "1"}, "", nil, 2, "", "want an unsigned 64-bit integer"},
		{[]string{"hash", "--scheme", "sglang-sha256", "--extra-keys", `["l"]`, "--block-size", "1", "--tokens", "1"}, "", nil, 2, "", "takes no extra keys"},
		{[]string{"hash", "--scheme", "vllm-sha256-cbor", "--seed", "0", "--extra-keys", `{"a":1}`, "--tokens", "1"}, "", nil, 2, "", "JSON objects are not supported"},
		{[]string{"hash", "--scheme", "vllm-sha256-cbor", "--seed", "0", "--extra-keys", `[]`, "--block-extra-keys", `[]`}, "", nil, 2, "", "exclude each other"},
		{[]string{"hash", "--scheme", "xxh3-64", "--keys", "--tokens", "1"}, "", nil, 2, "", "no model"},
		{[]string{"hash", "--scheme", "xxh3-64", "--model", "m", "--tokens", "1"}, "", nil, 2, "", "need --keys"},
		{[]string{"hash", "--scheme", "xxh3-64", "extra"}, "", nil, 2, "", "want 0 arguments, got 1"},
	}
	for _, tc := range tests {
		code, stdout, stderr := runCLI(tc.args, tc.stdin, tc.env)
		if code != tc.code || (tc.code == 0 && stdout != tc.stdout) || !strings.Contains(stderr, tc.stderr) {
			t.Errorf("%q: exit %d, stdout %q, stderr %q; want %d, %q, stderr with %q", tc.args, code, stdout, stderr, tc.code, tc.stdout, tc.stderr)
		}
		if code != 0 && !strings.HasPrefix(stderr, "tidepool hash: ") {
			t.Errorf("%q: stderr %q, want it to start with %q", tc.args, stderr, "tidepool hash: ")
		}
	}
}

func runCLI(args []string, stdin string, vars map[string]string) (int, string, string) {
	var stdout, stderr bytes.Buffer
	e := &env{stdin: strings.NewReader(stdin), stdout: &stdout, stderr: &stderr, getenv: func(k string) string { return vars[k] }}
	code := run(context.Background(), e, args)
	return code, stdout.String(), stderr.String()
}
