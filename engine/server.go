package engine

import (
	"bufio"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
)

// serveConn answers one peer connection's requests, one at a time, until the peer hangs up, sends
// garbage, stalls, idles past IdleTimeout, or Close (or the connection cap) closes the connection.
func (e *Engine) serveConn(nc net.Conn, idle *connIdle) {
	defer e.wg.Done()
	defer e.untrackConn(nc)
	tuneConn(nc)
	if e.cfg.TLS != nil {
		// untrackConn and the caps close the TCP connection beneath.
		c, err := e.startTLS(nc)
		if err != nil {
			e.met.droppedConn("tls")
			e.log.Debug("engine: TLS handshake failed", "peer", nc.RemoteAddr(), "err", err)
			return
		}
		nc = c
	}
	s := serverConn{e: e, nc: nc, in: deadlineReader{nc: nc}}
	s.br = bufio.NewReaderSize(&s.in, connReadBuf)
	for {
		// Waiting for the next request is idling; once a request starts it
		// must keep moving: a peer that stalls half-way would otherwise
		// hold this goroutine, the connection and perhaps a staging buffer.
		now := time.Now()
		s.in.set(now.Add(e.cfg.IdleTimeout), e.cfg.IdleTimeout)
		since := now.UnixNano()
		idle.since.Store(since)
		_, err := s.br.Peek(1)
		if !idle.since.CompareAndSwap(since, 0) {
			return // the cap closed it for a newer connection
		}
		if err != nil {
			if isTimeout(err) {
				e.met.droppedConn("idle")
			}
			return
		}
		now = time.Now()
		s.in.set(now.Add(requestGrace), e.cfg.StallTimeout)
		h, err := readRequest(s.br, &s.hdr)
		if err != nil {
			if errors.Is(err, ErrProtocol) {
				e.met.malformedFrame()
				e.log.Debug("engine: dropping connection after malformed request", "peer", nc.RemoteAddr(), "err", err)
			} else if isTimeout(err) {
				e.met.droppedConn("stalled")
			}
			return
		}
		until := now.Add(requestGrace + time.Duration(h.n)*time.Second/minPeerRate)
		if err := s.serve(h, until); err != nil {
			if isTimeout(err) {
				e.met.droppedConn("stalled")
			}
			e.log.Debug("engine: connection dropped", "peer", nc.RemoteAddr(), "err", err)
			return
		}
		_ = nc.SetWriteDeadline(time.Time{})
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// handshakeTimeout bounds a peer connection's TLS handshake.
const handshakeTimeout = 10 * time.Second

// startTLS shakes hands on a new peer connection, or, if the peer opened
// without a TLS handshake and AllowPlaintext is set, serves it as it is.
func (e *Engine) startTLS(nc net.Conn) (net.Conn, error) {
	_ = nc.SetDeadline(time.Now().Add(handshakeTimeout))
	defer nc.SetDeadline(time.Time{})
	first := make([]byte, 1)
	if _, err := io.ReadFull(nc, first); err != nil {
		return nil, err
	}
	const handshakeRecord = 0x16 // a request's first byte never is
	pc := unread(nc, first)
	if first[0] != handshakeRecord {
		if !e.cfg.AllowPlaintext {
			return nil, errors.New("a plaintext request to a TLS rail")
		}
		return pc, nil
	}
	tc := tls.Server(pc, e.cfg.TLS)
	if err := tc.Handshake(); err != nil {
		return nil, err
	}
	return tc, nil
}

// unread returns nc with b read again first. A TCP connection stays one
// (tcpUnread), so writes of net.Buffers keep their single writev.
func unread(nc net.Conn, b []byte) net.Conn {
	if tc, ok := nc.(*net.TCPConn); ok {
		return &tcpUnread{TCPConn: tc, prefix: b}
	}
	return &connUnread{Conn: nc, prefix: b}
}

type tcpUnread struct {
	*net.TCPConn
	prefix unreadBytes
}

func (c *tcpUnread) Read(p []byte) (int, error) { return c.prefix.read(p, c.TCPConn) }

type connUnread struct {
	net.Conn
	prefix unreadBytes
}

func (c *connUnread) Read(p []byte) (int, error) { return c.prefix.read(p, c.Conn) }

// unreadBytes are read before the connection's own.
type unreadBytes []byte

func (b *unreadBytes) read(p []byte, r io.Reader) (int, error) {
	if len(*b) > 0 {
		n := copy(p, *b)
		*b = (*b)[n:]
		return n, nil
	}
	return r.Read(p)
}

// A request must finish within requestGrace plus its length at minPeerRate
// bytes per second, or the server drops the connection.
const (
	requestGrace = 10 * time.Second
	minPeerRate  = 1 << 20
)

// deadlineReader reads from a connection with a deadline before every
// read: the sooner of the phase's end and stall from now, so a peer that
// stops sending is noticed within stall, however long its request may take.
type deadlineReader struct {
	nc    net.Conn
	until time.Time
	stall time.Duration
}

func (r *deadlineReader) set(until time.Time, stall time.Duration) { r.until, r.stall = until, stall }

func (r *deadlineReader) Read(p []byte) (int, error) {
	d := time.Now().Add(r.stall)
	if r.until.Before(d) {
		d = r.until
	}
	_ = r.nc.SetReadDeadline(d)
	return r.nc.Read(p)
}

type serverConn struct {
	e    *Engine
	nc   net.Conn
	in   deadlineReader
	br   *bufio.Reader
	hdr  [reqMax]byte
	resp [respLen + maxErrMsg]byte
}

// serve answers one request, which must be done by until. It returns an error only when the
// connection is no longer usable.
func (s *serverConn) serve(h reqHeader, until time.Time) error {
	seg, err := s.lookup(h)
	if err == nil && h.op != opDescribe && s.e.cfg.Guard != nil {
		until, err = s.admit(seg, h, until)
	}
	s.in.set(until, s.e.cfg.StallTimeout)
	_ = s.nc.SetWriteDeadline(until)
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

// admit asks the Guard about h and returns when the request must end: by
// until, and by its ticket's end, so a late writer's bytes cannot land
// after the space may have become another put's.
func (s *serverConn) admit(seg Segment, h reqHeader, until time.Time) (time.Time, error) {
	kind := OpRead
	if h.op == opWrite {
		kind = OpWrite
	}
	by, err := s.e.cfg.Guard.Admit(kind, seg.Name(), h.off, h.n, h.ticket)
	if err != nil {
		s.e.met.refused(kind)
		return until, err
	}
	if !by.IsZero() && by.Before(until) {
		return by, nil
	}
	return until, nil
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
		return s.send(hdr, b)
	}
	if n == 0 {
		_, err := s.nc.Write(hdr)
		return err
	}
	bp, ok := s.e.getScratch(s.e.cfg.StallTimeout)
	if !ok {
		s.e.met.droppedConn("busy")
		return s.sendError(fmt.Errorf("%w: no staging buffer free for %q", ErrUnavailable, seg.Name()))
	}
	defer s.e.putScratch(bp)
	for done := int64(0); done < n; {
		chunk := (*bp)[:min(n-done, int64(len(*bp)))]
		if _, err := seg.ReadAt(chunk, off+done); err != nil {
			if done == 0 {
				return s.sendError(fmt.Errorf("read %q: %w", seg.Name(), err))
			}
			return err
		}
		var head []byte
		if done == 0 {
			head = hdr
		}
		if err := s.send(head, chunk); err != nil {
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
	if n == 0 {
		return s.sendOK()
	}
	// A staging buffer only once the payload comes: a peer that sends a
	// header and stops holds none.
	if _, err := s.br.Peek(1); err != nil {
		return err
	}
	bp, ok := s.e.getScratch(s.e.cfg.StallTimeout)
	if !ok {
		s.e.met.droppedConn("busy")
		return fmt.Errorf("%w: no staging buffer free for a write to %q", ErrUnavailable, seg.Name())
	}
	defer s.e.putScratch(bp)
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

// send writes head then body (one writev a piece), sendPiece bytes of body
// at a time, each piece within StallTimeout (and the request's deadline):
// a peer that stops reading its answer is dropped as one that stops
// sending a request is.
func (s *serverConn) send(head, body []byte) error {
	for first := true; first || len(body) > 0; first = false {
		piece := body[:min(len(body), sendPiece)]
		body = body[len(piece):]
		d := time.Now().Add(s.e.cfg.StallTimeout)
		if s.in.until.Before(d) {
			d = s.in.until
		}
		_ = s.nc.SetWriteDeadline(d)
		bufs := net.Buffers{head, piece}
		head = nil
		if _, err := bufs.WriteTo(s.nc); err != nil {
			return err
		}
	}
	return nil
}

// sendPiece is how much of an answer one write deadline covers: at the
// 1 MiB/s the deadlines allow, well within StallTimeout.
const sendPiece = 1 << 20

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
