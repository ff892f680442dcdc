package master

import (
	"fmt"
	"sort"
)

// allocator hands out aligned byte ranges of one segment. It is part of the
// FSM, so it must be deterministic: first fit over a free list kept sorted by
// offset, with neighbours merged on free.
type allocator struct {
	capacity uint64
	align    uint64
	free     []span // sorted by off, non-adjacent
	used     uint64
}

type span struct{ off, len uint64 }

func newAllocator(capacity, align uint64) *allocator {
	a := &allocator{capacity: capacity - capacity%align, align: align}
	if a.capacity > 0 {
		a.free = []span{{0, a.capacity}}
	}
	return a
}

// rounded is the space an object of size n occupies.
func (a *allocator) rounded(n uint64) uint64 {
	return (n + a.align - 1) / a.align * a.align
}

// alloc returns the offset of a free range of at least n bytes.
func (a *allocator) alloc(n uint64) (uint64, bool) {
	if n > a.capacity { // also keeps rounded from overflowing
		return 0, false
	}
	n = a.rounded(n)
	for i, s := range a.free {
		if s.len < n {
			continue
		}
		if s.len == n {
			a.free = append(a.free[:i], a.free[i+1:]...)
		} else {
			a.free[i] = span{s.off + n, s.len - n}
		}
		a.used += n
		return s.off, true
	}
	return 0, false
}

// release returns the range of an object of size n at off.
func (a *allocator) release(off, n uint64) {
	n = a.rounded(n)
	i := sort.Search(len(a.free), func(i int) bool { return a.free[i].off > off })
	mergePrev := i > 0 && a.free[i-1].off+a.free[i-1].len == off
	mergeNext := i < len(a.free) && off+n == a.free[i].off
	switch {
	case mergePrev && mergeNext:
		a.free[i-1].len += n + a.free[i].len
		a.free = append(a.free[:i], a.free[i+1:]...)
	case mergePrev:
		a.free[i-1].len += n
	case mergeNext:
		a.free[i] = span{off, n + a.free[i].len}
	default:
		a.free = append(a.free, span{})
		copy(a.free[i+1:], a.free[i:])
		a.free[i] = span{off, n}
	}
	a.used -= n
}

// reserve marks a known range as used; restore rebuilds allocators with it.
func (a *allocator) reserve(off, n uint64) error {
	if n > a.capacity || off > a.capacity-n {
		return fmt.Errorf("range [%d, +%d) is outside the segment", off, n)
	}
	n = a.rounded(n)
	i := sort.Search(len(a.free), func(i int) bool { return a.free[i].off+a.free[i].len > off })
	if i == len(a.free) || a.free[i].off > off || off+n > a.free[i].off+a.free[i].len {
		return fmt.Errorf("range [%d, %d) is not free", off, off+n)
	}
	s := a.free[i]
	var parts []span
	if off > s.off {
		parts = append(parts, span{s.off, off - s.off})
	}
	if end := s.off + s.len; off+n < end {
		parts = append(parts, span{off + n, end - off - n})
	}
	a.free = append(a.free[:i], append(parts, a.free[i+1:]...)...)
	a.used += n
	return nil
}

// largestFree is the biggest object that fits right now.
func (a *allocator) largestFree() uint64 {
	var m uint64
	for _, s := range a.free {
		m = max(m, s.len)
	}
	return m
}
