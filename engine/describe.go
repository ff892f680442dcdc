package engine

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// shmInfo is the describe record: what a client on the same host needs to map a segment (see
// frame.go for its wire layout).
type shmInfo struct {
	bootID string // the owner's boot id; equal to ours means the same kernel
	pid    uint32 // the owner's process
	fd     uint32 // the owner's fd of the segment's memfd or file
	size   uint64 // the segment's size
	dev    uint64 // identity of that file, checked after opening it through /proc
	ino    uint64
	kind   segKind // what the fd holds, so the client knows which transport may use it
}

// segKind says what a described segment's fd is: memory to map (shm) or a file to pread and
// pwrite (file).
type segKind uint8

const (
	segMemory segKind = 0 // a memfd or file mapped by its owner; the record has no kind byte
	segFile   segKind = 1 // a FileBacked segment's file; the record ends with this kind byte
)

func (k segKind) String() string {
	switch k {
	case segMemory:
		return "memory"
	case segFile:
		return "file"
	default:
		return fmt.Sprintf("kind(%d)", uint8(k))
	}
}

const (
	bootIDLen   = 36 // a UUID as text
	describeLen = bootIDLen + 4 + 4 + 8 + 8 + 8
	// describeMax is describeLen plus the kind byte, sent only for kinds other than memory: a
	// memory segment's record is what it always was, and a client that knows only that record
	// rejects a file segment's (ErrProtocol, so no shm) instead of mapping a file.
	describeMax = describeLen + 1
	bootIDPath  = "/proc/sys/kernel/random/boot_id"
)

// hostBootID is this host's boot id, read once: it names the running kernel, which is what two
// processes must share to map each other's memory.
var hostBootID = sync.OnceValues(func() (string, error) {
	b, err := os.ReadFile(bootIDPath)
	if err != nil {
		return "", err
	}
	b = bytes.TrimSpace(b)
	if len(b) != bootIDLen {
		return "", fmt.Errorf("%s: %d bytes, want %d", bootIDPath, len(b), bootIDLen)
	}
	return string(b), nil
})

func appendShmInfo(dst []byte, info shmInfo) []byte {
	dst = append(dst, info.bootID...)
	dst = binary.BigEndian.AppendUint32(dst, info.pid)
	dst = binary.BigEndian.AppendUint32(dst, info.fd)
	dst = binary.BigEndian.AppendUint64(dst, info.size)
	dst = binary.BigEndian.AppendUint64(dst, info.dev)
	dst = binary.BigEndian.AppendUint64(dst, info.ino)
	if info.kind != segMemory {
		dst = append(dst, byte(info.kind))
	}
	return dst
}

// appendDescribeResponse appends an ok describe response carrying info's record.
func appendDescribeResponse(dst []byte, info shmInfo) []byte {
	n := describeLen
	if info.kind != segMemory {
		n = describeMax
	}
	dst = appendResponse(dst, respHeader{status: statusOK, n: uint64(n)})
	return appendShmInfo(dst, info)
}

// parseShmInfo decodes a describe record of describeLen bytes (a memory segment) or describeMax
// (with a kind byte). A kind this side does not know is returned as is: the transports refuse it.
func parseShmInfo(b []byte) (shmInfo, error) {
	if len(b) != describeLen && len(b) != describeMax {
		return shmInfo{}, fmt.Errorf("%w: describe record of %d bytes, want %d or %d", ErrProtocol, len(b), describeLen, describeMax)
	}
	r := b[bootIDLen:]
	info := shmInfo{
		bootID: string(b[:bootIDLen]),
		pid:    binary.BigEndian.Uint32(r[0:]),
		fd:     binary.BigEndian.Uint32(r[4:]),
		size:   binary.BigEndian.Uint64(r[8:]),
		dev:    binary.BigEndian.Uint64(r[16:]),
		ino:    binary.BigEndian.Uint64(r[24:]),
	}
	if len(b) == describeMax {
		info.kind = segKind(b[describeLen])
	}
	return info, nil
}

// describeSegment is the server's answer to a describe: seg's memfd (or, if seg is FileBacked,
// its file) as this process sees it. It fails with ErrUnsupported if seg is not Shareable or its
// fd is unusable.
func describeSegment(seg Segment) (shmInfo, error) {
	sh, ok := seg.(Shareable)
	if !ok {
		return shmInfo{}, fmt.Errorf("%w: segment %q cannot be shared", ErrUnsupported, seg.Name())
	}
	fd := sh.ShareFD()
	if fd < 0 {
		return shmInfo{}, fmt.Errorf("%w: segment %q has no shareable fd", ErrUnsupported, seg.Name())
	}
	boot, err := hostBootID()
	if err != nil {
		return shmInfo{}, fmt.Errorf("%w: boot id: %w", ErrUnsupported, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return shmInfo{}, fmt.Errorf("%w: segment %q: fstat fd %d: %w", ErrUnsupported, seg.Name(), fd, err)
	}
	size := seg.Size()
	if st.Size < size {
		return shmInfo{}, fmt.Errorf("%w: segment %q: fd %d holds %d bytes, segment has %d",
			ErrUnsupported, seg.Name(), fd, st.Size, size)
	}
	return shmInfo{
		bootID: boot,
		pid:    uint32(os.Getpid()),
		fd:     uint32(fd),
		size:   uint64(size),
		dev:    uint64(st.Dev),
		ino:    uint64(st.Ino),
		kind:   kindOf(seg),
	}, nil
}

func kindOf(seg Segment) segKind {
	if fb, ok := seg.(FileBacked); ok && fb.FileBacked() {
		return segFile
	}
	return segMemory
}

// describe asks the peer at addr how to map its segment from this host. Errors: ErrUnsupported
// if the peer cannot share that segment, ErrSegmentNotFound if it serves none of that name, and
// the usual connection errors of Do.
func (t *tcpTransport) describe(ctx context.Context, addr, segment string) (shmInfo, error) {
	if n := len(segment); n == 0 || n > MaxSegmentName {
		return shmInfo{}, fmt.Errorf("%w: segment name of %d bytes", ErrInvalid, n)
	}
	var info shmInfo
	err := t.call(ctx, addr, func(c *tcpConn) (bool, error) {
		var keep bool
		var err error
		info, keep, err = c.describe(addr, segment)
		return keep, err
	})
	return info, err
}

// describe sends one describe request and reads its answer. keep as for exchange.
func (c *tcpConn) describe(addr, segment string) (_ shmInfo, keep bool, _ error) {
	hdr := appendRequest(c.hdr[:0], opDescribe, segment, 0, 0, "")
	if _, err := c.nc.Write(hdr); err != nil {
		return shmInfo{}, false, fmt.Errorf("%w: send to %s: %w", ErrUnavailable, addr, err)
	}
	h, err := readResponse(c.br, &c.resp)
	if err != nil {
		if errors.Is(err, ErrProtocol) {
			return shmInfo{}, false, fmt.Errorf("response from %s: %w", addr, err)
		}
		return shmInfo{}, false, fmt.Errorf("%w: receive from %s: %w", ErrUnavailable, addr, err)
	}
	if h.status != statusOK {
		msg := make([]byte, h.n) // at most maxErrMsg, checked by readResponse
		if _, err := io.ReadFull(c.br, msg); err != nil {
			return shmInfo{}, false, fmt.Errorf("%w: receive from %s: %w", ErrUnavailable, addr, noEOF(err))
		}
		return shmInfo{}, true, fmt.Errorf("%w: %s", statusErr(h.status), msg)
	}
	if h.n != describeLen && h.n != describeMax {
		return shmInfo{}, false, fmt.Errorf("%w: describe from %s has %d bytes, want %d or %d", ErrProtocol, addr, h.n, describeLen, describeMax)
	}
	var rec [describeMax]byte
	if _, err := io.ReadFull(c.br, rec[:h.n]); err != nil {
		return shmInfo{}, false, fmt.Errorf("%w: receive from %s: %w", ErrUnavailable, addr, noEOF(err))
	}
	info, err := parseShmInfo(rec[:h.n])
	return info, err == nil, err
}
