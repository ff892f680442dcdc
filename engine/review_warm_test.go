package engine

import (
	"context"
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Review of the shm warm (771a9e2).

// waitWarm polls ShmWarmth until nothing is cold.
func waitWarm(t *testing.T, e *Engine) ShmWarmth {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		w := e.ShmWarmth()
		if w.Cold == 0 {
			return w
		}
		if time.Now().After(deadline) {
			t.Fatalf("still cold after a minute: %+v", w)
		}
		time.Sleep(time.Millisecond)
	}
}

// committed is how many bytes of the memfd hold pages (st_blocks).
func committed(t *testing.T, fd int) int64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

// TestReviewShmWarmCommitsLazyTier: a store run with --prefault=false keeps
// its DRAM tier sparse ("commit pages as they are first written"; NewDRAM:
// "an idle tier costs little"). A read fault on a hole of a shmem mapping
// allocates the page, charged to the client's memcg, so the warm must touch
// only pages the store has committed: a 1-byte write and the warm that
// follows commit next to nothing.
func TestReviewShmWarmCommitsLazyTier(t *testing.T) {
	const size = 64 << 20
	seg := newMemfdSegment(t, "dram0", size) // sparse, as NewDRAM without Prefault
	p := startPeer(t, Config{}, seg)
	if c := committed(t, seg.fd); c != 0 {
		t.Fatalf("fresh memfd has %d bytes committed", c)
	}
	// Control: without the warm a 1-byte write commits next to nothing.
	cold := newClient(t, Config{NoShmWarm: true})
	b := cold.NewBatch()
	b.Write([]byte("x"), Target{Endpoint: p.addr, Segment: "dram0"}, 0, Options{})
	if err := b.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	if c := committed(t, seg.fd); c > 4<<20 {
		t.Fatalf("NoShmWarm: %d bytes committed after a 1-byte write", c)
	}
	e := newClient(t, Config{})
	b = e.NewBatch()
	b.Write([]byte("x"), Target{Endpoint: p.addr, Segment: "dram0"}, 0, Options{})
	if err := b.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	waitWarm(t, e)
	if c := committed(t, seg.fd); c > 4<<20 {
		t.Fatalf("after a 1-byte write and the client's warm, %d MiB of the peer's %d MiB sparse segment is committed (charged to the client)",
			c>>20, size>>20)
	}
}

// TestReviewShmWarmOddSizes: segments of 1 byte, a page, a page and a bit,
// and not a multiple of the page size warm without a fault and report
// Mapped = size, Cold = 0. (Passes.)
func TestReviewShmWarmOddSizes(t *testing.T) {
	page := os.Getpagesize()
	for _, size := range []int{1, 3, page - 1, page, page + 1, warmChunk - 1, warmChunk + 5, 3*warmChunk + page/2} {
		seg := newMemfdSegment(t, "dram0", size)
		p := startPeer(t, Config{}, seg)
		e := newClient(t, Config{})
		b := e.NewBatch()
		b.Write([]byte("x"), Target{Endpoint: p.addr, Segment: "dram0"}, int64(size-1), Options{})
		if err := b.Run(context.Background()); err != nil {
			t.Fatalf("size %d: %v", size, err)
		}
		if w := waitWarm(t, e); w != (ShmWarmth{Mapped: int64(size)}) {
			t.Fatalf("size %d: %+v", size, w)
		}
		e.Close()
	}
}

// TestReviewShmWarmConcurrent: ShmWarmth polled while copies run, the owner
// exits (forget, whose release waits for a warm mid-way), the mapping is
// re-made, and the transport closes; under -race and goleak. (Passes.)
func TestReviewShmWarmConcurrent(t *testing.T) {
	const size = 128 << 20
	f := newShmFixture(t, size)
	real := f.realInfo(t)
	child := sleeper(t, f.seg.fd)
	viaChild := real
	viaChild.pid, viaChild.fd = uint32(child.Process.Pid), 3
	var answer atomic.Pointer[shmInfo]
	answer.Store(&viaChild)
	s := f.newShm(t, func(context.Context, string, string) (shmInfo, error) { return *answer.Load(), nil })
	e := &Engine{shm: s}
	ctx := context.Background()

	if err := s.Do(ctx, f.op(OpWrite, "dram0", 0, []byte("x"))); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var unavailable atomic.Int64
	var wg sync.WaitGroup
	for w := range 2 {
		wg.Go(func() {
			buf := make([]byte, 4096)
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				op := f.op(OpWrite, "dram0", int64((i*2+w)%(size/4096))*4096, buf)
				err := s.Do(ctx, op)
				if errors.Is(err, ErrUnavailable) {
					unavailable.Add(1)
				}
				if err != nil && !errors.Is(err, ErrUnavailable) && !errors.Is(err, ErrClosed) {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			if w := e.ShmWarmth(); w.Cold < 0 || w.Cold > w.Mapped || w.Mapped > size {
				t.Errorf("ShmWarmth %+v", w)
				return
			}
		}
	})
	time.Sleep(20 * time.Millisecond)
	t.Logf("at the kill: %+v", e.ShmWarmth())
	answer.Store(&real) // before the kill: a describe of the dying child would cache ErrUnsupported
	child.Process.Kill()
	child.Wait()
	time.Sleep(50 * time.Millisecond)
	t.Logf("at Close: %+v", e.ShmWarmth())
	s.Close()
	close(stop)
	wg.Wait()
	if w := e.ShmWarmth(); w != (ShmWarmth{}) {
		t.Fatalf("after Close: %+v", w)
	}
	if unavailable.Load() == 0 {
		t.Fatal("no op saw the owner exit: the forget path was not exercised")
	}
}
