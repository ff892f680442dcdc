package trace

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
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
			if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		got, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, buf.Bytes()) {
			t.Errorf("%s is not what %+v generates (go test -run TestTestdata -update)", path, cfg)
		}
		f, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		reqs, err := Read(f, 0)
		f.Close()
		if err != nil || len(reqs) != cfg.Requests {
			t.Errorf("%s: %d requests, %v", path, len(reqs), err)
		}
	}
}
