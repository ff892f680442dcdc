package engine

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
)

// TestReview10ShmWriteEdges: the word a write reads first, at segments
// whose size is not a multiple of 4 (or of a page), at their last bytes,
// for zero-length writes anywhere up to the end, through Do and through
// copyCached; refused writes change nothing.
func TestReview10ShmWriteEdges(t *testing.T) {
	ctx := context.Background()
	for _, size := range []int{1, 2, 3, 5, 4095, 4097, faultAround + 3, 2*faultAround - 1} {
		f := newShmFixture(t, size)
		mem := f.seg.Bytes()
		check := func(what string, off int64, n int, b byte) {
			t.Helper()
			for i, got := range mem {
				want := byte(0xee)
				if int64(i) >= off && int64(i) < off+int64(n) {
					want = b
				}
				if got != want {
					t.Fatalf("size %d, %s %d+%d: byte %d = %#x, want %#x", size, what, off, n, i, got, want)
				}
			}
		}
		type write struct {
			off int64
			n   int
		}
		var ws []write
		for back := 0; back <= min(size, 9); back++ {
			for n := 0; n <= back; n++ {
				ws = append(ws, write{int64(size - back), n})
			}
		}
		if size > faultAround {
			ws = append(ws, write{faultAround - 3, size - faultAround + 3}, write{1, size - 1}, write{3, faultAround - 2})
		}
		for i, w := range ws {
			for j := range mem {
				mem[j] = 0xee
			}
			b := byte(i%200 + 1)
			if err := f.shm.Do(ctx, f.op(OpWrite, "dram0", w.off, bytes.Repeat([]byte{b}, w.n))); err != nil {
				t.Fatalf("size %d, Do %d+%d: %v", size, w.off, w.n, err)
			}
			check("Do", w.off, w.n, b)
			for j := range mem {
				mem[j] = 0xee
			}
			_, _, handled, err := f.shm.copyCached(f.op(OpWrite, "dram0", w.off, bytes.Repeat([]byte{b}, w.n)))
			if !handled || err != nil {
				t.Fatalf("size %d, copyCached %d+%d: handled %v, %v", size, w.off, w.n, handled, err)
			}
			check("copyCached", w.off, w.n, b)
		}
		for j := range mem {
			mem[j] = 0xee
		}
		for _, w := range []write{{int64(size), 1}, {int64(size + 1), 0}, {int64(size - 1), 2}, {-1, 1}} {
			err := f.shm.Do(ctx, f.op(OpWrite, "dram0", w.off, bytes.Repeat([]byte{1}, w.n)))
			if !errors.Is(err, ErrOutOfRange) {
				t.Fatalf("size %d, write %d+%d: %v, want ErrOutOfRange", size, w.off, w.n, err)
			}
			check("refused", 0, 0, 0)
		}
	}
}

// TestReview10ShmConcurrentAdjacentWrites: writes to adjacent extents at
// odd offsets (whose first words overlap their neighbours' bytes) run at
// once and each lands whole; under -race nothing is reported.
func TestReview10ShmConcurrentAdjacentWrites(t *testing.T) {
	const size = 4 * faultAround
	f := newShmFixture(t, size)
	ctx := context.Background()
	// Warm the mapping so the writers share it.
	if err := f.shm.Do(ctx, f.op(OpWrite, "dram0", 0, []byte{0})); err != nil {
		t.Fatal(err)
	}
	const n, width = 64, 4093 // odd widths: extents start at every residue mod 4
	var wg sync.WaitGroup
	for round := range 20 {
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				b := bytes.Repeat([]byte{byte(i + round)}, width)
				if err := f.shm.Do(ctx, f.op(OpWrite, "dram0", int64(i*width), b)); err != nil {
					t.Error(err)
				}
			}()
		}
		wg.Wait()
		mem := f.seg.Bytes()
		for i := range n {
			for j := i * width; j < (i+1)*width; j++ {
				if mem[j] != byte(i+round) {
					t.Fatalf("round %d: byte %d of extent %d = %d, want %d", round, j, i, mem[j], i+round)
				}
			}
		}
	}
}
