package engine

// span is a piece of a task: bytes [off, off+n) of its buffer, and of its segment range.
type span struct{ off, n int }

const (
	chunkMin   = 1 << 20  // below this a task travels whole: splitting costs more than it wins
	chunkMax   = 4 << 20  // above this a chunk holds a connection too long
	chunkAlign = 64 << 10 // chunk sizes are multiples of this
)

// split cuts a task of n bytes into spans to run in parallel over about `ways` connections. It is
// the stand-in for the later slicer and sprayer (64 KiB slices sprayed over rails by predicted
// finish time), which will replace it. A tail under a quarter chunk is merged into the span before
// it, so no request ends with a tiny straggler.
func split(n, ways int) []span {
	if n <= chunkMin {
		return []span{{0, n}}
	}
	size := (n + max(ways, 1) - 1) / max(ways, 1)
	size = (size + chunkAlign - 1) / chunkAlign * chunkAlign
	size = min(max(size, chunkMin), chunkMax)
	spans := make([]span, 0, (n+size-1)/size)
	for off := 0; off < n; off += size {
		spans = append(spans, span{off, min(size, n-off)})
	}
	if last := len(spans) - 1; last > 0 && spans[last].n < size/4 {
		spans[last-1].n += spans[last].n
		spans = spans[:last]
	}
	return spans
}
