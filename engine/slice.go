package engine

const (
	sliceBase = 64 << 10 // the unit of spraying: small enough to spread a request over every rail
	maxSlices = 64       // a cap on slices per request, so per-slice overhead stays bounded
)

// sliceSize is the slice size for a request of n bytes: sliceBase, unless that would take more
// than maxSlices slices; then n/maxSlices rounded up to a multiple of sliceBase, so a large
// request is still cut into at most maxSlices slices.
func sliceSize(n int) int { return sliceSizeFrom(n, sliceBase) }

// sliceSizeFrom is sliceSize for a transport whose base slice is base.
func sliceSizeFrom(n, base int) int {
	if n <= base*maxSlices {
		return base
	}
	size := (n + maxSlices - 1) / maxSlices
	return (size + base - 1) / base * base
}

// cutSlices cuts a request of n bytes into consecutive spans of sliceSize(n) that cover [0, n)
// exactly. A tail under a quarter of a slice is merged into the slice before it: a tiny straggler
// would cost a whole round trip for almost no bytes. n <= sliceBase gives one span (n == 0 one
// empty span), so every request has at least one slice to carry it.
func cutSlices(n int) []span { return cutSlicesFrom(n, sliceBase) }

// cutSlicesFrom is cutSlices for a transport whose base slice is base.
func cutSlicesFrom(n, base int) []span {
	size := sliceSizeFrom(n, base)
	if n <= size {
		return []span{{0, n}}
	}
	spans := make([]span, 0, (n+size-1)/size)
	for off := 0; off < n; off += size {
		spans = append(spans, span{off, min(size, n-off)})
	}
	if last := len(spans) - 1; spans[last].n < size/4 {
		spans[last-1].n += spans[last].n
		spans = spans[:last]
	}
	return spans
}

// span is a piece of a request: bytes [off, off+n) of its buffer, and of
// its segment range.
type span struct{ off, n int }
