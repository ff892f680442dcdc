package framed

import (
	"math/bits"
	"sync"
)

// bufPool recycles frame buffers by powers of two from 4 KiB to 4 MiB: a
// lookup of 1024 blocks is a request of about 40 KiB and an answer of
// 12, and without it those buffers were half of what the master
// allocated while serving lookups (so half its garbage collections).
// Larger buffers are left to the garbage collector.
type bufPool struct {
	tiers [maxTier - minTier + 1]sync.Pool
}

const (
	minTier = 12 // 4 KiB
	maxTier = 22 // 4 MiB
)

// get returns a buffer of length n.
func (p *bufPool) get(n int) []byte {
	t := max(bits.Len(uint(n-1)), minTier)
	if n <= 0 {
		t = minTier
	}
	if t > maxTier {
		return make([]byte, n)
	}
	if b, ok := p.tiers[t-minTier].Get().(*[]byte); ok {
		return (*b)[:n]
	}
	return make([]byte, n, 1<<t)
}

// put recycles b, which the caller no longer uses. Only buffers get made
// return to a tier.
func (p *bufPool) put(b []byte) {
	c := cap(b)
	t := bits.Len(uint(c)) - 1
	if t < minTier || t > maxTier || c != 1<<t {
		return
	}
	b = b[:0]
	p.tiers[t-minTier].Put(&b)
}
