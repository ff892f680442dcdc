package framed

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

const (
	// dialTimeout bounds a dial and its preface exchange.
	dialTimeout = 5 * time.Second
	// unframedFor is how long a peer that closed on the preface, or
	// answered another, is called through the fallback before framed is
	// tried again.
	unframedFor = time.Minute
)

// errUnframed is a peer that does not speak framed.
var errUnframed = errors.New("framed: peer does not answer the preface")

// errSilent is a peer that did not answer a dial within dialTimeout.
var errSilent = errors.New("framed: no answer")

// errClosed ends the connections of a closed client.
var errClosed = errors.New("client closed")

// Client is one server's unary calls over one framed connection, dialled
// on first use and again after it broke. It is a grpc.ClientConnInterface,
// so generated clients use it: streams, and every call while the server
// does not speak framed, go to fallback. Its errors are gRPC statuses, as
// a grpc.ClientConn's.
type Client struct {
	addr     string
	fallback grpc.ClientConnInterface
	creds    Credentials
	ctx      context.Context // ends at Close, and with it a dial
	cancel   context.CancelFunc
	wg       sync.WaitGroup // the dial in progress
	mu       struct {
		sync.Mutex
		conn     *clientConn
		dialing  *dialAttempt // the dial in progress, if any
		unframed time.Time    // until then, calls take fallback
		down     time.Time    // until then, calls fail with downErr
		downErr  error
		backoff  time.Duration // the last down's
		closed   bool
	}
}

var _ grpc.ClientConnInterface = (*Client)(nil)

// Credentials are what a client shows the server on each connection.
type Credentials struct {
	// TLS, if set, wraps the connection (the server's listener must
	// terminate TLS; see TLSCredentials).
	TLS *tls.Config
	// Metadata is sent once per connection, in the hello after the
	// preface, and is every call's incoming metadata on the server: the
	// bearer token, which framed requests have no room for.
	Metadata metadata.MD
}

// NewClient returns a client of addr; it does not dial.
func NewClient(addr string, fallback grpc.ClientConnInterface, creds Credentials) *Client {
	c := &Client{addr: addr, fallback: fallback, creds: creds}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	return c
}

// NewStream opens a stream through the fallback.
func (c *Client) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	return c.fallback.NewStream(ctx, desc, method, opts...)
}

// Invoke makes a unary call. The trailer and header call options are
// honoured; the others (message sizes, codecs) are gRPC's own, and framed
// calls keep to MaxMessage.
func (c *Client) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	cc, err := c.conn(ctx)
	if errors.Is(err, errUnframed) {
		return c.fallback.Invoke(ctx, method, args, reply, opts...)
	}
	if err != nil {
		return unsent{err}
	}
	a, err := cc.call(ctx, method, args)
	if err != nil {
		return err
	}
	defer cc.bufs.put(a.body) // reply decodes a copy of the message
	var details []string
	if a.trailer != nil {
		details = a.trailer[detailsKey]
		delete(a.trailer, detailsKey) // gRPC does not show it either
	}
	for _, o := range opts {
		switch o := o.(type) {
		case grpc.TrailerCallOption:
			*o.TrailerAddr = a.trailer
		case grpc.HeaderCallOption:
			*o.HeaderAddr = metadata.MD{}
		}
	}
	if a.code != codes.OK {
		if len(details) > 0 {
			p := &spb.Status{}
			if err := proto.Unmarshal([]byte(details[0]), p); err == nil && p.Code == int32(a.code) {
				return status.FromProto(p).Err()
			}
		}
		return status.Error(a.code, a.text)
	}
	m, ok := reply.(proto.Message)
	if !ok {
		return status.Errorf(codes.Internal, "framed: reply %T is not a proto message", reply)
	}
	if err := proto.Unmarshal(a.message, m); err != nil {
		return status.Errorf(codes.Internal, "framed: unmarshal the reply of %s: %v", method, err)
	}
	return nil
}

// conn returns the live connection, dialling one if there is none;
// errUnframed says to take the fallback. The dial is the client's, not the
// caller's: a caller whose ctx ends first leaves it running, so a peer
// that accepts but never answers (a stopped or wedged process) is found
// out within dialTimeout whatever the callers' deadlines, and its calls
// then fail at once with Unavailable (leaderconn moves on to another
// master) until a backoff has passed, as a gRPC channel in
// TRANSIENT_FAILURE fails them.
func (c *Client) conn(ctx context.Context) (*clientConn, error) {
	for {
		c.mu.Lock()
		now := time.Now()
		switch {
		case c.mu.closed:
			c.mu.Unlock()
			return nil, status.Error(codes.Canceled, "framed: client is closed")
		case c.mu.conn != nil && c.mu.conn.usable(now):
			cc := c.mu.conn
			c.mu.Unlock()
			return cc, nil
		case now.Before(c.mu.unframed):
			c.mu.Unlock()
			return nil, errUnframed
		case now.Before(c.mu.down):
			err := c.mu.downErr
			c.mu.Unlock()
			return nil, err
		case c.mu.dialing == nil:
			c.mu.dialing = &dialAttempt{done: make(chan struct{})}
			c.wg.Add(1)
			go c.dial(c.mu.dialing)
		}
		d := c.mu.dialing
		c.mu.Unlock()
		select {
		case <-d.done:
			if d.err != nil && !errors.Is(d.err, errUnframed) && !errors.Is(d.err, errSilent) {
				return nil, d.err // refused: the next call dials again
			}
		case <-ctx.Done():
			return nil, status.FromContextError(context.Cause(ctx)).Err()
		}
	}
}

// dialAttempt is a dial in progress; err is set before done closes.
type dialAttempt struct {
	done chan struct{}
	err  error
}

// dial connects, then ends d. A peer that does not answer within
// dialTimeout is down for a backoff that doubles from downFor to
// maxDownFor; one that refuses is dialled again by the next call.
func (c *Client) dial(d *dialAttempt) {
	defer c.wg.Done()
	cc, err := dial(c.ctx, c.addr, c.creds)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.mu.dialing = nil
	d.err = err
	close(d.done)
	switch {
	case errors.Is(err, errUnframed):
		c.mu.unframed = time.Now().Add(unframedFor)
	case errors.Is(err, errSilent):
		c.mu.backoff = min(max(2*c.mu.backoff, downFor), maxDownFor)
		c.mu.down = time.Now().Add(c.mu.backoff)
		c.mu.downErr = status.Errorf(codes.Unavailable, "framed: %s did not answer within %v (not tried again for %v)", c.addr, dialTimeout, c.mu.backoff)
	case err == nil && c.mu.closed:
		cc.close(errClosed)
	case err == nil:
		c.mu.backoff = 0
		if old := c.mu.conn; old != nil {
			old.close(errors.New("replaced"))
		}
		c.mu.conn = cc
	}
}

// How long a peer that did not answer a dial is not dialled again.
const (
	downFor    = time.Second
	maxDownFor = 10 * time.Second
)

// Close closes the connection; calls in flight fail. The fallback is the
// caller's to close.
func (c *Client) Close() error {
	c.mu.Lock()
	c.mu.closed = true
	cc := c.mu.conn
	c.mu.conn = nil
	c.mu.Unlock()
	c.cancel() // a dial in progress
	c.wg.Wait()
	if cc != nil {
		cc.close(errClosed)
		cc.wg.Wait()
	}
	return nil
}

// clientConn is one framed connection: calls write their requests under
// wmu, and its reader hands each answer to the call waiting for it.
type clientConn struct {
	conn net.Conn
	addr string
	// wlock is held (full) while a frame is written: a call waiting for
	// it gives up at its context's end, and a frame begun is finished.
	wlock  chan struct{}
	bufs   bufPool
	wg     sync.WaitGroup // the reader, and cancel frames waiting to go
	closed chan struct{}  // closed with the connection
	mu     struct {
		sync.Mutex
		next    uint64
		used    time.Time // when a call last took it
		pending map[uint64]chan answer
		err     error // why the connection ended; nil while live
	}
}

// dial connects to addr, shakes hands (TLS, if creds ask for it) and
// exchanges the preface and the hello, within dialTimeout.
func dial(ctx context.Context, addr string, creds Credentials) (*clientConn, error) {
	dctx, cancel := context.WithTimeout(ctx, dialTimeout)
	defer cancel()
	var d net.Dialer
	conn, err := d.DialContext(dctx, "tcp", addr)
	switch {
	case err == nil:
	case ctx.Err() != nil:
		return nil, status.FromContextError(ctx.Err()).Err()
	case dctx.Err() != nil:
		return nil, fmt.Errorf("%w: dial %s: %v", errSilent, addr, err)
	default:
		return nil, status.Errorf(codes.Unavailable, "framed: dial %s: %v", addr, err)
	}
	if tc, ok := conn.(*net.TCPConn); ok {
		_ = tc.SetNoDelay(true)
	}
	deadline, _ := dctx.Deadline()
	_ = conn.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Now()) })
	if creds.TLS != nil {
		tc := tls.Client(conn, clientTLS(creds.TLS, addr))
		if err := tc.Handshake(); err != nil {
			stop()
			_ = conn.Close()
			var ne net.Error
			switch {
			case ctx.Err() != nil:
				return nil, status.FromContextError(context.Cause(ctx)).Err()
			case errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
				return nil, status.Errorf(codes.Unavailable, "framed: TLS with %s: %v", addr, err)
			}
			// A certificate refused, by either end: trying again will not
			// help (and a gRPC call would meet the same certificate).
			return nil, status.Errorf(codes.Unauthenticated, "TLS with %s: %v", addr, err)
		}
		conn = tc
	}
	head := make([]byte, len(preface))
	_, err = io.WriteString(conn, preface)
	if err == nil || creds.TLS != nil {
		// Under TLS 1.3 a server refuses a client's certificate after the
		// client's handshake ended: its alert is there to read even when
		// the write already failed.
		_, rerr := io.ReadFull(conn, head)
		var op *net.OpError
		if errors.As(rerr, &op) && op.Op == "remote error" { // crypto/tls's word for an alert
			stop()
			_ = conn.Close()
			return nil, status.Errorf(codes.Unauthenticated, "TLS with %s: the server refused this client's certificate: %v", addr, rerr)
		}
		err = cmp.Or(err, rerr)
	}
	if err == nil && string(head) == preface && len(creds.Metadata) > 0 {
		_, err = conn.Write(finish(appendPairs(appendRequestHead(nil, 0, 0, helloMethod), creds.Metadata)))
	}
	stopped := stop() // false: ctx ended, and may have cut the exchange
	if string(head) == needTLS && stopped {
		_ = conn.Close()
		return nil, status.Errorf(codes.Unauthenticated, "%s serves TLS only: give the CA that signed its certificate (--tls-ca)", addr)
	}
	if err != nil || string(head) != preface || !stopped {
		_ = conn.Close()
		switch {
		case ctx.Err() != nil || !stopped:
			return nil, status.FromContextError(context.Cause(ctx)).Err()
		case errors.Is(err, os.ErrDeadlineExceeded):
			return nil, fmt.Errorf("%w: %s: %v", errSilent, addr, err)
		}
		return nil, fmt.Errorf("%w: %s: %v", errUnframed, addr, err)
	}
	_ = conn.SetDeadline(time.Time{})
	cc := &clientConn{conn: conn, addr: addr, wlock: make(chan struct{}, 1), closed: make(chan struct{})}
	cc.mu.pending = map[uint64]chan answer{}
	cc.mu.used = time.Now()
	cc.wg.Add(1)
	go cc.read()
	return cc, nil
}

// clientTLS is cfg for a dial of addr: the server name is addr's host
// unless cfg names one.
func clientTLS(cfg *tls.Config, addr string) *tls.Config {
	if cfg.ServerName != "" {
		return cfg
	}
	cfg = cfg.Clone()
	cfg.ServerName = addr
	if host, _, err := net.SplitHostPort(addr); err == nil {
		cfg.ServerName = host
	}
	return cfg
}

func (cc *clientConn) live() bool {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	return cc.mu.err == nil
}

// clientIdle is how long a client keeps a connection without calls: less
// than the server's IdleTimeout, so that a call never meets the server's
// close of an idle connection (it would fail Unavailable, and leaderconn
// would back off before it tried again).
const clientIdle = IdleTimeout - time.Minute

// usable says whether a call may take the connection at now, and counts
// it as used. One idle for clientIdle is closed instead.
func (cc *clientConn) usable(now time.Time) bool {
	cc.mu.Lock()
	idle := cc.mu.err == nil && len(cc.mu.pending) == 0 && now.Sub(cc.mu.used) >= clientIdle
	if !idle {
		cc.mu.used = now
	}
	live := cc.mu.err == nil
	cc.mu.Unlock()
	if idle {
		cc.close(errIdleClosed)
		return false
	}
	return live
}

// errIdleClosed ends a connection the client left idle.
var errIdleClosed = errors.New("closed after idling")

// call sends one request and waits for its answer or ctx.
func (cc *clientConn) call(ctx context.Context, method string, args any) (answer, error) {
	m, ok := args.(proto.Message)
	if !ok {
		return answer{}, status.Errorf(codes.Internal, "framed: request %T is not a proto message", args)
	}
	switch {
	case method == "": // on the wire, a cancel
		return answer{}, status.Error(codes.Unimplemented, "framed: malformed method name \"\"")
	case len(method) > maxMethod:
		return answer{}, status.Errorf(codes.Internal, "framed: method name of %d bytes", len(method))
	}
	var timeout time.Duration
	if d, ok := ctx.Deadline(); ok {
		if timeout = time.Until(d); timeout <= 0 {
			return answer{}, status.Error(codes.DeadlineExceeded, context.DeadlineExceeded.Error())
		}
	}
	size := proto.Size(m)
	if size > MaxMessage {
		return answer{}, status.Errorf(codes.ResourceExhausted, "framed: request of %d bytes, more than %d", size, MaxMessage)
	}
	ch := make(chan answer, 1)
	cc.mu.Lock()
	if err := cc.mu.err; err != nil {
		cc.mu.Unlock()
		return answer{}, unsent{cc.lost(err)}
	}
	cc.mu.next++
	id := cc.mu.next
	cc.mu.pending[id] = ch
	cc.mu.Unlock()
	b := appendRequestHead(cc.bufs.get(32 + len(method) + size)[:0], id, timeout, method)
	b, err := proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(b, m)
	if err != nil {
		cc.bufs.put(b)
		cc.forget(id)
		return answer{}, status.Errorf(codes.Internal, "framed: marshal the request of %s: %v", method, err)
	}
	switch written, err := cc.write(ctx, finish(b)); {
	case !written:
		cc.forget(id)
		return answer{}, status.FromContextError(context.Cause(ctx)).Err()
	case errors.Is(err, errCut):
		cc.giveUp(ctx, id)
		return answer{}, status.FromContextError(context.Cause(ctx)).Err()
	case err != nil:
		cc.close(err)
		return answer{}, cc.lost(err)
	}
	select {
	case a := <-ch:
		if a.lost != nil {
			return answer{}, cc.lost(a.lost)
		}
		return a, nil
	case <-ctx.Done():
		cc.giveUp(ctx, id)
		return answer{}, status.FromContextError(context.Cause(ctx)).Err()
	}
}

// giveUp forgets call id, whose ctx ended, and if it was cancelled rather
// than timed out tells the server (which times it out by itself).
func (cc *clientConn) giveUp(ctx context.Context, id uint64) {
	if cc.forget(id) && !errors.Is(ctx.Err(), context.DeadlineExceeded) {
		cc.cancel(id)
	}
}

// unsent is the error of a call whose request never left this client, so
// it cannot have taken effect: a caller may retry even a call that must
// not take effect twice.
type unsent struct{ error }

func (u unsent) GRPCStatus() *status.Status { return status.Convert(u.error) }
func (u unsent) Unwrap() error              { return u.error }

// NotSent reports whether err is that of a call whose request was never
// sent.
func NotSent(err error) bool {
	var u unsent
	return errors.As(err, &u)
}

// lost is the error of a call whose connection ended for why.
func (cc *clientConn) lost(why error) error {
	if errors.Is(why, errClosed) {
		return status.Error(codes.Canceled, "framed: client is closed")
	}
	return status.Errorf(codes.Unavailable, "framed: connection to %s lost: %v", cc.addr, why)
}

// cancel tells the server to cancel call id (a request frame without a
// method), so its handler ends as under gRPC. It never blocks: when
// another frame is being written it goes after it.
func (cc *clientConn) cancel(id uint64) {
	b := finish(appendRequestHead(nil, id, 0, ""))
	select {
	case cc.wlock <- struct{}{}:
		if err := cc.writeLocked(nil, b); err != nil {
			cc.close(err)
		}
		return
	default:
	}
	cc.wg.Add(1)
	go func() {
		defer cc.wg.Done()
		if _, err := cc.write(nil, b); err != nil {
			cc.close(err)
		}
	}()
}

// forget drops call id's place; false if it was no longer waiting.
func (cc *clientConn) forget(id uint64) bool {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	_, ok := cc.mu.pending[id]
	delete(cc.mu.pending, id)
	return ok
}

// write writes the frame b, which it owns, once it has the connection,
// unless ctx (nil: none) ends first (written false). A frame begun is
// finished, or the connection breaks for every call: so if ctx ends
// mid-frame, a goroutine of the connection writes the rest, holding it
// till then, and write returns errCut.
func (cc *clientConn) write(ctx context.Context, b []byte) (written bool, err error) {
	var done <-chan struct{} = cc.closed
	if ctx != nil {
		done = ctx.Done()
	}
	select {
	case cc.wlock <- struct{}{}:
	case <-done:
		cc.bufs.put(b)
		return false, nil
	}
	return true, cc.writeLocked(ctx, b)
}

// errCut is a frame whose writer gave up; the rest of it is on its way.
var errCut = errors.New("framed: the frame's call ended while it was written")

// writeLocked writes b holding wlock, and releases it once b is written.
func (cc *clientConn) writeLocked(ctx context.Context, b []byte) error {
	_ = cc.conn.SetWriteDeadline(bodyDeadline(len(b)))
	var mu sync.Mutex
	returned, cut := false, false
	stop := func() bool { return true }
	if ctx != nil {
		stop = context.AfterFunc(ctx, func() {
			mu.Lock()
			defer mu.Unlock()
			if !returned {
				cut = true
				_ = cc.conn.SetWriteDeadline(time.Now())
			}
		})
	}
	n, err := cc.conn.Write(b)
	mu.Lock()
	returned = true
	mu.Unlock()
	stop()
	if err == nil || !cut || !errors.Is(err, os.ErrDeadlineExceeded) {
		<-cc.wlock
		cc.bufs.put(b)
		return err
	}
	cc.wg.Add(1)
	go func() {
		defer cc.wg.Done()
		_ = cc.conn.SetWriteDeadline(bodyDeadline(len(b) - n))
		_, err := cc.conn.Write(b[n:])
		<-cc.wlock
		cc.bufs.put(b)
		if err != nil {
			cc.close(err)
		}
	}()
	return errCut
}

// read hands answers to their calls until the connection fails.
func (cc *clientConn) read() {
	defer cc.wg.Done()
	fr := newFrameReader(cc.conn, &cc.bufs)
	for {
		// The idle bound is the server's to keep: calls wait here for
		// as long as their contexts allow.
		body, err := fr.next(24 * time.Hour)
		if err == nil {
			var a answer
			if a, err = parseAnswer(body); err == nil {
				a.body = body
				cc.mu.Lock()
				ch := cc.mu.pending[a.id]
				delete(cc.mu.pending, a.id)
				cc.mu.Unlock()
				if ch != nil {
					ch <- a
				} else {
					cc.bufs.put(body) // its call gave up
				}
				continue
			}
			cc.bufs.put(body)
		}
		cc.close(err)
		return
	}
}

// close ends the connection for why, failing the calls waiting on it.
func (cc *clientConn) close(why error) {
	cc.mu.Lock()
	if cc.mu.err != nil {
		cc.mu.Unlock()
		return
	}
	cc.mu.err = why
	pending := cc.mu.pending
	cc.mu.pending = nil
	cc.mu.Unlock()
	close(cc.closed)
	_ = cc.conn.Close()
	for _, ch := range pending {
		ch <- answer{lost: why}
	}
}
