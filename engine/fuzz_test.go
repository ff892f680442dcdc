package engine

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// FuzzFrames feeds arbitrary bytes to both ends' decoders: as a stream of requests (the server's
// readRequest), of responses (readResponse), as the answer to a client's read, write and describe
// (tcpConn.exchange and describe), and as a describe record. A frame that decodes is exactly the
// bytes its encoder writes for what was decoded, so decode(encode(x)) == x.
func FuzzFrames(f *testing.F) {
	f.Add([]byte{})
	f.Add(appendRequest(nil, opRead, "mem", 0, 16, ""))
	f.Add(append(appendRequest(nil, opWrite, "mem", 8, 4, "ticket"), "data"...))
	f.Add(appendRequest(appendRequest(nil, opDescribe, "mem", 0, 0, ""), opRead, strings.Repeat("n", MaxSegmentName), 1<<40, MaxOpLen, strings.Repeat("t", MaxTicket)))
	f.Add(appendRequest(nil, opRead, "mem", 0, MaxOpLen+1, ""))
	f.Add(append(appendResponse(nil, respHeader{statusOK, 16}), make([]byte, 16)...))
	f.Add(append(appendResponse(nil, respHeader{statusNotFound, 9}), "not found"...))
	f.Add(appendResponse(appendResponse(nil, respHeader{statusOK, 0}), respHeader{statusForbidden, 0}))
	f.Add(appendDescribeResponse(nil, shmInfo{bootID: strings.Repeat("b", bootIDLen), pid: 1, fd: 3, size: 64, dev: 5, ino: 6}))
	f.Add(appendDescribeResponse(nil, shmInfo{bootID: strings.Repeat("b", bootIDLen), size: 1 << 20, kind: segFile}))
	f.Add([]byte("GET / HTTP/1.1\r\n\r\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		requests(t, in)
		responses(t, in)
		for _, op := range []*Op{
			{Kind: OpRead, Target: Target{Segment: "mem"}, Buf: make([]byte, 16)},
			{Kind: OpWrite, Target: Target{Segment: "mem", Ticket: "t"}, Offset: 8, Buf: make([]byte, 4)},
			{Kind: OpRead, Target: Target{Segment: "mem"}},
		} {
			clientExchange(t, in, op)
		}
		clientDescribe(t, in)
		for _, n := range []int{describeLen, describeMax} {
			if len(in) >= n {
				shmRecord(t, in[:n])
			}
		}
		shmRecord(t, in)
	})
}

// requests decodes in as the server does: request after request, skipping each write's payload.
func requests(t *testing.T, in []byte) {
	r := bytes.NewReader(in)
	var buf [reqMax]byte
	for {
		start := len(in) - r.Len()
		h, err := readRequest(r, &buf)
		if err != nil {
			switch {
			case err == io.EOF && start != len(in):
				t.Fatalf("request at %d: EOF with %d bytes left", start, len(in)-start)
			case err == io.EOF, err == io.ErrUnexpectedEOF, errors.Is(err, ErrProtocol):
			default:
				t.Fatalf("request at %d: unexpected error %v", start, err)
			}
			return
		}
		switch {
		case len(h.name) > MaxSegmentName, len(h.ticket) > MaxTicket, h.n > MaxOpLen:
			t.Fatalf("request at %d decoded past a cap: %+v", start, h)
		case h.op == opDescribe && (h.off != 0 || h.n != 0):
			t.Fatalf("request at %d: describe with offset %d, length %d", start, h.off, h.n)
		}
		frame := in[start : len(in)-r.Len()]
		if enc := appendRequest(nil, h.op, string(h.name), h.off, h.n, string(h.ticket)); !bytes.Equal(enc, frame) {
			t.Fatalf("request at %d: decoded %+v from %x, which encodes as %x", start, h, frame, enc)
		}
		if h.op == opWrite {
			if int64(r.Len()) < int64(h.n) {
				return
			}
			r.Seek(int64(h.n), io.SeekCurrent)
		}
	}
}

// responses decodes in as a stream of responses, each followed by its payload.
func responses(t *testing.T, in []byte) {
	r := bytes.NewReader(in)
	var buf [respLen]byte
	for {
		start := len(in) - r.Len()
		h, err := readResponse(r, &buf)
		if err != nil {
			switch {
			case err == io.EOF && start != len(in):
				t.Fatalf("response at %d: EOF with %d bytes left", start, len(in)-start)
			case err == io.EOF, err == io.ErrUnexpectedEOF, errors.Is(err, ErrProtocol):
			default:
				t.Fatalf("response at %d: unexpected error %v", start, err)
			}
			return
		}
		switch {
		case h.status > statusForbidden, h.n > MaxOpLen, h.status != statusOK && h.n > maxErrMsg:
			t.Fatalf("response at %d decoded past a cap: %+v", start, h)
		}
		if enc := appendResponse(nil, h); !bytes.Equal(enc, in[start:start+respLen]) {
			t.Fatalf("response at %d: decoded %+v from %x, which encodes as %x", start, h, in[start:start+respLen], enc)
		}
		if int64(r.Len()) < int64(h.n) {
			return
		}
		r.Seek(int64(h.n), io.SeekCurrent)
	}
}

// clientExchange sends op on a connection whose peer answers with in, and checks that the client
// keeps the connection only at a frame boundary, with every error one of the engine's sentinels.
func clientExchange(t *testing.T, in []byte, op *Op) {
	c := &scriptConn{in: bytes.NewReader(in)}
	tc := &tcpConn{nc: c}
	tc.br = bufio.NewReaderSize(c, connReadBuf)
	keep, err := tc.exchange(op)
	checkClientErr(t, "exchange", err)
	var want []byte
	if op.Kind == OpWrite {
		want = append(appendRequest(nil, opWrite, op.Target.Segment, uint64(op.Offset), uint64(len(op.Buf)), op.Target.Ticket), op.Buf...)
	} else {
		want = appendRequest(nil, opRead, op.Target.Segment, uint64(op.Offset), uint64(len(op.Buf)), op.Target.Ticket)
	}
	if !bytes.Equal(c.out.Bytes(), want) {
		t.Fatalf("exchange sent %x, want %x", c.out.Bytes(), want)
	}
	if keep {
		atBoundary(t, "exchange", in, tc)
		if err == nil && op.Kind == OpRead && !bytes.Equal(op.Buf, in[respLen:respLen+len(op.Buf)]) {
			t.Fatalf("exchange read %x, the response carried %x", op.Buf, in[respLen:respLen+len(op.Buf)])
		}
	}
}

func clientDescribe(t *testing.T, in []byte) {
	c := &scriptConn{in: bytes.NewReader(in)}
	tc := &tcpConn{nc: c}
	tc.br = bufio.NewReaderSize(c, connReadBuf)
	info, keep, err := tc.describe("peer", "mem")
	checkClientErr(t, "describe", err)
	if keep {
		atBoundary(t, "describe", in, tc)
	}
	if err != nil {
		return
	}
	// A record that decodes is its encoding, but for a kind byte of 0: memory, which a server
	// sends without one.
	raw := in[respLen : respLen+binary.BigEndian.Uint64(in[3:])]
	if rec := appendShmInfo(nil, info); !bytes.Equal(rec, raw) && !bytes.Equal(append(rec, byte(segMemory)), raw) {
		t.Fatalf("describe decoded %+v from %x, which encodes as %x", info, raw, rec)
	}
}

// atBoundary checks that a client keeping its connection has read exactly one response and its
// payload.
func atBoundary(t *testing.T, what string, in []byte, tc *tcpConn) {
	if len(in) < respLen {
		t.Fatalf("%s keeps the connection after %d bytes of response", what, len(in))
	}
	end := respLen + binary.BigEndian.Uint64(in[3:])
	if read := uint64(len(in) - tc.nc.(*scriptConn).in.Len() - tc.br.Buffered()); read != end {
		t.Fatalf("%s keeps the connection after reading %d bytes, its response ends at %d", what, read, end)
	}
}

func checkClientErr(t *testing.T, what string, err error) {
	for _, s := range []error{ErrUnavailable, ErrProtocol, ErrSegmentNotFound, ErrOutOfRange, ErrUnsupported, ErrForbidden, ErrRemote} {
		if err == nil || errors.Is(err, s) {
			return
		}
	}
	t.Fatalf("%s: error %v wraps none of the engine's sentinels", what, err)
}

func shmRecord(t *testing.T, rec []byte) {
	info, err := parseShmInfo(rec)
	if err != nil {
		if !errors.Is(err, ErrProtocol) {
			t.Fatalf("parseShmInfo: %v", err)
		}
		return
	}
	again, err := parseShmInfo(appendShmInfo(nil, info))
	if err != nil || again != info {
		t.Fatalf("describe record %+v encodes to one that decodes as %+v, %v", info, again, err)
	}
}

// scriptConn is a connection whose peer sent in and then hung up; what is written to it collects in
// out. Deadlines never fire.
type scriptConn struct {
	in  *bytes.Reader
	out bytes.Buffer
}

func (c *scriptConn) Read(p []byte) (int, error)       { return c.in.Read(p) }
func (c *scriptConn) Write(p []byte) (int, error)      { return c.out.Write(p) }
func (c *scriptConn) Close() error                     { return nil }
func (c *scriptConn) LocalAddr() net.Addr              { return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1} }
func (c *scriptConn) RemoteAddr() net.Addr             { return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 2} }
func (c *scriptConn) SetDeadline(time.Time) error      { return nil }
func (c *scriptConn) SetReadDeadline(time.Time) error  { return nil }
func (c *scriptConn) SetWriteDeadline(time.Time) error { return nil }

// denyGuard refuses requests whose ticket is "deny".
type denyGuard struct{}

func (denyGuard) Admit(_ OpKind, _ string, _, _ uint64, ticket []byte) (time.Time, error) {
	if string(ticket) == "deny" {
		return time.Time{}, fmt.Errorf("%w: denied", ErrForbidden)
	}
	return time.Time{}, nil
}

// FuzzServeConn runs a server connection on arbitrary bytes from its peer and checks every answer
// against a model of the segments: mapped ("mem"), read and written through a staging buffer
// ("opaque"), and one whose writes fail ("failing"). The server answers each whole request in
// order, stops at the first it cannot parse or whose payload is cut short, and its answers are
// well-formed frames.
func FuzzServeConn(f *testing.F) {
	const size = 256
	bufs := map[string][]byte{"mem": make([]byte, size), "opaque": make([]byte, size), "failing": make([]byte, size)}
	e := New(Config{Guard: denyGuard{}, NoShm: true})
	f.Cleanup(func() { e.Close() })
	for _, seg := range []Segment{NewMemSegment("mem", bufs["mem"]), opaque{NewMemSegment("opaque", bufs["opaque"])}, failingWrites{NewMemSegment("failing", bufs["failing"])}} {
		if err := e.Register(seg); err != nil {
			f.Fatal(err)
		}
	}
	write := func(seg string, off uint64, data string, ticket string) []byte {
		return append(appendRequest(nil, opWrite, seg, off, uint64(len(data)), ticket), data...)
	}
	f.Add(appendRequest(nil, opRead, "mem", 0, size, ""))
	f.Add(append(write("mem", 10, "hello", ""), appendRequest(nil, opRead, "mem", 8, 10, "")...))
	f.Add(append(write("opaque", 250, "abcdef", ""), appendRequest(nil, opRead, "opaque", 248, 8, "")...))
	f.Add(append(write("failing", 0, "xyz", ""), appendRequest(nil, opRead, "failing", 0, 0, "")...))
	f.Add(append(write("nope", 0, "xyz", ""), appendRequest(nil, opDescribe, "mem", 0, 0, "")...))
	f.Add(append(write("mem", 0, "xyz", "deny"), appendRequest(nil, opRead, "mem", size, 1, "")...))
	f.Add(append(appendRequest(nil, opRead, "", 0, 0, ""), appendRequest(nil, opWrite, "mem", 0, 5, "")...))
	f.Fuzz(func(t *testing.T, in []byte) {
		model := map[string][]byte{}
		for name, b := range bufs {
			for i := range b {
				b[i] = byte(i)
			}
			model[name] = bytes.Clone(b)
		}
		c := &scriptConn{in: bytes.NewReader(in)}
		idle, err := e.trackConn(c)
		if err != nil {
			t.Fatal(err)
		}
		e.serveConn(c, idle)

		out := bytes.NewReader(c.out.Bytes())
		req := bytes.NewReader(in)
		var hbuf [reqMax]byte
		var rbuf [respLen]byte
		for i := 0; ; i++ {
			h, err := readRequest(req, &hbuf)
			if err == nil && h.op == opWrite && int64(req.Len()) < int64(h.n) {
				err = io.ErrUnexpectedEOF // the server waits for the payload, then drops the connection
			}
			if err != nil {
				if out.Len() != 0 {
					t.Fatalf("%d bytes of answers past the %d whole requests", out.Len(), i)
				}
				return
			}
			var payload []byte
			if h.op == opWrite {
				payload = make([]byte, h.n)
				io.ReadFull(req, payload)
			}
			status, data := expect(model, h, payload)
			r, err := readResponse(out, &rbuf)
			if err != nil {
				t.Fatalf("answer %d to %+v: %v", i, h, err)
			}
			body := make([]byte, r.n)
			if _, err := io.ReadFull(out, body); err != nil {
				t.Fatalf("answer %d to %+v: %d-byte payload cut short", i, h, r.n)
			}
			if r.status != status {
				t.Fatalf("answer %d to %+v: status %d (%q), want %d", i, h, r.status, body, status)
			}
			if status == statusOK && !bytes.Equal(body, data) {
				t.Fatalf("answer %d to %+v: %x, want %x", i, h, body, data)
			}
		}
	})
}

// expect is what the fuzzed server must answer to h: its status and, if ok, its payload. It applies
// an ok write to model.
func expect(model map[string][]byte, h reqHeader, payload []byte) (byte, []byte) {
	b, ok := model[string(h.name)]
	switch {
	case len(h.name) == 0:
		return statusBadRequest, nil
	case !ok:
		return statusNotFound, nil
	case !offsetInRange(h.off, h.n, int64(len(b))):
		return statusOutOfRange, nil
	case h.op == opDescribe:
		return statusUnsupported, nil
	case string(h.ticket) == "deny":
		return statusForbidden, nil
	case h.op == opRead:
		return statusOK, b[h.off : h.off+h.n]
	case string(h.name) == "failing" && h.n > 0:
		return statusInternal, nil
	}
	copy(b[h.off:], payload)
	return statusOK, nil
}
