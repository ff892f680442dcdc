package trace

import (
	"bytes"
	"compress/gzip"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite testdata/*.jsonl from their configs")

// testdataTraces are the committed traces and how each was generated:
// `go test ./bench/trace -run TestTestdata -update` writes them again.
var testdataTraces = map[string]GenConfig{
	// The default mix: shared system prompts, conversations, one-shots.
	"mixed-1k.jsonl": {Requests: 1000, Seed: 1},
	// Mostly multi-turn conversations that extend their previous turn.
	"chat-1k.jsonl": {Requests: 1000, Seed: 2, System: 0.1, Conversation: 0.8, OneShot: 0.1},
	// Mostly one of a few hot system prompts and a short question.
	"prompts-1k.jsonl": {Requests: 1000, Seed: 3, System: 0.8, Conversation: 0.1, OneShot: 0.1},
	// The same three mixes, ten times as long, for the replays of
	// docs/benchmarks.md (gzipped: the compression is not compared).
	"mixed-10k.jsonl.gz":   {Requests: 10000, Seed: 11},
	"chat-10k.jsonl.gz":    {Requests: 10000, Seed: 12, System: 0.1, Conversation: 0.8, OneShot: 0.1},
	"prompts-10k.jsonl.gz": {Requests: 10000, Seed: 13, System: 0.8, Conversation: 0.1, OneShot: 0.1},
}

// TestTestdata: each committed trace is what its config generates, and
// reads back as such.
func TestTestdata(t *testing.T) {
	for name, cfg := range testdataTraces {
		path := filepath.Join("testdata", name)
		var buf bytes.Buffer
		if err := Write(&buf, Generate(cfg)); err != nil {
			t.Fatal(err)
		}
		if *update {
			if err := os.MkdirAll("testdata", 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, compressed(t, name, buf.Bytes()), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		got, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if got = uncompressed(t, name, got); !bytes.Equal(got, buf.Bytes()) {
			t.Errorf("%s is not what %+v generates (go test -run TestTestdata -update)", path, cfg)
		}
		reqs, err := ReadFile(path, 0)
		if err != nil || len(reqs) != cfg.Requests {
			t.Errorf("%s: %d requests, %v", path, len(reqs), err)
		}
	}
}

func compressed(t *testing.T, name string, b []byte) []byte {
	if !strings.HasSuffix(name, ".gz") {
		return b
	}
	var buf bytes.Buffer
	z, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	if _, err := z.Write(b); err != nil {
		t.Fatal(err)
	}
	if err := z.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func uncompressed(t *testing.T, name string, b []byte) []byte {
	if !strings.HasSuffix(name, ".gz") {
		return b
	}
	z, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	out, err := io.ReadAll(z)
	if err != nil {
		t.Fatal(err)
	}
	return out
}
