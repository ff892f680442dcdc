package tiers

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
)

// TestReview10PrefaultSmallAndOddTiers: tiers smaller than a page, not a
// multiple of one, and one byte past a chunk prefault, stay zero, and keep
// their last byte usable.
func TestReview10PrefaultSmallAndOddTiers(t *testing.T) {
	for _, size := range []int64{1, 3, 4095, 4097, prefaultChunk + 1} {
		d, err := NewDRAM("odd", size)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Prefault(context.Background()); err != nil {
			d.Close()
			t.Fatalf("size %d: %v", size, err)
		}
		last := []byte{0}
		if _, err := d.ReadAt(last, size-1); err != nil || last[0] != 0 {
			d.Close()
			t.Fatalf("size %d: last byte %v, %v", size, last, err)
		}
		if _, err := d.WriteAt([]byte{7}, size-1); err != nil {
			d.Close()
			t.Fatalf("size %d: write the last byte: %v", size, err)
		}
		if _, err := d.ReadAt(last, size-1); err != nil || last[0] != 7 {
			d.Close()
			t.Fatalf("size %d: last byte %v, %v after a write", size, last, err)
		}
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestReview10PrefaultKeepsData: the store prefaults in the background
// while it serves, so Prefault must not touch bytes already written, nor
// ones written while it runs.
func TestReview10PrefaultKeepsData(t *testing.T) {
	const size = 2*prefaultChunk + 12345
	d, err := NewDRAM("keep", size)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	offs := []int64{0, 4095, prefaultChunk - 4, prefaultChunk, 2 * prefaultChunk, size - 5}
	pattern := []byte("tide")
	for _, off := range offs {
		if _, err := d.WriteAt(pattern, off); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wrote := map[int64]bool{}
	var mu sync.Mutex
	wg.Add(1)
	go func() {
		defer wg.Done()
		for off := int64(8192); off < size-8; off += 1 << 20 {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := d.WriteAt([]byte("pool"), off); err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			wrote[off] = true
			mu.Unlock()
		}
	}()
	err = d.Prefault(context.Background())
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	for _, off := range offs {
		if _, err := d.ReadAt(buf, off); err != nil || !bytes.Equal(buf, pattern) {
			t.Fatalf("at %d: %q, %v after Prefault, want %q", off, buf, err, pattern)
		}
	}
	for off := range wrote {
		if _, err := d.ReadAt(buf, off); err != nil || string(buf) != "pool" {
			t.Fatalf("at %d: %q, %v after a write during Prefault", off, buf, err)
		}
	}
}

// TestReview10PrefaultEnds: a done context ends Prefault with its error;
// a closed tier has nothing to prefault.
func TestReview10PrefaultEnds(t *testing.T) {
	d, err := NewDRAM("ends", 3*prefaultChunk)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := d.Prefault(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Prefault with a cancelled context: %v", err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := d.Prefault(context.Background()); err != nil {
		t.Fatalf("Prefault of a closed tier: %v", err)
	}
}
