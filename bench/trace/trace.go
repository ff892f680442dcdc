package trace

import (
	"bufio"
	"bytes"
	"cmp"
	"compress/gzip"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
)

// BlockTokens is the tokens of one block of a trace's hash_ids.
const BlockTokens = 512

// Request is one line of a trace.
type Request struct {
	// Timestamp is the arrival, in ms since the trace's first request.
	Timestamp    int64   `json:"timestamp"`
	InputLength  int64   `json:"input_length"`
	OutputLength int64   `json:"output_length"`
	HashIDs      []int64 `json:"hash_ids"`
}

// Tokens is the prompt tokens of the request's first n blocks: 512 each,
// the last one only the rest of the prompt.
func (r Request) Tokens(n int) int64 {
	if n <= 0 {
		return 0
	}
	return min(int64(n)*BlockTokens, r.InputLength)
}

// Bounds of what Read accepts.
const (
	maxLine   = 1 << 20 // bytes of one line
	maxBlocks = 1 << 16 // hash ids of one request
)

// ErrFormat is a trace that does not parse.
var ErrFormat = errors.New("trace: bad format")

// ReadFile reads the trace in file, gzipped if its name ends in ".gz",
// as Read does.
func ReadFile(file string, max int) ([]Request, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var r io.Reader = f
	if strings.HasSuffix(file, ".gz") {
		z, err := gzip.NewReader(f)
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %v", ErrFormat, file, err)
		}
		defer z.Close()
		r = z
	}
	return Read(r, max)
}

// Read parses a trace, one JSON object a line (blank lines skipped), and
// returns its requests in timestamp order (stable: equal timestamps keep
// the file's order), at most max of them (0: all).
func Read(r io.Reader, max int) ([]Request, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), maxLine)
	var out []Request
	for line := 1; sc.Scan(); line++ {
		b := sc.Bytes()
		if len(b) == 0 {
			continue
		}
		var req Request
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&req); err != nil {
			return nil, fmt.Errorf("%w: line %d: %v", ErrFormat, line, err)
		}
		if err := req.valid(); err != nil {
			return nil, fmt.Errorf("%w: line %d: %v", ErrFormat, line, err)
		}
		out = append(out, req)
		if max > 0 && len(out) == max {
			break
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrFormat, err)
	}
	slices.SortStableFunc(out, func(a, b Request) int { return cmp.Compare(a.Timestamp, b.Timestamp) })
	return out, nil
}

func (r Request) valid() error {
	switch {
	case r.Timestamp < 0 || r.InputLength < 0 || r.OutputLength < 0:
		return errors.New("a negative timestamp or length")
	case len(r.HashIDs) > maxBlocks:
		return fmt.Errorf("%d hash ids, more than %d", len(r.HashIDs), maxBlocks)
	case int64(len(r.HashIDs)) > (r.InputLength+BlockTokens-1)/BlockTokens:
		return fmt.Errorf("%d hash ids for %d input tokens (one per %d)", len(r.HashIDs), r.InputLength, BlockTokens)
	}
	return nil
}

// Write writes reqs as a trace.
func Write(w io.Writer, reqs []Request) error {
	bw := bufio.NewWriter(w)
	enc := json.NewEncoder(bw)
	for _, r := range reqs {
		if r.HashIDs == nil {
			r.HashIDs = []int64{}
		}
		if err := enc.Encode(r); err != nil {
			return err
		}
	}
	return bw.Flush()
}

// Distinct is the number of distinct blocks in reqs.
func Distinct(reqs []Request) int {
	seen := map[int64]struct{}{}
	for _, r := range reqs {
		for _, id := range r.HashIDs {
			seen[id] = struct{}{}
		}
	}
	return len(seen)
}
