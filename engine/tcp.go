package engine

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// tcpTransport is the TCP Transport: per peer endpoint, a pool of up to conns connections, each
// carrying one request at a time (see frame.go for the wire format).
type tcpTransport struct {
	conns  int
	dialer net.Dialer
	tls    *tls.Config // nil: plaintext

	mu struct {
		sync.Mutex
		closed bool
		peers  map[string]*tcpPeer
		all    map[*tcpConn]struct{} // every open connection, idle or busy, for Close
	}
}

// tcpPeer is the pool for one endpoint.
type tcpPeer struct {
	addr  string
	slots chan struct{} // one per connection that may exist; bounds dials and requests in flight
	idle  []*tcpConn    // guarded by tcpTransport.mu
}

// tcpConn is one pooled connection.
type tcpConn struct {
	nc     net.Conn
	br     *bufio.Reader // small: headers; payloads bigger than it bypass it
	hdr    [reqMax]byte
	resp   [respLen]byte
	reused bool // came from the idle pool, so it may have gone stale while it sat there
}

// connReadBuf sizes the per-connection read buffer. It only ever holds headers and the first few
// bytes of a payload: bufio reads requests at least this large straight into the caller's buffer.
const connReadBuf = 4 << 10

// NewTCPTransport returns the TCP transport an engine builds by default,
// for callers that wrap it (enginetest.Shaper) and pass it as
// Config.Transport.
func NewTCPTransport(connsPerRail int, dialTimeout time.Duration) Transport {
	if connsPerRail <= 0 {
		connsPerRail = defaultConnsPerPeer
	}
	if dialTimeout <= 0 {
		dialTimeout = defaultDialTimeout
	}
	return newTCPTransport(connsPerRail, dialTimeout, nil)
}

// SliceBase is 256 KiB: on loopback, 64 KiB slices spend as much time in
// per-round-trip system calls as in copying (see docs/benchmarks.md).
func (t *tcpTransport) SliceBase() int { return 256 << 10 }

func newTCPTransport(conns int, dialTimeout time.Duration, tlsCfg *tls.Config) *tcpTransport {
	t := &tcpTransport{conns: conns, dialer: net.Dialer{Timeout: dialTimeout, KeepAlive: 30 * time.Second}, tls: tlsCfg}
	t.mu.peers = make(map[string]*tcpPeer)
	t.mu.all = make(map[*tcpConn]struct{})
	return t
}

func (t *tcpTransport) Name() string { return "tcp" }

// Do sends op over a pooled connection. A request that fails on a connection taken from the idle
// pool is retried once on a fresh one: the peer may have restarted or dropped an idle connection
// since it was last used, and reads and writes of a fixed range are idempotent.
func (t *tcpTransport) Do(ctx context.Context, op *Op) error {
	if len(op.Buf) > MaxOpLen {
		return fmt.Errorf("%w: op of %d bytes over cap %d", ErrInvalid, len(op.Buf), MaxOpLen)
	}
	if n := len(op.Target.Segment); n == 0 || n > MaxSegmentName {
		return fmt.Errorf("%w: segment name of %d bytes", ErrInvalid, n)
	}
	if op.Rail == "" {
		o := *op
		o.Rail = op.Target.Rails()[0]
		op = &o
	}
	return t.call(ctx, op.Rail, func(c *tcpConn) (bool, error) { return c.exchange(op) })
}

// call runs one exchange on a pooled connection to addr, with Do's rules: ctx closes the
// connection under a stuck exchange, and a failure on a connection that sat idle in the pool is
// retried once on a fresh one. exchange reports whether the connection can be kept.
func (t *tcpTransport) call(ctx context.Context, addr string, exchange func(*tcpConn) (keep bool, err error)) error {
	p, err := t.peer(addr)
	if err != nil {
		return err
	}
	for {
		c, err := t.acquire(ctx, p)
		if err != nil {
			return err
		}
		stop := context.AfterFunc(ctx, func() { c.nc.Close() })
		keep, err := exchange(c)
		if !stop() {
			// The connection was closed under us; if the exchange finished first, its result stands.
			keep = false
			if err != nil {
				err = context.Cause(ctx)
			}
		}
		t.release(p, c, keep)
		if err == nil || keep || !c.reused || ctx.Err() != nil || !errors.Is(err, ErrUnavailable) {
			return t.closedErr(err)
		}
	}
}

// closedErr reports failures caused by Close as ErrClosed rather than as a broken connection.
func (t *tcpTransport) closedErr(err error) error {
	if err == nil {
		return nil
	}
	t.mu.Lock()
	closed := t.mu.closed
	t.mu.Unlock()
	if closed && !errors.Is(err, ErrClosed) {
		return fmt.Errorf("%w: %w", ErrClosed, err)
	}
	return err
}

func (t *tcpTransport) peer(addr string) (*tcpPeer, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.mu.closed {
		return nil, ErrClosed
	}
	p := t.mu.peers[addr]
	if p == nil {
		p = &tcpPeer{addr: addr, slots: make(chan struct{}, t.conns)}
		t.mu.peers[addr] = p
	}
	return p, nil
}

// acquire waits for a connection slot, then reuses an idle connection or dials a new one.
func (t *tcpTransport) acquire(ctx context.Context, p *tcpPeer) (*tcpConn, error) {
	if err := ctx.Err(); err != nil {
		return nil, context.Cause(ctx)
	}
	select {
	case p.slots <- struct{}{}:
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
	t.mu.Lock()
	if t.mu.closed {
		t.mu.Unlock()
		<-p.slots
		return nil, ErrClosed
	}
	if n := len(p.idle); n > 0 {
		c := p.idle[n-1]
		p.idle = p.idle[:n-1]
		t.mu.Unlock()
		c.reused = true
		return c, nil
	}
	t.mu.Unlock()

	nc, err := t.dialer.DialContext(ctx, "tcp", p.addr)
	if err != nil {
		<-p.slots
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		return nil, fmt.Errorf("%w: dial %s: %w", ErrUnavailable, p.addr, err)
	}
	tuneConn(nc)
	if t.tls != nil {
		if nc, err = t.handshake(ctx, nc, p.addr); err != nil {
			<-p.slots
			return nil, err
		}
	}
	c := &tcpConn{nc: nc, br: bufio.NewReaderSize(nc, connReadBuf)}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.mu.closed {
		nc.Close()
		<-p.slots
		return nil, ErrClosed
	}
	t.mu.all[c] = struct{}{}
	return c, nil
}

// handshake runs TLS's client side on nc, within the dial timeout; it
// closes nc on failure.
func (t *tcpTransport) handshake(ctx context.Context, nc net.Conn, addr string) (net.Conn, error) {
	cfg := t.tls
	if cfg.ServerName == "" {
		cfg = cfg.Clone()
		cfg.ServerName, _, _ = net.SplitHostPort(addr)
	}
	hctx, cancel := context.WithTimeout(ctx, t.dialer.Timeout)
	defer cancel()
	tc := tls.Client(nc, cfg)
	if err := tc.HandshakeContext(hctx); err != nil {
		nc.Close()
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		return nil, fmt.Errorf("%w: TLS with %s: %w", ErrUnavailable, addr, err)
	}
	return tc, nil
}

// release returns c to the idle pool if keep, else closes it; either way it frees c's slot.
func (t *tcpTransport) release(p *tcpPeer, c *tcpConn, keep bool) {
	t.mu.Lock()
	if keep && !t.mu.closed {
		p.idle = append(p.idle, c)
	} else {
		delete(t.mu.all, c)
		c.nc.Close()
	}
	t.mu.Unlock()
	<-p.slots
}

// exchange writes one request and reads its response, straight from and into op.Buf. keep
// reports whether c is still in a known state and can carry another request.
func (c *tcpConn) exchange(op *Op) (keep bool, err error) {
	wop := opRead
	if op.Kind == OpWrite {
		wop = opWrite
	}
	hdr := appendRequest(c.hdr[:0], wop, op.Target.Segment, uint64(op.Offset), uint64(len(op.Buf)), op.Target.Ticket)
	if wop == opWrite && len(op.Buf) > 0 {
		bufs := net.Buffers{hdr, op.Buf} // one writev for header and payload
		_, err = bufs.WriteTo(c.nc)
	} else {
		_, err = c.nc.Write(hdr)
	}
	if err != nil {
		return false, fmt.Errorf("%w: send to %s: %w", ErrUnavailable, op.Rail, err)
	}

	h, err := readResponse(c.br, &c.resp)
	if err != nil {
		if errors.Is(err, ErrProtocol) {
			return false, fmt.Errorf("response from %s: %w", op.Rail, err)
		}
		return false, fmt.Errorf("%w: receive from %s: %w", ErrUnavailable, op.Rail, err)
	}
	if h.status != statusOK {
		msg := make([]byte, h.n) // at most maxErrMsg, checked by readResponse
		if _, err := io.ReadFull(c.br, msg); err != nil {
			return false, fmt.Errorf("%w: receive from %s: %w", ErrUnavailable, op.Rail, noEOF(err))
		}
		return true, fmt.Errorf("%w: %s", statusErr(h.status), msg)
	}
	want := uint64(0)
	if wop == opRead {
		want = uint64(len(op.Buf))
	}
	if h.n != want {
		return false, fmt.Errorf("%w: response from %s has %d bytes, want %d", ErrProtocol, op.Rail, h.n, want)
	}
	if want > 0 {
		if _, err := io.ReadFull(c.br, op.Buf); err != nil {
			return false, fmt.Errorf("%w: receive from %s: %w", ErrUnavailable, op.Rail, noEOF(err))
		}
	}
	return true, nil
}

// Close closes every connection, idle or busy; requests in flight fail with ErrClosed.
func (t *tcpTransport) Close() error {
	t.mu.Lock()
	t.mu.closed = true
	all := t.mu.all
	t.mu.all = make(map[*tcpConn]struct{})
	for _, p := range t.mu.peers {
		p.idle = nil
	}
	t.mu.Unlock()
	for c := range all {
		c.nc.Close()
	}
	return nil
}

// tuneConn sets socket options for bulk transfers. No-delay: a request header must not wait for
// Nagle. Buffer sizes stay with the kernel's autotuning, which grows them past what a fixed
// setsockopt would (an explicit size turns autotuning off and is capped by net.core.*mem_max).
func tuneConn(nc net.Conn) {
	if tc, ok := nc.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
}
