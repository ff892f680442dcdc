package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// memfdSegment is a segment over a memfd mapped MAP_SHARED, as the DRAM tier is: Mapped and
// Shareable.
type memfdSegment struct {
	*MemSegment
	fd int
}

func (s *memfdSegment) ShareFD() int { return s.fd }

func newMemfdSegment(t testing.TB, name string, size int) *memfdSegment {
	t.Helper()
	fd, err := unix.MemfdCreate("tidepool-test-"+name, unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unix.Munmap(mem)
		unix.Close(fd)
	})
	return &memfdSegment{MemSegment: NewMemSegment(name, mem), fd: fd}
}

// shmFixture is a peer serving a memfd segment "dram0" (and any extra segments), and a client's
// tcp and shm transports to it. The shm transport's describes are counted.
type shmFixture struct {
	seg       *memfdSegment
	addr      string
	tcp       *tcpTransport
	shm       *shmTransport
	describes atomic.Int64
}

func newShmFixture(t testing.TB, size int, extra ...Segment) *shmFixture {
	t.Helper()
	f := &shmFixture{seg: newMemfdSegment(t, "dram0", size)}
	f.addr = startPeer(t, Config{}, append([]Segment{f.seg}, extra...)...).addr
	f.tcp = newTCPTransport(2, time.Second, nil)
	t.Cleanup(func() { f.tcp.Close() })
	f.shm = f.newShm(t, f.tcp.describe)
	return f
}

// newShm returns a shm transport describing through desc, counted in f.describes.
func (f *shmFixture) newShm(t testing.TB, desc func(context.Context, string, string) (shmInfo, error)) *shmTransport {
	s := newShmTransport(func(ctx context.Context, addr, segment string) (shmInfo, error) {
		f.describes.Add(1)
		return desc(ctx, addr, segment)
	}, true)
	t.Cleanup(func() { s.Close() })
	return s
}

func (f *shmFixture) op(kind OpKind, segment string, off int64, buf []byte) *Op {
	return &Op{Kind: kind, Target: Target{Endpoint: f.addr, Segment: segment}, Offset: off, Buf: buf}
}

// realInfo is what describe answers for f.seg.
func (f *shmFixture) realInfo(t testing.TB) shmInfo {
	t.Helper()
	info, err := f.tcp.describe(context.Background(), f.addr, "dram0")
	if err != nil {
		t.Fatal(err)
	}
	return info
}

// sleeper starts a child process that lives until the test ends or it is killed, with extra fds
// from the test (the first is fd 3 in the child).
func sleeper(t testing.TB, fds ...int) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("sleep", "30")
	for _, fd := range fds {
		dup, err := unix.Dup(fd)
		if err != nil {
			t.Fatal(err)
		}
		f := os.NewFile(uintptr(dup), "extra")
		defer f.Close()
		cmd.ExtraFiles = append(cmd.ExtraFiles, f)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	return cmd
}

func TestDescribe(t *testing.T) {
	f := newShmFixture(t, 1<<20, NewMemSegment("plain", make([]byte, 100)))
	ctx := context.Background()

	info := f.realInfo(t)
	boot, err := hostBootID()
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(f.seg.fd, &st); err != nil {
		t.Fatal(err)
	}
	want := shmInfo{bootID: boot, pid: uint32(os.Getpid()), fd: uint32(f.seg.fd), size: 1 << 20, dev: uint64(st.Dev), ino: st.Ino}
	if info != want {
		t.Fatalf("describe = %+v, want %+v", info, want)
	}
	// A memory segment's record has no kind byte; a file segment's ends with one.
	for _, kind := range []segKind{segMemory, segFile, 7} {
		in := want
		in.kind = kind
		b := appendShmInfo(nil, in)
		if n := len(b); kind == segMemory && n != describeLen || kind != segMemory && n != describeMax {
			t.Fatalf("%v: record of %d bytes", kind, n)
		}
		if got, err := parseShmInfo(b); err != nil || got != in {
			t.Fatalf("%v: record round trip = %+v, %v; want %+v", kind, got, err, in)
		}
	}
	for _, n := range []int{0, describeLen - 1, describeMax + 1} {
		if _, err := parseShmInfo(make([]byte, n)); !errors.Is(err, ErrProtocol) {
			t.Errorf("record of %d bytes: err = %v, want ErrProtocol", n, err)
		}
	}

	for _, tt := range []struct {
		segment string
		want    error
	}{
		{"nope", ErrSegmentNotFound},
		{"plain", ErrUnsupported},
		{"", ErrInvalid},
		{"dram0", nil}, // the connection survived the errors
	} {
		if _, err := f.tcp.describe(ctx, f.addr, tt.segment); !errors.Is(err, tt.want) {
			t.Errorf("describe %q: err = %v, want %v", tt.segment, err, tt.want)
		}
	}
}

func TestDescribeStuckPeer(t *testing.T) {
	b := newBlackhole(t)
	tr := newTCPTransport(1, time.Second, nil)
	defer tr.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := tr.describe(ctx, b.addr(), "dram0"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want deadline exceeded", err)
	}
}

func TestShmSharesMemoryWithTCP(t *testing.T) {
	f := newShmFixture(t, 1<<20)
	ctx := context.Background()

	// shm write, tcp read.
	put := bytes.Repeat([]byte("shm!"), 1000)
	if err := f.shm.Do(ctx, f.op(OpWrite, "dram0", 4096, put)); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(put))
	if err := f.tcp.Do(ctx, f.op(OpRead, "dram0", 4096, got)); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, put) {
		t.Fatal("tcp read does not see the shm write")
	}

	// tcp write, shm read, up to the segment's last byte.
	put = bytes.Repeat([]byte("tcp?"), 2000)
	off := int64(1<<20 - len(put))
	if err := f.tcp.Do(ctx, f.op(OpWrite, "dram0", off, put)); err != nil {
		t.Fatal(err)
	}
	got = make([]byte, len(put))
	if err := f.shm.Do(ctx, f.op(OpRead, "dram0", off, got)); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, put) {
		t.Fatal("shm read does not see the tcp write")
	}
	if !bytes.Equal(f.seg.Bytes()[off:], put) {
		t.Fatal("segment memory does not hold the bytes")
	}
	if n := f.describes.Load(); n != 1 {
		t.Errorf("%d describes, want 1 (the mapping is cached)", n)
	}
}

func TestShmOutOfRange(t *testing.T) {
	f := newShmFixture(t, 4096)
	ctx := context.Background()
	for _, tt := range []struct {
		off  int64
		n    int
		want error
	}{
		{4095, 2, ErrOutOfRange},
		{4097, 0, ErrOutOfRange},
		{-1, 1, ErrOutOfRange},
		{0, 4097, ErrOutOfRange},
		{4096, 0, nil},
		{0, 4096, nil},
	} {
		for _, kind := range []OpKind{OpRead, OpWrite} {
			if err := f.shm.Do(ctx, f.op(kind, "dram0", tt.off, make([]byte, tt.n))); !errors.Is(err, tt.want) {
				t.Errorf("%v %d+%d: err = %v, want %v", kind, tt.off, tt.n, err, tt.want)
			}
		}
	}
}

func TestShmUnsupportedIsCached(t *testing.T) {
	f := newShmFixture(t, 4096, NewMemSegment("plain", make([]byte, 4096)))
	ctx := context.Background()
	for range 3 {
		if err := f.shm.Do(ctx, f.op(OpRead, "plain", 0, make([]byte, 10))); !errors.Is(err, ErrUnsupported) {
			t.Fatalf("err = %v, want ErrUnsupported", err)
		}
	}
	if n := f.describes.Load(); n != 1 {
		t.Fatalf("%d describes, want 1: the negative answer is cached", n)
	}
	// Other segments of the same peer are unaffected.
	if err := f.shm.Do(ctx, f.op(OpRead, "dram0", 0, make([]byte, 10))); err != nil {
		t.Fatal(err)
	}
}

func TestShmSegmentNotFound(t *testing.T) {
	f := newShmFixture(t, 4096)
	ctx := context.Background()
	for range 2 {
		if err := f.shm.Do(ctx, f.op(OpRead, "nope", 0, make([]byte, 10))); !errors.Is(err, ErrSegmentNotFound) {
			t.Fatalf("err = %v, want ErrSegmentNotFound", err)
		}
	}
	// Not cached: the segment may be registered later.
	if n := f.describes.Load(); n != 2 {
		t.Fatalf("%d describes, want 2", n)
	}
}

func TestShmOtherHost(t *testing.T) {
	f := newShmFixture(t, 4096)
	info := f.realInfo(t)
	info.bootID = "00000000-0000-0000-0000-000000000000"
	s := f.newShm(t, func(context.Context, string, string) (shmInfo, error) { return info, nil })
	for range 2 {
		if err := s.Do(context.Background(), f.op(OpRead, "dram0", 0, make([]byte, 10))); !errors.Is(err, ErrUnsupported) {
			t.Fatalf("err = %v, want ErrUnsupported", err)
		}
	}
	if n := f.describes.Load(); n != 1 {
		t.Fatalf("%d describes, want 1", n)
	}
}

func TestShmCannotOpen(t *testing.T) {
	f := newShmFixture(t, 4096)
	real := f.realInfo(t)
	child := sleeper(t)
	ctx := context.Background()
	for _, tt := range []struct {
		name string
		edit func(*shmInfo)
	}{
		{"no such fd", func(i *shmInfo) { i.pid, i.fd = uint32(child.Process.Pid), 9999 }},
		// The child's stdin is /dev/null: it opens, but it is not the described file.
		{"another file", func(i *shmInfo) { i.pid, i.fd = uint32(child.Process.Pid), 0 }},
		{"file too small", func(i *shmInfo) { i.size = 8192 }},
		{"no such pid", func(i *shmInfo) { i.pid = 1<<22 + 1 }}, // above pid_max's ceiling
	} {
		t.Run(tt.name, func(t *testing.T) {
			info := real
			tt.edit(&info)
			s := f.newShm(t, func(context.Context, string, string) (shmInfo, error) { return info, nil })
			err := s.Do(ctx, f.op(OpRead, "dram0", 0, make([]byte, 10)))
			t.Log(err)
			if !errors.Is(err, ErrUnsupported) {
				t.Fatalf("err = %v, want ErrUnsupported", err)
			}
		})
	}
}

// TestShmOwnerExits maps a memfd through a child process that holds it, kills the child, and
// checks the mapping is dropped and the next op describes afresh.
func TestShmOwnerExits(t *testing.T) {
	f := newShmFixture(t, 4096)
	real := f.realInfo(t)
	child := sleeper(t, f.seg.fd) // fd 3 in the child
	viaChild := real
	viaChild.pid, viaChild.fd = uint32(child.Process.Pid), 3
	var answer atomic.Pointer[shmInfo]
	answer.Store(&viaChild)
	s := f.newShm(t, func(context.Context, string, string) (shmInfo, error) { return *answer.Load(), nil })
	ctx := context.Background()

	if err := s.Do(ctx, f.op(OpWrite, "dram0", 0, []byte("via child"))); err != nil {
		t.Fatal(err)
	}
	if got := string(f.seg.Bytes()[:9]); got != "via child" {
		t.Fatalf("segment holds %q", got)
	}

	child.Process.Kill()
	child.Wait()
	answer.Store(&real) // the "restarted" owner
	if err := s.Do(ctx, f.op(OpRead, "dram0", 0, make([]byte, 9))); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("after the owner exited: err = %v, want ErrUnavailable", err)
	}
	got := make([]byte, 9)
	if err := s.Do(ctx, f.op(OpRead, "dram0", 0, got)); err != nil {
		t.Fatalf("after re-describe: %v", err)
	}
	if string(got) != "via child" {
		t.Fatalf("read %q", got)
	}
	if n := f.describes.Load(); n != 2 {
		t.Fatalf("%d describes, want 2", n)
	}
}

func TestShmExited(t *testing.T) {
	child := sleeper(t)
	pidfd, err := unix.PidfdOpen(child.Process.Pid, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pidfd)
	if exited(pidfd) {
		t.Fatal("live child reported exited")
	}
	child.Process.Kill()
	child.Wait()
	if !exited(pidfd) {
		t.Fatal("dead child reported alive")
	}
}

func TestShmClose(t *testing.T) {
	f := newShmFixture(t, 4096)
	ctx := context.Background()
	if err := f.shm.Do(ctx, f.op(OpRead, "dram0", 0, make([]byte, 10))); err != nil {
		t.Fatal(err)
	}
	if err := f.shm.Close(); err != nil {
		t.Fatal(err)
	}
	for _, seg := range []string{"dram0", "other"} {
		if err := f.shm.Do(ctx, f.op(OpRead, seg, 0, make([]byte, 10))); !errors.Is(err, ErrClosed) {
			t.Fatalf("%s after Close: err = %v, want ErrClosed", seg, err)
		}
	}
	if err := f.shm.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestShmConcurrent runs many ops at once on a cold transport: one describe, every byte lands,
// and a Close in the middle of traffic fails ops cleanly.
func TestShmConcurrent(t *testing.T) {
	const workers, per, chunk = 8, 50, 1024
	f := newShmFixture(t, workers*per*chunk)
	ctx := context.Background()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range per {
				off := int64((w*per + i) * chunk)
				buf := bytes.Repeat([]byte{byte(w), byte(i)}, chunk/2)
				if err := f.shm.Do(ctx, f.op(OpWrite, "dram0", off, buf)); err != nil {
					t.Error(err)
					return
				}
				got := make([]byte, chunk)
				if err := f.shm.Do(ctx, f.op(OpRead, "dram0", off, got)); err != nil || !bytes.Equal(got, buf) {
					t.Errorf("read back %d: err %v, equal %v", off, err, bytes.Equal(got, buf))
					return
				}
			}
		})
	}
	wg.Wait()
	if n := f.describes.Load(); n != 1 {
		t.Fatalf("%d describes, want 1", n)
	}

	s := f.newShm(t, f.tcp.describe)
	var ok atomic.Int64
	for range workers {
		wg.Go(func() {
			for {
				err := s.Do(ctx, f.op(OpRead, "dram0", 0, make([]byte, chunk)))
				if errors.Is(err, ErrClosed) {
					return
				}
				if err != nil {
					t.Error(err)
					return
				}
				ok.Add(1)
			}
		})
	}
	waitFor(t, "ops before Close", func() bool { return ok.Load() > 100 })
	s.Close()
	wg.Wait()
}

func benchShm(b *testing.B, kind OpKind) {
	const size = 4 << 20
	f := newShmFixture(b, size)
	buf := make([]byte, size)
	op := f.op(kind, "dram0", 0, buf)
	ctx := context.Background()
	if err := f.shm.Do(ctx, op); err != nil { // map, and fault the pages in
		b.Fatal(err)
	}
	b.SetBytes(size)
	for b.Loop() {
		if err := f.shm.Do(ctx, op); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkShmRead(b *testing.B)  { benchShm(b, OpRead) }
func BenchmarkShmWrite(b *testing.B) { benchShm(b, OpWrite) }

// BenchmarkMemcpy is the baseline for the shm benchmarks: a plain copy of the same size.
func BenchmarkMemcpy(b *testing.B) {
	const size = 4 << 20
	src, dst := make([]byte, size), make([]byte, size)
	copy(dst, src)
	b.SetBytes(size)
	for b.Loop() {
		copy(dst, src)
	}
}

// TestShmCopyCached: the batch fast path copies through a cached mapping
// only, and its one liveness check after the copies catches an owner that
// exited: the mapping is dropped, so the op goes back to Do.
func TestShmCopyCached(t *testing.T) {
	f := newShmFixture(t, 4096)
	real := f.realInfo(t)
	child := sleeper(t, f.seg.fd)
	viaChild := real
	viaChild.pid, viaChild.fd = uint32(child.Process.Pid), 3
	s := f.newShm(t, func(context.Context, string, string) (shmInfo, error) { return viaChild, nil })

	op := f.op(OpWrite, "dram0", 0, []byte("inline"))
	if _, _, handled, _ := s.copyCached(op); handled {
		t.Fatal("copyCached handled an op before the segment was mapped")
	}
	if err := s.Do(context.Background(), f.op(OpWrite, "dram0", 0, []byte("mapped"))); err != nil {
		t.Fatal(err)
	}
	key, m, handled, err := s.copyCached(op)
	if !handled || err != nil {
		t.Fatalf("copyCached of a mapped segment: handled %v, %v", handled, err)
	}
	if err := s.landed(key, m); err != nil || string(f.seg.Bytes()[:6]) != "inline" {
		t.Fatalf("landed = %v; segment holds %q", err, f.seg.Bytes()[:6])
	}
	if _, _, handled, err := s.copyCached(f.op(OpWrite, "dram0", 4090, make([]byte, 10))); !handled || !errors.Is(err, ErrOutOfRange) {
		t.Fatalf("copyCached past the end: handled %v, %v; want ErrOutOfRange", handled, err)
	}

	child.Process.Kill()
	child.Wait()
	key, m, handled, _ = s.copyCached(op)
	if !handled {
		t.Fatal("copyCached did not use the cached mapping")
	}
	if err := s.landed(key, m); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("landed after the owner exited = %v, want ErrUnavailable", err)
	}
	if _, _, handled, _ := s.copyCached(op); handled {
		t.Fatal("copyCached used a mapping dropped for a dead owner")
	}
}

// A write reads a word of each fault-around span first: whatever the
// offset and length, the bytes land where asked and nowhere else, up to
// the segment's last byte.
func TestShmWriteSpans(t *testing.T) {
	const size = 4 * faultAround
	f := newShmFixture(t, size)
	ctx := context.Background()
	for _, tt := range []struct {
		off int64
		n   int
	}{
		{0, 1}, {1, 3}, {faultAround - 1, 2}, {4093, faultAround + 7}, {faultAround, faultAround},
		{size - faultAround, faultAround}, {size - 1, 1}, {size - 3, 3}, {size, 0}, {5, 0},
	} {
		mem := f.seg.Bytes()
		for i := range mem {
			mem[i] = 0xee
		}
		put := bytes.Repeat([]byte{7}, tt.n)
		if err := f.shm.Do(ctx, f.op(OpWrite, "dram0", tt.off, put)); err != nil {
			t.Fatalf("%d+%d: %v", tt.off, tt.n, err)
		}
		for i, b := range mem {
			want := byte(0xee)
			if int64(i) >= tt.off && int64(i) < tt.off+int64(tt.n) {
				want = 7
			}
			if b != want {
				t.Fatalf("%d+%d: byte %d = %#x, want %#x", tt.off, tt.n, i, b, want)
			}
		}
	}
}

// TestShmWarm: once the engine maps a peer's segment it touches every committed page of it in
// the background, ShmWarmth reports the progress, and NoShmWarm leaves the pages to the copies.
func TestShmWarm(t *testing.T) {
	const size = 32 << 20
	seg := newMemfdSegment(t, "dram0", size)
	// Committed and written, as a prefaulted tier is (fallocated pages not yet written are not
	// in the page cache for mincore, and warm leaves them alone).
	if err := unix.Madvise(seg.Bytes(), unix.MADV_POPULATE_WRITE); err != nil {
		t.Skip("MADV_POPULATE_WRITE:", err)
	}
	p := startPeer(t, Config{}, seg)
	target := Target{Endpoint: p.addr, Segment: "dram0"}
	for _, noWarm := range []bool{false, true} {
		e := newClient(t, Config{NoShmWarm: noWarm})
		if w := e.ShmWarmth(); w != (ShmWarmth{}) {
			t.Fatalf("before any op: %+v", w)
		}
		b := e.NewBatch()
		b.Write([]byte("first"), target, 0, Options{})
		if err := b.Run(context.Background()); err != nil {
			t.Fatal(err)
		}
		for deadline := time.Now().Add(time.Minute); e.ShmWarmth().Cold > 0; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("NoShmWarm %v: still cold after a minute: %+v", noWarm, e.ShmWarmth())
			}
		}
		if w := e.ShmWarmth(); w != (ShmWarmth{Mapped: size}) {
			t.Fatalf("NoShmWarm %v: %+v, want %d mapped and nothing cold", noWarm, w, size)
		}
		m := cachedMapping(t, e.shm, shmKey{p.addr, "dram0"})
		present := presentPages(t, m.mem)
		pages := size / os.Getpagesize()
		switch {
		case !noWarm && present != pages:
			t.Fatalf("warmed: %d of %d pages mapped in this process", present, pages)
		case noWarm && present > pages/2:
			t.Fatalf("NoShmWarm: %d of %d pages mapped in this process after one small write", present, pages)
		}
	}
}

// TestShmWarmStopsOnClose: Close in the middle of a warm waits for it to stop (goleak checks
// that nothing is left), and ops after it fail with ErrClosed.
func TestShmWarmStopsOnClose(t *testing.T) {
	f := newShmFixture(t, 256<<20)
	ctx := context.Background()
	if err := f.shm.Do(ctx, f.op(OpWrite, "dram0", 0, []byte("x"))); err != nil {
		t.Fatal(err)
	}
	m := cachedMapping(t, f.shm, shmKey{f.addr, "dram0"})
	if err := f.shm.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-m.warmDone:
	default:
		t.Fatal("Close returned before the warm stopped")
	}
	if err := f.shm.Do(ctx, f.op(OpRead, "dram0", 0, make([]byte, 1))); !errors.Is(err, ErrClosed) {
		t.Fatalf("after Close: err = %v, want ErrClosed", err)
	}
}

func cachedMapping(t *testing.T, s *shmTransport, key shmKey) *shmMapping {
	t.Helper()
	s.cache.mu.RLock()
	defer s.cache.mu.RUnlock()
	e := s.cache.mu.m[key]
	if e == nil || e.h == nil {
		t.Fatalf("no mapping cached for %v", key)
	}
	return e.h
}

// presentPages counts the pages of mem that this process's page tables map
// (bit 63 of each page's entry in /proc/self/pagemap).
func presentPages(t *testing.T, mem []byte) int {
	t.Helper()
	f, err := os.Open("/proc/self/pagemap")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	page := os.Getpagesize()
	entries := make([]byte, 8*(len(mem)/page))
	if _, err := f.ReadAt(entries, int64(uintptr(unsafe.Pointer(&mem[0]))/uintptr(page))*8); err != nil {
		t.Fatal(err)
	}
	n := 0
	for i := 0; i < len(entries); i += 8 {
		if entries[i+7]&0x80 != 0 {
			n++
		}
	}
	return n
}

// TestShmOwnerExitedBeforeOpen: a describe that names an owner which exits before the
// mapping's open fails with ErrUnavailable and is not cached, so the restarted owner is
// reached through shm again.
func TestShmOwnerExitedBeforeOpen(t *testing.T) {
	f := newShmFixture(t, 4096)
	real := f.realInfo(t)
	child := sleeper(t, f.seg.fd) // fd 3 in the child
	viaChild := real
	viaChild.pid, viaChild.fd = uint32(child.Process.Pid), 3
	child.Process.Kill() // a zombie until reaped: its pid stays, its fds are gone
	stat := fmt.Sprintf("/proc/%d/stat", child.Process.Pid)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if b, err := os.ReadFile(stat); err == nil && strings.Contains(string(b), ") Z ") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the killed child never became a zombie")
		}
	}
	var answer atomic.Pointer[shmInfo]
	answer.Store(&viaChild)
	s := f.newShm(t, func(context.Context, string, string) (shmInfo, error) { return *answer.Load(), nil })
	ctx := context.Background()
	if err := s.Do(ctx, f.op(OpRead, "dram0", 0, make([]byte, 1))); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("owner exited before the open: err = %v, want ErrUnavailable", err)
	}
	answer.Store(&real)
	if err := s.Do(ctx, f.op(OpRead, "dram0", 0, make([]byte, 1))); err != nil {
		t.Fatalf("the restarted owner: %v (the exit was cached)", err)
	}
}
