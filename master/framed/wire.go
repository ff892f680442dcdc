package framed

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
)

// preface opens a framed connection, sent by the client and echoed by the
// server. It is as long as HTTP/2's client preface (see Split).
const preface = "tidepool framed rpc v1\r\n"

// needTLS is what a server that requires TLS answers a plaintext
// preface instead of echoing it, so the client can say what is wrong.
const needTLS = "tidepool framed: TLS\r\n\r\n"

// helloMethod names the hello, the request a client with credentials
// sends right after the preface: its message is metadata pairs, the
// incoming metadata of every later call on the connection. No gRPC method
// is named without a leading '/'.
const helloMethod = "hello"

// maxHello bounds a hello's message.
const maxHello = 64 << 10

// MaxMessage is the largest request or reply message, as the master's
// gRPC limit.
const MaxMessage = 64 << 20

const (
	maxMethod  = 1 << 10
	maxTrailer = 1 << 20
	// The fixed parts of a frame after its size.
	requestHead = 8 + 8 + 2
	answerHead  = 8 + 4 + 4 + 4
	maxFrame    = answerHead + maxMethod + maxTrailer + MaxMessage
)

// IdleTimeout closes a connection that carried no frame for this long; a
// client dials again on its next call.
const IdleTimeout = 5 * time.Minute

// errFrame is a frame that breaks the protocol: the connection closes.
var errFrame = errors.New("framed: malformed frame")

// errIdle is no frame begun within the idle bound.
var errIdle = errors.New("framed: idle")

// bodyDeadline is how long the rest of a frame of n bytes may take once
// its size arrived: 10 s, plus a second per MiB.
func bodyDeadline(n int) time.Time {
	return time.Now().Add(10*time.Second + time.Duration(n>>20)*time.Second)
}

// frameReader reads frames from a connection through a buffer, so a frame
// that arrived whole costs one read.
type frameReader struct {
	conn net.Conn
	r    *bufio.Reader
	bufs *bufPool
	head [4]byte
}

func newFrameReader(conn net.Conn, bufs *bufPool) *frameReader {
	return &frameReader{conn: conn, r: bufio.NewReaderSize(conn, 32<<10), bufs: bufs}
}

// next reads one frame's size and body; the body is the caller's to put
// back in f.bufs. idle bounds the wait for the size. A large body not yet
// here grows as its bytes arrive (from 64 KiB), so a peer that announces
// a large frame and sends little holds little.
func (f *frameReader) next(idle time.Duration) ([]byte, error) {
	if f.r.Buffered() == 0 {
		if err := f.conn.SetReadDeadline(time.Now().Add(idle)); err != nil {
			return nil, err
		}
		if _, err := f.r.Peek(1); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				return nil, errIdle
			}
			return nil, err
		}
	}
	if f.r.Buffered() < len(f.head) {
		if err := f.conn.SetReadDeadline(bodyDeadline(0)); err != nil {
			return nil, err
		}
	}
	if _, err := io.ReadFull(f.r, f.head[:]); err != nil {
		return nil, err
	}
	n := int(binary.BigEndian.Uint32(f.head[:]))
	if n > maxFrame {
		return nil, fmt.Errorf("%w: %d bytes, more than %d", errFrame, n, maxFrame)
	}
	if f.r.Buffered() < n {
		if err := f.conn.SetReadDeadline(bodyDeadline(n)); err != nil {
			return nil, err
		}
	}
	if f.r.Buffered() >= n || n <= 64<<10 {
		body := f.bufs.get(n)
		if _, err := io.ReadFull(f.r, body); err != nil {
			f.bufs.put(body)
			return nil, err
		}
		return body, nil
	}
	body := make([]byte, 0, 64<<10)
	for len(body) < n {
		if len(body) == cap(body) {
			body = append(body, make([]byte, min(n-len(body), cap(body)))...)[:len(body)]
		}
		m, err := f.r.Read(body[len(body):min(n, cap(body))])
		body = body[:len(body)+m]
		if err != nil && len(body) < n {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
	}
	return body, nil
}

// request is a decoded request frame; message aliases the frame.
type request struct {
	id      uint64
	timeout time.Duration
	method  string
	message []byte
}

// appendRequest appends the frame of a request to b; the message follows
// by appendMessage.
func appendRequestHead(b []byte, id uint64, timeout time.Duration, method string) []byte {
	b = append(b, 0, 0, 0, 0) // the size, set by finish
	b = binary.BigEndian.AppendUint64(b, id)
	b = binary.BigEndian.AppendUint64(b, uint64(max(timeout, 0)))
	b = binary.BigEndian.AppendUint16(b, uint16(len(method)))
	return append(b, method...)
}

// finish sets the size of the frame b.
func finish(b []byte) []byte {
	binary.BigEndian.PutUint32(b, uint32(len(b)-4))
	return b
}

func parseRequest(body []byte) (request, error) {
	if len(body) < requestHead {
		return request{}, fmt.Errorf("%w: request of %d bytes", errFrame, len(body))
	}
	r := request{id: binary.BigEndian.Uint64(body), timeout: time.Duration(binary.BigEndian.Uint64(body[8:]))}
	n := int(binary.BigEndian.Uint16(body[16:]))
	rest := body[requestHead:]
	if n > maxMethod || n > len(rest) || r.timeout < 0 {
		return request{}, fmt.Errorf("%w: method of %d bytes in %d, timeout %d", errFrame, n, len(rest), r.timeout)
	}
	r.method, r.message = string(rest[:n]), rest[n:]
	if len(r.message) > MaxMessage {
		return request{}, fmt.Errorf("%w: message of %d bytes, more than %d", errFrame, len(r.message), MaxMessage)
	}
	return r, nil
}

// parsePairs decodes what appendPairs wrote, less its size: nil if empty.
func parsePairs(b []byte) (metadata.MD, error) {
	var md metadata.MD
	for len(b) > 0 {
		if len(b) < 2 {
			return nil, errors.New("pair key")
		}
		k := int(binary.BigEndian.Uint16(b))
		if k+6 > len(b) {
			return nil, errors.New("pair key")
		}
		key := string(b[2 : 2+k])
		v := int(binary.BigEndian.Uint32(b[2+k:]))
		b = b[6+k:]
		if v > len(b) {
			return nil, errors.New("pair value")
		}
		if md == nil {
			md = metadata.MD{}
		}
		md.Append(key, string(b[:v]))
		b = b[v:]
	}
	return md, nil
}

// answer is a decoded answer frame; message aliases body, the frame.
type answer struct {
	id      uint64
	code    codes.Code
	text    string
	trailer metadata.MD
	message []byte
	body    []byte
	lost    error // set instead when the connection ended first
}

func appendAnswerHead(b []byte, id uint64, code codes.Code, text string, trailer metadata.MD) []byte {
	b = append(b, 0, 0, 0, 0)
	b = binary.BigEndian.AppendUint64(b, id)
	b = binary.BigEndian.AppendUint32(b, uint32(code))
	b = binary.BigEndian.AppendUint32(b, uint32(len(text)))
	b = append(b, text...)
	return appendPairs(b, trailer)
}

// appendPairs appends md as u32 size | pairs (u16 key size, key, u32
// value size, value): an answer's trailer, a hello's metadata.
func appendPairs(b []byte, md metadata.MD) []byte {
	at := len(b)
	b = append(b, 0, 0, 0, 0)
	for k, vs := range md {
		for _, v := range vs {
			b = binary.BigEndian.AppendUint16(b, uint16(len(k)))
			b = append(b, k...)
			b = binary.BigEndian.AppendUint32(b, uint32(len(v)))
			b = append(b, v...)
		}
	}
	binary.BigEndian.PutUint32(b[at:], uint32(len(b)-at-4))
	return b
}

func parseAnswer(body []byte) (answer, error) {
	bad := func(what string) (answer, error) {
		return answer{}, fmt.Errorf("%w: answer of %d bytes: %s", errFrame, len(body), what)
	}
	if len(body) < answerHead {
		return bad("short")
	}
	a := answer{id: binary.BigEndian.Uint64(body), code: codes.Code(binary.BigEndian.Uint32(body[8:]))}
	rest := body[16:]
	n := int(binary.BigEndian.Uint32(body[12:]))
	if n > len(rest)-4 {
		return bad("text past the end")
	}
	a.text, rest = string(rest[:n]), rest[n:]
	n = int(binary.BigEndian.Uint32(rest))
	rest = rest[4:]
	if n > len(rest) || n > maxTrailer {
		return bad("trailer past the end")
	}
	a.message = rest[n:]
	md, err := parsePairs(rest[:n])
	if err != nil {
		return bad(err.Error())
	}
	a.trailer = md
	return a, nil
}
