package kvevents

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// The sockets here are our own ZMTP 3 listeners: zmq4 performs each
// connection's handshake, and we frame the messages. zmq4's own sockets
// trust their peers (they allocate whatever frame length a peer declares,
// handshake in the accepting goroutine with no deadline, write to peers
// with none) and its PUB socket leaves a goroutine behind on Close.
// Owning the listeners bounds what a peer can make the master hold or
// wait for, and lets Close stop every goroutine.
const (
	// maxPeers is the most connections one socket keeps; more are closed
	// as they arrive.
	maxPeers = 64
	// maxFrame and maxFrames bound what a peer may send in one message:
	// peers send only the handshake, subscriptions and 8-byte replay
	// requests.
	maxFrame  = 4 << 10
	maxFrames = 16
	// handshakeTimeout is how long a peer has for its handshake.
	handshakeTimeout = 5 * time.Second
	// writeTimeout is how long one message to a peer may take before the
	// peer is dropped as too slow.
	writeTimeout = 10 * time.Second
)

// ZMTP frame flags.
const (
	flagMore    = 0x01
	flagLong    = 0x02
	flagCommand = 0x04
)

var (
	errFrameTooLong = errors.New("kvevents: peer sent a frame too long")
	errTooManyParts = errors.New("kvevents: peer sent a message of too many frames")
)

// peer is one connection a socket of ours accepted, after its handshake.
type peer struct {
	conn net.Conn
	r    *bufio.Reader
	wmu  sync.Mutex // one message at a time on the wire
}

// handshake performs the ZMTP handshake (NULL security) on c as a socket
// of type typ.
func handshake(c net.Conn, typ zmq4.SocketType) (p *peer, err error) {
	// zmq4 v0.17.0 trusts the metadata of a peer's READY (a property
	// length past the frame's end panics): a peer's bytes must not stop
	// the master.
	defer func() {
		if r := recover(); r != nil {
			p, err = nil, fmt.Errorf("kvevents: malformed handshake: %v", r)
		}
	}()
	if err := c.SetDeadline(time.Now().Add(handshakeTimeout)); err != nil {
		return nil, err
	}
	// zmq4 reads exactly the greeting and the READY command, no further;
	// scanning them refuses a READY too long before zmq4 allocates it.
	if _, err := zmq4.Open(&scannedConn{Conn: c, scan: frameScanner{body: greetingLen}}, null.Security(), typ, nil, true, nil); err != nil {
		return nil, err
	}
	if err := c.SetDeadline(time.Time{}); err != nil {
		return nil, err
	}
	return &peer{conn: c, r: bufio.NewReaderSize(c, 512)}, nil
}

// readMsg reads the next message the peer sends: its frames, or the one
// frame of a command.
func (p *peer) readMsg() (frames [][]byte, command bool, err error) {
	for {
		var hdr [9]byte
		if _, err := io.ReadFull(p.r, hdr[:2]); err != nil {
			return nil, false, err
		}
		size := uint64(hdr[1])
		if hdr[0]&flagLong != 0 {
			if _, err := io.ReadFull(p.r, hdr[2:]); err != nil {
				return nil, false, err
			}
			size = binary.BigEndian.Uint64(hdr[1:])
		}
		if size > maxFrame {
			return nil, false, errFrameTooLong
		}
		body := make([]byte, size)
		if _, err := io.ReadFull(p.r, body); err != nil {
			return nil, false, err
		}
		frames = append(frames, body)
		switch {
		case hdr[0]&flagCommand != 0:
			return frames, true, nil
		case hdr[0]&flagMore == 0:
			return frames, false, nil
		case len(frames) == maxFrames:
			return nil, false, errTooManyParts
		}
	}
}

// send writes one message, prepared by appendMsg, within writeTimeout.
func (p *peer) send(msg net.Buffers) error {
	p.wmu.Lock()
	defer p.wmu.Unlock()
	if err := p.conn.SetWriteDeadline(time.Now().Add(writeTimeout)); err != nil {
		return err
	}
	_, err := msg.WriteTo(p.conn)
	return err
}

// command answers a command the peer sent: a PING gets its PONG. It
// returns the name and body of the command.
func (p *peer) command(frame []byte) (name string, body []byte) {
	if len(frame) == 0 || int(frame[0]) > len(frame)-1 {
		return "", nil
	}
	name, body = string(frame[1:1+frame[0]]), frame[1+frame[0]:]
	if name == "PING" && len(body) >= 2 {
		pong := append([]byte{4}, "PONG"...)
		pong = append(pong, body[2:]...) // the ping's context
		if err := p.send(appendFrame(nil, pong, flagCommand)); err != nil {
			p.conn.Close()
		}
	}
	return name, body
}

// appendMsg appends the ZMTP framing of a message of frames to msg.
func appendMsg(msg net.Buffers, frames ...[]byte) net.Buffers {
	for i, f := range frames {
		var flags byte
		if i < len(frames)-1 {
			flags = flagMore
		}
		msg = appendFrame(msg, f, flags)
	}
	return msg
}

func appendFrame(msg net.Buffers, f []byte, flags byte) net.Buffers {
	hdr := []byte{flags, byte(len(f))}
	if len(f) > 255 {
		hdr = binary.BigEndian.AppendUint64([]byte{flags | flagLong}, uint64(len(f)))
	}
	return append(msg, hdr, f)
}

// server accepts the peers of one socket, at most maxPeers at a time, and
// serves each in a goroutine of its own until close.
type server struct {
	ln     net.Listener
	typ    zmq4.SocketType
	handle func(*peer)
	log    *slog.Logger
	wg     sync.WaitGroup

	mu struct {
		sync.Mutex
		conns  map[net.Conn]struct{}
		closed bool
	}
}

// listen starts a server of sockets of type typ on endpoint,
// tcp://HOST:PORT (HOST * for every interface, PORT 0 for any).
func listen(endpoint string, typ zmq4.SocketType, handle func(*peer), log *slog.Logger) (*server, error) {
	hostPort, ok := strings.CutPrefix(endpoint, "tcp://")
	host, port, err := net.SplitHostPort(hostPort)
	if !ok || err != nil {
		return nil, fmt.Errorf("%w %q: want tcp://HOST:PORT", ErrEndpoint, endpoint)
	}
	if host == "*" {
		host = ""
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(host, port))
	if err != nil {
		return nil, fmt.Errorf("kvevents: listen on %s: %w", endpoint, err)
	}
	s := &server{ln: ln, typ: typ, handle: handle, log: log}
	s.mu.conns = make(map[net.Conn]struct{})
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// addr is the endpoint the server listens on, its port chosen.
func (s *server) addr() string { return "tcp://" + s.ln.Addr().String() }

func (s *server) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			// Out of file descriptors, say: wait a little rather than spin.
			s.log.Debug("kvevents: accept", "err", err)
			time.Sleep(50 * time.Millisecond)
			continue
		}
		if !s.track(c) {
			c.Close()
			continue
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer s.untrack(c)
			p, err := handshake(c, s.typ)
			if err != nil {
				s.log.Debug("kvevents: handshake", "peer", c.RemoteAddr(), "err", err)
				return
			}
			s.handle(p)
		}()
	}
}

func (s *server) track(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mu.closed || len(s.mu.conns) >= maxPeers {
		return false
	}
	s.mu.conns[c] = struct{}{}
	return true
}

func (s *server) untrack(c net.Conn) {
	s.mu.Lock()
	delete(s.mu.conns, c)
	s.mu.Unlock()
	c.Close()
}

// close stops accepting, closes every connection and waits for their
// goroutines.
func (s *server) close() error {
	s.mu.Lock()
	s.mu.closed = true
	err := s.ln.Close()
	for c := range s.mu.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return err
}

// greetingLen is the length of a ZMTP 3 greeting.
const greetingLen = 64

// scannedConn is a connection whose incoming frames a frameScanner checks.
type scannedConn struct {
	net.Conn
	scan frameScanner
}

func (c *scannedConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if e := c.scan.feed(b[:n]); e != nil {
		return 0, e
	}
	return n, err
}

// frameScanner follows the ZMTP 3 framing of what a peer sends (a
// greeting, then frames: a flags byte, a length of 1 byte or, LONG, of 8
// bytes big-endian, the body) and refuses a frame longer than maxFrame.
type frameScanner struct {
	body uint64 // bytes left of the greeting or the frame being read
	hdr  [9]byte
	nhdr int
}

func (s *frameScanner) feed(b []byte) error {
	for len(b) > 0 {
		if s.body > 0 {
			n := min(s.body, uint64(len(b)))
			s.body -= n
			b = b[n:]
			continue
		}
		s.hdr[s.nhdr] = b[0]
		s.nhdr++
		b = b[1:]
		need := 2
		if s.hdr[0]&flagLong != 0 {
			need = 9
		}
		if s.nhdr < need {
			continue
		}
		s.nhdr = 0
		size := uint64(s.hdr[1])
		if need == 9 {
			size = binary.BigEndian.Uint64(s.hdr[1:])
		}
		if size > maxFrame {
			return errFrameTooLong
		}
		s.body = size
	}
	return nil
}
