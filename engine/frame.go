package engine

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
)

// Wire format of the TCP transport. All integers are big endian. One request is in flight per
// connection: the client sends a request and reads its response before sending the next.
//
// Request:
//
//	magic    2  0x54 0x50 ("TP")
//	version  1  2
//	op       1  1 = read, 2 = write, 3 = describe
//	namelen  2  length of the segment name, at most 255
//	name     namelen bytes
//	offset   8  byte offset in the segment
//	length   8  bytes to move, at most MaxOpLen
//	tlen     1  length of the ticket, at most MaxTicket
//	ticket   tlen bytes: the master's permission for this transfer, opaque to the engine (the
//	            server's Guard checks it; package ticket is the store's)
//	payload  length bytes, writes only
//
// A describe request asks how to reach the segment from the same host (the shm and file
// transports); its offset and length must be 0.
//
// Response:
//
//	magic    2  0x54 0x50
//	status   1  0 ok, 1 not found, 2 out of range, 3 bad request, 4 internal,
//	            5 unsupported (describe of a segment that cannot be shared),
//	            6 forbidden (the Guard refused the request's ticket)
//	length   8  ok: payload length (the request's length for reads, 0 for writes,
//	            describeLen or describeMax for describes); otherwise: length of the error
//	            message, at most 1 KiB
//	payload  length bytes: the data for an ok read, the describe record, or the error message
//
// Describe record (an ok describe's payload, describeLen = 68 bytes, or describeMax = 69 with the
// kind byte):
//
//	bootid  36  the owner's /proc/sys/kernel/random/boot_id, as text
//	pid      4  the owner's process id
//	fd       4  the owner's fd of a memfd (or file) whose bytes [0, size) are the segment
//	size     8  the segment's size
//	dev      8  st_dev of that file
//	ino      8  st_ino of that file: with dev, lets the client check that /proc/<pid>/fd/<fd>
//	            is that very file (a peer in another pid namespace shares the boot id, but its
//	            pid names some other process here)
//	kind     1  only when the segment is not plain memory: 1 = a file (FileBacked) to pread and
//	            pwrite, never to map; a record without it is memory, mapped by the shm transport
//
// A request the server cannot parse (bad magic, version or op, name or length over its cap) makes
// it drop that connection: after garbage it cannot find the next frame boundary. A well-formed
// request it cannot serve (unknown segment, bad bounds) gets an error response; the server first
// discards a write's payload, so the connection stays usable.
const (
	frameMagic uint16 = 0x5450
	// frameVersion 2 added the ticket; a server refuses version 1 (a peer too old to carry one).
	frameVersion byte = 2

	opRead     byte = 1
	opWrite    byte = 2
	opDescribe byte = 3

	statusOK          byte = 0
	statusNotFound    byte = 1
	statusOutOfRange  byte = 2
	statusBadRequest  byte = 3
	statusInternal    byte = 4
	statusUnsupported byte = 5
	statusForbidden   byte = 6

	// MaxOpLen caps the length of one wire operation, so a garbage length cannot make either side
	// allocate or wait for gigabytes. Tasks larger than this are split before they reach the wire.
	MaxOpLen = 1 << 30
	// MaxTicket caps the ticket a request carries.
	MaxTicket = 64
	// maxErrMsg caps the error message in a response.
	maxErrMsg = 1 << 10

	reqFixed   = 6  // magic, version, op, namelen
	reqTrailer = 17 // offset, length, ticket length
	reqMax     = reqFixed + MaxSegmentName + reqTrailer + MaxTicket
	respLen    = 11 // magic, status, length
)

// reqHeader is a decoded request header. name and ticket alias the decode buffer.
type reqHeader struct {
	op     byte
	name   []byte
	off    uint64
	n      uint64
	ticket []byte
}

// respHeader is a decoded response header.
type respHeader struct {
	status byte
	n      uint64
}

// appendRequest encodes a request header onto dst. It does not validate: the caller checks the
// name and ticket lengths, and encoding invalid headers is what the decode tests need. The name
// and ticket are strings so the client encodes its Target without converting it.
func appendRequest(dst []byte, op byte, name string, off, n uint64, ticket string) []byte {
	dst = binary.BigEndian.AppendUint16(dst, frameMagic)
	dst = append(dst, frameVersion, op)
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(name)))
	dst = append(dst, name...)
	dst = binary.BigEndian.AppendUint64(dst, off)
	dst = binary.BigEndian.AppendUint64(dst, n)
	dst = append(dst, byte(len(ticket)))
	return append(dst, ticket...)
}

// readRequest reads and validates one request header into buf (the name aliases it). It returns
// io.EOF if r ended cleanly before the frame, io.ErrUnexpectedEOF if it ended inside it, and an
// error wrapping ErrProtocol if the header is malformed.
func readRequest(r io.Reader, buf *[reqMax]byte) (reqHeader, error) {
	if _, err := io.ReadFull(r, buf[:reqFixed]); err != nil {
		return reqHeader{}, err
	}
	if m := binary.BigEndian.Uint16(buf[0:]); m != frameMagic {
		return reqHeader{}, fmt.Errorf("%w: bad magic %#04x", ErrProtocol, m)
	}
	if v := buf[2]; v != frameVersion {
		return reqHeader{}, fmt.Errorf("%w: unsupported version %d", ErrProtocol, v)
	}
	h := reqHeader{op: buf[3]}
	if h.op != opRead && h.op != opWrite && h.op != opDescribe {
		return reqHeader{}, fmt.Errorf("%w: bad op %d", ErrProtocol, h.op)
	}
	nameLen := int(binary.BigEndian.Uint16(buf[4:]))
	if nameLen > MaxSegmentName {
		return reqHeader{}, fmt.Errorf("%w: segment name of %d bytes", ErrProtocol, nameLen)
	}
	rest := buf[reqFixed : reqFixed+nameLen+reqTrailer]
	if _, err := io.ReadFull(r, rest); err != nil {
		return reqHeader{}, noEOF(err)
	}
	h.name = rest[:nameLen]
	h.off = binary.BigEndian.Uint64(rest[nameLen:])
	h.n = binary.BigEndian.Uint64(rest[nameLen+8:])
	if tlen := int(rest[nameLen+16]); tlen > 0 {
		if tlen > MaxTicket {
			return reqHeader{}, fmt.Errorf("%w: ticket of %d bytes", ErrProtocol, tlen)
		}
		h.ticket = buf[len(buf)-MaxTicket:][:tlen]
		if _, err := io.ReadFull(r, h.ticket); err != nil {
			return reqHeader{}, noEOF(err)
		}
	}
	if h.n > MaxOpLen {
		return reqHeader{}, fmt.Errorf("%w: length %d over cap %d", ErrProtocol, h.n, MaxOpLen)
	}
	if h.op == opDescribe && (h.off != 0 || h.n != 0) {
		// A length would leave the server guessing whether a payload follows.
		return reqHeader{}, fmt.Errorf("%w: describe with offset %d, length %d", ErrProtocol, h.off, h.n)
	}
	return h, nil
}

func appendResponse(dst []byte, h respHeader) []byte {
	dst = binary.BigEndian.AppendUint16(dst, frameMagic)
	dst = append(dst, h.status)
	return binary.BigEndian.AppendUint64(dst, h.n)
}

// readResponse reads and validates one response header. Errors as for readRequest. It checks
// what can be checked without the request: magic, a known status, the error-message cap.
func readResponse(r io.Reader, buf *[respLen]byte) (respHeader, error) {
	if _, err := io.ReadFull(r, buf[:]); err != nil {
		return respHeader{}, err
	}
	if m := binary.BigEndian.Uint16(buf[0:]); m != frameMagic {
		return respHeader{}, fmt.Errorf("%w: bad magic %#04x", ErrProtocol, m)
	}
	h := respHeader{status: buf[2], n: binary.BigEndian.Uint64(buf[3:])}
	switch {
	case h.status > statusForbidden:
		return respHeader{}, fmt.Errorf("%w: unknown status %d", ErrProtocol, h.status)
	case h.status != statusOK && h.n > maxErrMsg:
		return respHeader{}, fmt.Errorf("%w: error message of %d bytes", ErrProtocol, h.n)
	case h.n > MaxOpLen:
		return respHeader{}, fmt.Errorf("%w: length %d over cap %d", ErrProtocol, h.n, MaxOpLen)
	}
	return h, nil
}

// statusErr maps a non-ok status to the sentinel the client returns.
func statusErr(status byte) error {
	switch status {
	case statusNotFound:
		return ErrSegmentNotFound
	case statusOutOfRange:
		return ErrOutOfRange
	case statusBadRequest:
		return ErrProtocol
	case statusUnsupported:
		return ErrUnsupported
	case statusForbidden:
		return ErrForbidden
	default:
		return ErrRemote
	}
}

// errStatus is statusErr's inverse, for the server.
func errStatus(err error) byte {
	switch {
	case errors.Is(err, ErrSegmentNotFound):
		return statusNotFound
	case errors.Is(err, ErrOutOfRange):
		return statusOutOfRange
	case errors.Is(err, ErrProtocol), errors.Is(err, ErrInvalid):
		return statusBadRequest
	case errors.Is(err, ErrUnsupported):
		return statusUnsupported
	case errors.Is(err, ErrForbidden):
		return statusForbidden
	default:
		return statusInternal
	}
}

// offsetInRange checks a wire offset and length against a segment size.
func offsetInRange(off, n uint64, size int64) bool {
	return off <= math.MaxInt64 && inRange(int64(off), int64(n), size)
}

// noEOF turns io.EOF into io.ErrUnexpectedEOF: past a frame's first byte, EOF means truncation.
func noEOF(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}
