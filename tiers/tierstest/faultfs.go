// Package tierstest holds what tests of the persistent tiers need and the
// standard library lacks: a real filesystem whose disk can be made to fail.
package tierstest

import (
	"context"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// FaultFS is a directory mounted through FUSE over a backing directory:
// while Fail's predicate holds for a file, the kernel answers its reads, writes and syncs
// with EIO, to every process and through every path (buffered, O_DIRECT,
// a shared fd), as a dying disk does. Nothing in the process under test
// knows the disk is fake.
type FaultFS struct {
	// Dir is the mount point.
	Dir   string
	match atomic.Pointer[func(path string) bool]
	srv   *fuse.Server
}

// MountFaultFS mounts a FaultFS for t and unmounts it when t ends, after
// the cleanups registered later (the tiers on it) have closed their files.
// It needs root and /dev/fuse; without them it skips t, saying so.
func MountFaultFS(t testing.TB) *FaultFS {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("a FUSE mount needs root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skipf("a FUSE mount needs /dev/fuse: %v", err)
	}
	f := &FaultFS{Dir: t.TempDir()}
	root := &fs.LoopbackRoot{Path: t.TempDir()}
	root.NewNode = func(r *fs.LoopbackRoot, _ *fs.Inode, _ string, _ *syscall.Stat_t) fs.InodeEmbedder {
		return &faultNode{LoopbackNode: fs.LoopbackNode{RootData: r}, fs: f}
	}
	root.RootNode = root.NewNode(root, nil, "", nil)
	srv, err := fs.Mount(f.Dir, root.RootNode, &fs.Options{MountOptions: fuse.MountOptions{
		DirectMount: true, DirectMountStrict: true, FsName: "faultfs", Name: "faultfs",
	}})
	if err != nil {
		t.Fatalf("mount a FUSE filesystem on %s: %v", f.Dir, err)
	}
	f.srv = srv
	t.Cleanup(func() { f.unmount(t) })
	return f
}

// Fail makes I/O on every file for whose path in the mount (such as
// "m1/raft/000004.log") match holds fail with EIO; nil heals the disk.
func (f *FaultFS) Fail(match func(path string) bool) { f.match.Store(&match) }

func (f *FaultFS) failing(n *fs.Inode) bool {
	m := f.match.Load()
	return m != nil && *m != nil && (*m)(n.Path(nil))
}

// unmount detaches the filesystem. A file still open on it is a leak in
// the code under test: it is reported, and the mount is detached lazily
// so the test run goes on.
func (f *FaultFS) unmount(t testing.TB) {
	if err := f.srv.Unmount(); err == nil {
		return
	}
	t.Errorf("unmount %s: a file is still open on it", f.Dir)
	if err := unix.Unmount(f.Dir, unix.MNT_DETACH); err != nil {
		t.Errorf("detach %s: %v", f.Dir, err)
		return
	}
	done := make(chan struct{})
	go func() { f.srv.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Errorf("FUSE server of %s still running 10s after a lazy unmount", f.Dir)
	}
}

// faultNode is a loopback node whose data I/O fails while its name matches.
type faultNode struct {
	fs.LoopbackNode
	fs *FaultFS
}

var (
	_ fs.NodeReader  = (*faultNode)(nil)
	_ fs.NodeWriter  = (*faultNode)(nil)
	_ fs.NodeFsyncer = (*faultNode)(nil)
)

func (n *faultNode) Read(ctx context.Context, f fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	if n.fs.failing(n.EmbeddedInode()) {
		return nil, syscall.EIO
	}
	r, ok := f.(fs.FileReader)
	if !ok {
		return nil, syscall.ENOTSUP
	}
	return r.Read(ctx, dest, off)
}

func (n *faultNode) Write(ctx context.Context, f fs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	if n.fs.failing(n.EmbeddedInode()) {
		return 0, syscall.EIO
	}
	w, ok := f.(fs.FileWriter)
	if !ok {
		return 0, syscall.ENOTSUP
	}
	return w.Write(ctx, data, off)
}

func (n *faultNode) Fsync(ctx context.Context, f fs.FileHandle, flags uint32) syscall.Errno {
	if n.fs.failing(n.EmbeddedInode()) {
		return syscall.EIO
	}
	if s, ok := f.(fs.FileFsyncer); ok {
		return s.Fsync(ctx, flags)
	}
	return 0
}
