package main

import (
	"strings"
	"testing"
)

// TestReview21BenchReplaySpeedNaN: `tidepool bench replay` checks
// `speed < 0`, which NaN passes; run then reads `Speed > 0` as false and
// replays as fast as the pool answers, silently, instead of refusing
// the flag as a usage error. (Here the pool is unreachable: the command
// should refuse before it dials.)
func TestReview21BenchReplaySpeedNaN(t *testing.T) {
	code, _, stderr := runCLI([]string{"bench", "replay", "--masters", "127.0.0.1:1", "--timeout", "2s",
		"--trace", "../../bench/trace/testdata/chat-10k.jsonl.gz", "--requests", "10", "--speed", "NaN"}, "", nil)
	if code != 2 || !strings.Contains(stderr, "--speed") {
		t.Errorf("bench replay --speed NaN: exit %d, stderr %q; want a usage error (exit 2) naming --speed", code, stderr)
	}
}
