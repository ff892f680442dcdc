package engine

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
)

// serveConn answers one peer connection's requests, one at a time, until the peer hangs up, sends
// garbage, or Close closes the connection.
func (e *Engine) serveConn(nc net.Conn) {
	defer e.wg.Done()
	defer e.untrackConn(nc)
	tuneConn(nc)
	s := serverConn{e: e, nc: nc, br: bufio.NewReaderSize(nc, connReadBuf)}
	for {
		// An idle connection may wait forever for its next request, but once
		// a request starts it must keep moving: a peer that stalls half-way
		// would otherwise hold this goroutine and connection for good.
		if _, err := s.br.Peek(1); err != nil {
			return
		}
		_ = nc.SetDeadline(time.Now().Add(requestGrace))
		h, err := readRequest(s.br, &s.hdr)
		if err != nil {
			if errors.Is(err, ErrProtocol) {
				e.met.malformedFrame()
				e.log.Debug("engine: dropping connection after malformed request", "peer", nc.RemoteAddr(), "err", err)
			}
			return
		}
		_ = nc.SetDeadline(time.Now().Add(requestGrace + time.Duration(h.n)*time.Second/minPeerRate))
		if err := s.serve(h); err != nil {
			e.log.Debug("engine: connection dropped", "peer", nc.RemoteAddr(), "err", err)
			return
		}
		_ = nc.SetDeadline(time.Time{})
	}
}

// A request must finish within requestGrace plus its length at minPeerRate
// bytes per second, or the server drops the connection.
const (
	requestGrace = 10 * time.Second
	minPeerRate  = 1 << 20
)

type serverConn struct {
	e    *Engine
	nc   net.Conn
	br   *bufio.Reader
	hdr  [reqMax]byte
	resp [respLen + maxErrMsg]byte
}

// serve answers one request. It returns an error only when the connection is no longer usable.
func (s *serverConn) serve(h reqHeader) error {
	seg, err := s.lookup(h)
	if err != nil {
		// The frame is well formed, so the connection survives: skip the payload, then say why.
		if h.op == opWrite {
			if _, err := io.CopyN(io.Discard, s.br, int64(h.n)); err != nil {
				return err
			}
		}
		return s.sendError(err)
	}
	if h.op == opDescribe {
		return s.describe(seg)
	}
	off, n := int64(h.off), int64(h.n)
	if h.op == opRead {
		// Counted before the reply goes out, so a peer that has its answer
		// sees the metric already moved.
		s.e.met.serve(h.op, n)
		return s.read(seg, off, n)
	}
	return s.write(seg, off, n)
}

func (s *serverConn) lookup(h reqHeader) (Segment, error) {
	if len(h.name) == 0 {
		return nil, fmt.Errorf("%w: empty segment name", ErrInvalid)
	}
	seg := s.e.segs.get(h.name)
	if seg == nil {
		return nil, fmt.Errorf("%w: %q", ErrSegmentNotFound, h.name)
	}
	if size := seg.Size(); !offsetInRange(h.off, h.n, size) {
		return nil, fmt.Errorf("%w: %d+%d of %q (size %d)", ErrOutOfRange, h.off, h.n, h.name, size)
	}
	return seg, nil
}

// mapped returns the segment's memory for [off, off+n) if it has any.
func mapped(seg Segment, off, n int64) ([]byte, bool) {
	m, ok := seg.(Mapped)
	if !ok {
		return nil, false
	}
	b := m.Bytes()
	if int64(len(b)) < off+n {
		return nil, false // a segment whose Bytes is shorter than its Size: use ReadAt/WriteAt
	}
	return b[off : off+n : off+n], true
}

// read sends [off, off+n) of seg. Mapped segments go out straight from their memory, header and
// payload in one writev. Others are staged through a scratch buffer; an error after the header has
// gone out can only be reported by dropping the connection.
func (s *serverConn) read(seg Segment, off, n int64) error {
	hdr := appendResponse(s.resp[:0], respHeader{status: statusOK, n: uint64(n)})
	if b, ok := mapped(seg, off, n); ok {
		bufs := net.Buffers{hdr, b}
		_, err := bufs.WriteTo(s.nc)
		return err
	}
	if n == 0 {
		_, err := s.nc.Write(hdr)
		return err
	}
	bp := s.e.scratch.Get().(*[]byte)
	defer s.e.scratch.Put(bp)
	for done := int64(0); done < n; {
		chunk := (*bp)[:min(n-done, int64(len(*bp)))]
		if _, err := seg.ReadAt(chunk, off+done); err != nil {
			if done == 0 {
				return s.sendError(fmt.Errorf("read %q: %w", seg.Name(), err))
			}
			return err
		}
		out := net.Buffers{chunk}
		if done == 0 {
			out = net.Buffers{hdr, chunk}
		}
		if _, err := out.WriteTo(s.nc); err != nil {
			return err
		}
		done += int64(len(chunk))
	}
	return nil
}

// write stores the request's n-byte payload at off in seg: straight into the segment's memory if
// it is Mapped, else through a scratch buffer and WriteAt.
func (s *serverConn) write(seg Segment, off, n int64) error {
	if b, ok := mapped(seg, off, n); ok {
		if _, err := io.ReadFull(s.br, b); err != nil {
			return err
		}
		s.e.met.serve(opWrite, n)
		return s.sendOK()
	}
	bp := s.e.scratch.Get().(*[]byte)
	defer s.e.scratch.Put(bp)
	for done := int64(0); done < n; {
		chunk := (*bp)[:min(n-done, int64(len(*bp)))]
		if _, err := io.ReadFull(s.br, chunk); err != nil {
			return err
		}
		if _, err := seg.WriteAt(chunk, off+done); err != nil {
			// Keep the connection: drain the rest of the payload, then report the failure.
			done += int64(len(chunk))
			if _, err := io.CopyN(io.Discard, s.br, n-done); err != nil {
				return err
			}
			return s.sendError(fmt.Errorf("write %q: %w", seg.Name(), err))
		}
		done += int64(len(chunk))
	}
	s.e.met.serve(opWrite, n)
	return s.sendOK()
}

// describe answers with the record a same-host client needs to map seg (see describeSegment), or
// with statusUnsupported if seg cannot be shared.
func (s *serverConn) describe(seg Segment) error {
	info, err := describeSegment(seg)
	if err != nil {
		return s.sendError(err)
	}
	_, err = s.nc.Write(appendDescribeResponse(s.resp[:0], info))
	return err
}

func (s *serverConn) sendOK() error {
	_, err := s.nc.Write(appendResponse(s.resp[:0], respHeader{status: statusOK}))
	return err
}

// sendError answers with err's status and its message, cut to maxErrMsg.
func (s *serverConn) sendError(err error) error {
	msg := err.Error()
	msg = msg[:min(len(msg), maxErrMsg)]
	b := appendResponse(s.resp[:0], respHeader{status: errStatus(err), n: uint64(len(msg))})
	_, err = s.nc.Write(append(b, msg...))
	return err
}
