package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/tidepool-kv/tidepool/engine/directio"
)

// fileSegment is a segment over a file, as the SSD tier is: ReadAt and WriteAt are pread and
// pwrite; it is Shareable (its fd) and FileBacked.
type fileSegment struct {
	name string
	f    *os.File
	fd   int
	size int64
}

func (s *fileSegment) Name() string     { return s.name }
func (s *fileSegment) Size() int64      { return s.size }
func (s *fileSegment) ShareFD() int     { return s.fd }
func (s *fileSegment) FileBacked() bool { return true }

func (s *fileSegment) ReadAt(p []byte, off int64) (int, error) {
	if !inRange(off, int64(len(p)), s.size) {
		return 0, fmt.Errorf("%w: read %d+%d of %q (size %d)", ErrOutOfRange, off, len(p), s.name, s.size)
	}
	return s.f.ReadAt(p, off)
}

func (s *fileSegment) WriteAt(p []byte, off int64) (int, error) {
	if !inRange(off, int64(len(p)), s.size) {
		return 0, fmt.Errorf("%w: write %d+%d of %q (size %d)", ErrOutOfRange, off, len(p), s.name, s.size)
	}
	return s.f.WriteAt(p, off)
}

// newFileSegment preallocates a file of size bytes in dir and serves it as a segment.
func newFileSegment(t testing.TB, dir, name string, size int64) *fileSegment {
	t.Helper()
	f, err := os.CreateTemp(dir, "tidepool-test-"+name+"-*")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		f.Close()
		os.Remove(f.Name())
	})
	if err := unix.Fallocate(int(f.Fd()), 0, 0, size); err != nil {
		if err := f.Truncate(size); err != nil {
			t.Fatal(err)
		}
	}
	return &fileSegment{name: name, f: f, fd: int(f.Fd()), size: size}
}

// alignedBuf returns n bytes at a directio.Align-aligned address.
func alignedBuf(n int) []byte {
	b := make([]byte, n+directio.Align)
	skip := (directio.Align - int(uintptr(unsafe.Pointer(&b[0]))%directio.Align)) % directio.Align
	return b[skip : skip+n : skip+n]
}

// fsType names the filesystem dir is on, for the logs.
func fsType(dir string) string {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return err.Error()
	}
	switch st.Type {
	case unix.TMPFS_MAGIC:
		return "tmpfs"
	case unix.EXT4_SUPER_MAGIC:
		return "ext4"
	case unix.XFS_SUPER_MAGIC:
		return "xfs"
	case unix.BTRFS_SUPER_MAGIC:
		return "btrfs"
	case unix.OVERLAYFS_SUPER_MAGIC:
		return "overlayfs"
	}
	return fmt.Sprintf("fs 0x%x", st.Type)
}

// fileFixture is a peer serving a file segment "ssd0" (and a memfd "dram0", a plain "plain"),
// and a client's tcp and file transports to it. The file transport's describes are counted.
type fileFixture struct {
	seg       *fileSegment
	mem       *memfdSegment
	addr      string
	reg       *prometheus.Registry // the peer's metrics
	tcp       *tcpTransport
	file      *fileTransport
	describes atomic.Int64
}

func newFileFixture(t testing.TB, dir string, size int64) *fileFixture {
	t.Helper()
	f := &fileFixture{
		seg: newFileSegment(t, dir, "ssd0", size),
		mem: newMemfdSegment(t, "dram0", 4096),
		reg: prometheus.NewRegistry(),
	}
	f.addr = startPeer(t, Config{Registerer: f.reg}, f.seg, f.mem, NewMemSegment("plain", make([]byte, 4096))).addr
	f.tcp = newTCPTransport(2, time.Second, nil)
	t.Cleanup(func() { f.tcp.Close() })
	f.file = f.newFile(t, f.tcp.describe)
	return f
}

// newFile returns a file transport describing through desc, counted in f.describes.
func (f *fileFixture) newFile(t testing.TB, desc func(context.Context, string, string) (shmInfo, error)) *fileTransport {
	s := newFileTransport(func(ctx context.Context, addr, segment string) (shmInfo, error) {
		f.describes.Add(1)
		return desc(ctx, addr, segment)
	})
	t.Cleanup(func() { s.Close() })
	return s
}

func (f *fileFixture) op(kind OpKind, segment string, off int64, buf []byte) *Op {
	return &Op{Kind: kind, Target: Target{Endpoint: f.addr, Segment: segment}, Offset: off, Buf: buf}
}

// hasDirect reports whether tr holds an O_DIRECT fd for f's "ssd0".
func (f *fileFixture) hasDirect(tr *fileTransport) bool {
	h, err := tr.cache.get(context.Background(), shmKey{addr: f.addr, segment: "ssd0"})
	return err == nil && h.direct >= 0
}

// fileDirs are where the file tests put their files: the test's temp dir (a disk here) and, if
// there is one, /dev/shm (tmpfs, where O_DIRECT may not open).
func fileDirs(t *testing.T) map[string]string {
	dirs := map[string]string{"tempdir": t.TempDir()}
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		dir, err := os.MkdirTemp("/dev/shm", "tidepool-test-")
		if err == nil {
			t.Cleanup(func() { os.RemoveAll(dir) })
			dirs["devshm"] = dir
		}
	}
	return dirs
}

// TestFileSharesWithTCP writes and reads through the file transport and checks tcp sees the same
// bytes, both ways, aligned (O_DIRECT where the filesystem allows it) and not.
func TestFileSharesWithTCP(t *testing.T) {
	for name, dir := range fileDirs(t) {
		t.Run(name, func(t *testing.T) {
			const size = 4 << 20
			f := newFileFixture(t, dir, size)
			ctx := context.Background()
			r := rand.New(rand.NewPCG(3, 4))

			// With O_DIRECT: ops on whole blocks from an aligned buffer go
			// straight to the disk, others bounce, and only a write that does
			// not start on a block goes through the page cache.
			for _, tt := range []struct {
				name                      string
				off                       int64
				n                         int
				direct, bounced, buffered int64
			}{
				{"aligned", 8192, 256 << 10, 2, 0, 0},
				{"unaligned offset", 8193, 256 << 10, 0, 1, 1},
				{"unaligned length", 8192, 256<<10 - 100, 0, 2, 0},
				{"unaligned buffer", 8192, 256 << 10, 0, 2, 0},
				{"last bytes", size - 4096, 4096, 2, 0, 0},
			} {
				t.Run(tt.name, func(t *testing.T) {
					buf := func() []byte {
						b := alignedBuf(tt.n + 1)
						if tt.name == "unaligned buffer" {
							return b[1:]
						}
						return b[:tt.n]
					}
					direct0, bounced0, buffered0 := f.file.direct.Load(), f.file.bounced.Load(), f.file.buffered.Load()

					// file write, tcp read.
					put := buf()
					copy(put, randomBytes(r, tt.n))
					if err := f.file.Do(ctx, f.op(OpWrite, "ssd0", tt.off, put)); err != nil {
						t.Fatal(err)
					}
					got := make([]byte, tt.n)
					if err := f.tcp.Do(ctx, f.op(OpRead, "ssd0", tt.off, got)); err != nil {
						t.Fatal(err)
					}
					if !bytes.Equal(got, put) {
						t.Fatal("tcp read does not see the file write")
					}

					// tcp write, file read.
					put = randomBytes(r, tt.n)
					if err := f.tcp.Do(ctx, f.op(OpWrite, "ssd0", tt.off, put)); err != nil {
						t.Fatal(err)
					}
					got = buf()
					if err := f.file.Do(ctx, f.op(OpRead, "ssd0", tt.off, got)); err != nil {
						t.Fatal(err)
					}
					if !bytes.Equal(got, put) {
						t.Fatal("file read does not see the tcp write")
					}
					want := [3]int64{tt.direct, tt.bounced, tt.buffered}
					if !f.hasDirect(f.file) {
						want = [3]int64{0, 0, 2}
					}
					got3 := [3]int64{f.file.direct.Load() - direct0, f.file.bounced.Load() - bounced0, f.file.buffered.Load() - buffered0}
					if got3 != want {
						t.Errorf("direct, bounced, buffered ops %v, want %v", got3, want)
					}
				})
			}
			t.Logf("%s (%s): O_DIRECT %v; %d direct ops, %d bounced, %d buffered", dir, fsType(dir),
				map[bool]string{true: "used", false: "did not open: every op buffered"}[f.hasDirect(f.file)],
				f.file.direct.Load(), f.file.bounced.Load(), f.file.buffered.Load())
			if n := served(t, f.reg); n != 8*(256<<10)-2*100+2*4096 { // only the tcp halves
				t.Errorf("the server served %v bytes", n)
			}
			if n := f.describes.Load(); n != 1 {
				t.Errorf("%d describes, want 1 (the file is kept open)", n)
			}
		})
	}
}

// TestFileDirectFallback: where O_DIRECT cannot be opened, aligned ops are buffered.
func TestFileDirectFallback(t *testing.T) {
	f := newFileFixture(t, t.TempDir(), 1<<20)
	f.file.openDirect = func(int) (int, error) { return -1, unix.EINVAL }
	ctx := context.Background()
	put := alignedBuf(64 << 10)
	copy(put, bytes.Repeat([]byte("fallback"), len(put)/8))
	if err := f.file.Do(ctx, f.op(OpWrite, "ssd0", 4096, put)); err != nil {
		t.Fatal(err)
	}
	got := alignedBuf(len(put))
	if err := f.file.Do(ctx, f.op(OpRead, "ssd0", 4096, got)); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, put) {
		t.Fatal("read back other bytes")
	}
	if d, b := f.file.direct.Load(), f.file.buffered.Load(); d != 0 || b != 2 {
		t.Fatalf("%d direct and %d buffered ops, want 0 and 2", d, b)
	}
}

func TestFileOutOfRange(t *testing.T) {
	f := newFileFixture(t, t.TempDir(), 8192)
	ctx := context.Background()
	for _, tt := range []struct {
		off  int64
		n    int
		want error
	}{
		{8191, 2, ErrOutOfRange},
		{8193, 0, ErrOutOfRange},
		{-1, 1, ErrOutOfRange},
		{0, 8193, ErrOutOfRange},
		{4096, 8192, ErrOutOfRange},
		{8192, 0, nil},
		{0, 8192, nil},
		{4096, 4096, nil},
	} {
		for _, kind := range []OpKind{OpRead, OpWrite} {
			if err := f.file.Do(ctx, f.op(kind, "ssd0", tt.off, alignedBuf(tt.n))); !errors.Is(err, tt.want) {
				t.Errorf("%v %d+%d: err = %v, want %v", kind, tt.off, tt.n, err, tt.want)
			}
		}
	}
	if n := served(t, f.reg); n != 0 {
		t.Errorf("the server served %v bytes, want 0", n)
	}
}

// TestFileUnsupportedIsCached: segments that are not files are not the file transport's, files
// are not shm's, and both answers are cached.
func TestFileUnsupportedIsCached(t *testing.T) {
	f := newFileFixture(t, t.TempDir(), 4096)
	ctx := context.Background()
	for _, seg := range []string{"dram0", "plain"} {
		before := f.describes.Load()
		for range 3 {
			if err := f.file.Do(ctx, f.op(OpRead, seg, 0, make([]byte, 10))); !errors.Is(err, ErrUnsupported) {
				t.Fatalf("%s: err = %v, want ErrUnsupported", seg, err)
			}
		}
		if n := f.describes.Load() - before; n != 1 {
			t.Fatalf("%s: %d describes, want 1: the negative answer is cached", seg, n)
		}
	}
	if err := f.file.Do(ctx, f.op(OpRead, "ssd0", 0, make([]byte, 10))); err != nil {
		t.Fatal(err)
	}

	var shmDescribes atomic.Int64
	shm := newShmTransport(func(ctx context.Context, addr, segment string) (shmInfo, error) {
		shmDescribes.Add(1)
		return f.tcp.describe(ctx, addr, segment)
	}, true)
	defer shm.Close()
	for range 3 {
		if err := shm.Do(ctx, f.op(OpRead, "ssd0", 0, make([]byte, 10))); !errors.Is(err, ErrUnsupported) {
			t.Fatalf("shm on a file: err = %v, want ErrUnsupported", err)
		}
	}
	if n := shmDescribes.Load(); n != 1 {
		t.Fatalf("shm on a file: %d describes, want 1", n)
	}
}

func TestFileSegmentNotFound(t *testing.T) {
	f := newFileFixture(t, t.TempDir(), 4096)
	for range 2 {
		if err := f.file.Do(context.Background(), f.op(OpRead, "nope", 0, make([]byte, 10))); !errors.Is(err, ErrSegmentNotFound) {
			t.Fatalf("err = %v, want ErrSegmentNotFound", err)
		}
	}
	if n := f.describes.Load(); n != 2 {
		t.Fatalf("%d describes, want 2: not found is not cached", n)
	}
}

func TestFileOtherHostOrKind(t *testing.T) {
	f := newFileFixture(t, t.TempDir(), 4096)
	real, err := f.tcp.describe(context.Background(), f.addr, "ssd0")
	if err != nil {
		t.Fatal(err)
	}
	if real.kind != segFile {
		t.Fatalf("describe of a file segment: kind %v", real.kind)
	}
	for _, tt := range []struct {
		name string
		edit func(*shmInfo)
	}{
		{"other host", func(i *shmInfo) { i.bootID = "00000000-0000-0000-0000-000000000000" }},
		{"unknown kind", func(i *shmInfo) { i.kind = 9 }},
		{"another file", func(i *shmInfo) { i.ino++ }},
		{"file too small", func(i *shmInfo) { i.size = 8192 }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			info := real
			tt.edit(&info)
			before := f.describes.Load()
			s := f.newFile(t, func(context.Context, string, string) (shmInfo, error) { return info, nil })
			for range 2 {
				if err := s.Do(context.Background(), f.op(OpRead, "ssd0", 0, make([]byte, 10))); !errors.Is(err, ErrUnsupported) {
					t.Fatalf("err = %v, want ErrUnsupported", err)
				}
			}
			if n := f.describes.Load() - before; n != 1 {
				t.Fatalf("%d describes, want 1", n)
			}
		})
	}
}

// TestFileOwnerExits opens the file through a child process that holds it, kills the child, and
// checks the fds are dropped and the next op describes afresh.
func TestFileOwnerExits(t *testing.T) {
	f := newFileFixture(t, t.TempDir(), 4096)
	real, err := f.tcp.describe(context.Background(), f.addr, "ssd0")
	if err != nil {
		t.Fatal(err)
	}
	child := sleeper(t, f.seg.fd) // fd 3 in the child
	viaChild := real
	viaChild.pid, viaChild.fd = uint32(child.Process.Pid), 3
	var answer atomic.Pointer[shmInfo]
	answer.Store(&viaChild)
	s := f.newFile(t, func(context.Context, string, string) (shmInfo, error) { return *answer.Load(), nil })
	ctx := context.Background()

	if err := s.Do(ctx, f.op(OpWrite, "ssd0", 0, []byte("via child"))); err != nil {
		t.Fatal(err)
	}
	child.Process.Kill()
	child.Wait()
	answer.Store(&real) // the "restarted" owner
	if err := s.Do(ctx, f.op(OpRead, "ssd0", 0, make([]byte, 9))); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("after the owner exited: err = %v, want ErrUnavailable", err)
	}
	got := make([]byte, 9)
	if err := s.Do(ctx, f.op(OpRead, "ssd0", 0, got)); err != nil {
		t.Fatalf("after re-describe: %v", err)
	}
	if string(got) != "via child" {
		t.Fatalf("read %q", got)
	}
	if n := f.describes.Load(); n != 2 {
		t.Fatalf("%d describes, want 2", n)
	}
}

func TestFileClose(t *testing.T) {
	f := newFileFixture(t, t.TempDir(), 4096)
	ctx := context.Background()
	if err := f.file.Do(ctx, f.op(OpRead, "ssd0", 0, make([]byte, 10))); err != nil {
		t.Fatal(err)
	}
	if err := f.file.Close(); err != nil {
		t.Fatal(err)
	}
	for _, seg := range []string{"ssd0", "other"} {
		if err := f.file.Do(ctx, f.op(OpRead, seg, 0, make([]byte, 10))); !errors.Is(err, ErrClosed) {
			t.Fatalf("%s after Close: err = %v, want ErrClosed", seg, err)
		}
	}
}

// TestFileConcurrent runs ops from many goroutines on a cold transport, aligned and not, then
// closes it under traffic: one describe, every byte lands, ops fail cleanly after Close.
func TestFileConcurrent(t *testing.T) {
	const workers, per, chunk = 4, 20, 8192
	f := newFileFixture(t, t.TempDir(), workers*per*chunk)
	ctx := context.Background()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range per {
				off := int64((w*per + i) * chunk)
				buf := alignedBuf(chunk)
				if w%2 == 1 {
					off, buf = off+1, buf[:chunk-1] // the buffered path
				}
				copy(buf, bytes.Repeat([]byte{byte(w), byte(i)}, chunk/2))
				if err := f.file.Do(ctx, f.op(OpWrite, "ssd0", off, buf)); err != nil {
					t.Error(err)
					return
				}
				got := alignedBuf(len(buf))
				if err := f.file.Do(ctx, f.op(OpRead, "ssd0", off, got)); err != nil || !bytes.Equal(got, buf) {
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

	s := f.newFile(t, f.tcp.describe)
	var ok atomic.Int64
	for range workers {
		wg.Go(func() {
			for {
				err := s.Do(ctx, f.op(OpRead, "ssd0", 0, alignedBuf(chunk)))
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

// TestFileEngine: a client engine on the same host reaches a file segment through the file
// transport (the peer's server moves no bytes), falls over to tcp with NoShm, and reads what tcp
// wrote.
func TestFileEngine(t *testing.T) {
	const size = 1 << 20
	reg := prometheus.NewRegistry()
	seg := newFileSegment(t, t.TempDir(), "ssd0", size)
	p := startPeer(t, Config{Registerer: reg}, seg)
	tgt := Target{Endpoint: p.addr, Segment: "ssd0"}
	c := newClient(t, Config{})
	r := rand.New(rand.NewPCG(5, 6))

	for _, tt := range []struct {
		name string
		off  int64
		buf  []byte
	}{
		{"aligned", 64 << 10, alignedBuf(128 << 10)},
		{"unaligned", 1000, make([]byte, 3000)},
	} {
		copy(tt.buf, randomBytes(r, len(tt.buf)))
		if _, err := run(t, c, func(b *Batch) *Task { return b.Write(tt.buf, tgt, tt.off, Options{}) }); err != nil {
			t.Fatalf("%s write: %v", tt.name, err)
		}
		got := make([]byte, len(tt.buf))
		if _, err := seg.f.ReadAt(got, tt.off); err != nil || !bytes.Equal(got, tt.buf) {
			t.Fatalf("%s: the file does not hold the written bytes (%v)", tt.name, err)
		}
		got = alignedBuf(len(tt.buf))
		if _, err := run(t, c, func(b *Batch) *Task { return b.Read(got, tgt, tt.off, Options{}) }); err != nil {
			t.Fatalf("%s read: %v", tt.name, err)
		}
		if !bytes.Equal(got, tt.buf) {
			t.Fatalf("%s: read back other bytes", tt.name)
		}
	}
	if _, err := run(t, c, func(b *Batch) *Task { return b.Read(make([]byte, 2), tgt, size-1, Options{}) }); !errors.Is(err, ErrOutOfRange) {
		t.Fatalf("read past the end: err = %v, want ErrOutOfRange", err)
	}
	t.Logf("client: %d direct ops, %d bounced, %d buffered", c.file.direct.Load(), c.file.bounced.Load(), c.file.buffered.Load())
	if n := c.file.direct.Load() + c.file.bounced.Load() + c.file.buffered.Load(); n != 4 {
		t.Errorf("the file transport did %d ops, want 4", n)
	}
	if n := served(t, reg); n != 0 {
		t.Fatalf("the server served %v bytes, want 0", n)
	}

	// Without the same-host transports the bytes go over tcp.
	tcpOnly := newClient(t, Config{NoShm: true})
	got := make([]byte, 3000)
	if _, err := run(t, tcpOnly, func(b *Batch) *Task { return b.Read(got, tgt, 1000, Options{}) }); err != nil {
		t.Fatal(err)
	}
	// The server counts a read after it has sent it: poll.
	waitFor(t, "the server to count 3000 bytes served", func() bool { return served(t, reg) == 3000 })
}

// BenchmarkFileRead reads 4 MiB, aligned, through the file transport (O_DIRECT where the temp
// dir's filesystem allows it).
func BenchmarkFileRead(b *testing.B) {
	const size = 4 << 20
	f := newFileFixture(b, b.TempDir(), size)
	buf := alignedBuf(size)
	ctx := context.Background()
	// Write the extent first: a read of a preallocated, never written extent is a zero fill
	// that never reaches the disk.
	copy(buf, randomBytes(rand.New(rand.NewPCG(7, 8)), size))
	if err := f.file.Do(ctx, f.op(OpWrite, "ssd0", 0, buf)); err != nil {
		b.Fatal(err)
	}
	if err := f.seg.f.Sync(); err != nil {
		b.Fatal(err)
	}
	op := f.op(OpRead, "ssd0", 0, buf)
	b.Logf("%s: O_DIRECT %v", fsType(filepath.Dir(f.seg.f.Name())), f.hasDirect(f.file))
	b.SetBytes(size)
	for b.Loop() {
		if err := f.file.Do(ctx, op); err != nil {
			b.Fatal(err)
		}
	}
}
