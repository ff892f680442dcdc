package framed

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

const (
	// maxInFlight bounds the calls one connection runs at once; past it
	// the connection's reader waits, and so does its peer's socket.
	maxInFlight = 256
	// maxConns bounds the framed connections of a server, and apart the
	// connections Split has not yet told apart.
	maxConns = 4096
	// prefaceTimeout bounds the wait for a new connection's preface.
	prefaceTimeout = 10 * time.Second
)

// Server answers the unary methods of the services registered with it,
// through the interceptor given to NewServer. It is a grpc.ServiceRegistrar,
// so a service's generated Register function registers with it.
type Server struct {
	tls       *tls.Config // nil: plaintext
	tlsFailed func(from net.Addr, err error)
	intercept grpc.UnaryServerInterceptor
	log       *slog.Logger
	methods   map[string]method // by full name
	bufs      bufPool
	idle      time.Duration  // IdleTimeout; shorter in tests
	wg        sync.WaitGroup // readers, handlers, Split's loops
	mu        struct {
		sync.Mutex
		conns    map[*serverConn]struct{}
		sniffing map[net.Conn]struct{} // accepted, preface not yet read
		lns      []net.Listener
		stopped  bool
	}
}

type method struct {
	impl    any
	handler grpc.MethodHandler
}

// NewServer returns a server whose calls go through intercept (nil: none).
func NewServer(intercept grpc.UnaryServerInterceptor, log *slog.Logger) *Server {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{intercept: intercept, log: log, methods: map[string]method{}, idle: IdleTimeout}
	s.mu.conns = map[*serverConn]struct{}{}
	s.mu.sniffing = map[net.Conn]struct{}{}
	return s
}

// RequireTLS makes every connection Split accepts open with a TLS
// handshake under cfg, within the preface's deadline; call it before
// Split. A framed client that speaks plaintext is told so (see
// needTLS); anything else without TLS is closed. failed, if not nil,
// hears of each connection refused so (to count and log). The gRPC
// server then needs TLSCredentials.
func (s *Server) RequireTLS(cfg *tls.Config, failed func(from net.Addr, err error)) {
	s.tls, s.tlsFailed = cfg, failed
}

// RegisterService registers desc's unary methods (its streams are gRPC's
// alone). Call it before serving.
func (s *Server) RegisterService(desc *grpc.ServiceDesc, impl any) {
	for _, m := range desc.Methods {
		s.methods["/"+desc.ServiceName+"/"+m.MethodName] = method{impl: impl, handler: m.Handler}
	}
}

var _ grpc.ServiceRegistrar = (*Server)(nil)

// Split serves the framed connections that arrive on ln and returns a
// listener of the others, for a grpc.Server. Closing it (grpc.Server's
// Stop does) closes ln; so does Stop. A connection whose first bytes are
// neither preface is closed.
func (s *Server) Split(ln net.Listener) net.Listener {
	l := &splitListener{ln: ln, conns: make(chan net.Conn), done: make(chan struct{})}
	s.mu.Lock()
	stopped := s.mu.stopped
	if !stopped {
		s.mu.lns = append(s.mu.lns, l)
		s.wg.Add(1)
	}
	s.mu.Unlock()
	if stopped {
		_ = l.Close()
		return l
	}
	go func() {
		defer s.wg.Done()
		s.accept(l)
	}()
	return l
}

// accept hands each connection of l.ln to sniff until l.ln fails for
// good. Errors such as running out of file descriptors pass, after a
// backoff as gRPC's own accept loop takes.
func (s *Server) accept(l *splitListener) {
	backoff := 5 * time.Millisecond
	for {
		conn, err := l.ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.Is(err, net.ErrClosed) || !errors.As(err, &ne) || !ne.Timeout() && !isTemporary(err) {
				l.fail(err)
				return
			}
			s.log.Warn("framed: accept failed, retrying", "err", err, "after", backoff)
			select {
			case <-time.After(backoff):
			case <-l.done:
				return
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		if !s.startSniff(conn) {
			s.log.Warn("framed: too many connections not yet identified, closing one", "from", conn.RemoteAddr(), "limit", maxConns)
			_ = conn.Close()
			continue
		}
		go func() {
			defer s.wg.Done()
			s.sniff(l, conn)
		}()
	}
}

// isTemporary is net.Error's deprecated Temporary, which accept errors
// such as EMFILE still answer.
func isTemporary(err error) bool {
	t, ok := err.(interface{ Temporary() bool })
	return ok && t.Temporary()
}

func (s *Server) startSniff(conn net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mu.stopped || len(s.mu.sniffing) >= maxConns {
		return false
	}
	s.mu.sniffing[conn] = struct{}{}
	s.wg.Add(1)
	return true
}

// sniff reads conn's preface and hands it to gRPC or serves it.
func (s *Server) sniff(l *splitListener, conn net.Conn) {
	head := make([]byte, len(preface))
	_ = conn.SetReadDeadline(time.Now().Add(prefaceTimeout))
	var err error
	raw := conn
	if s.tls != nil {
		conn, err = s.startTLS(conn)
	}
	if err == nil {
		_, err = io.ReadFull(conn, head)
	}
	if s.tlsFailed != nil && err != nil && !errors.Is(err, io.EOF) && (conn == raw || !conn.(*tls.Conn).ConnectionState().HandshakeComplete) {
		s.tlsFailed(raw.RemoteAddr(), err)
	}
	if tc, ok := conn.(*tls.Conn); ok && err != nil && !tc.ConnectionState().HandshakeComplete {
		// The handshake failed and its alert is on the way. Under TLS 1.3
		// the client writes its preface before it learns that; closing
		// with that preface unread would reset the connection and lose
		// the alert, so read it away first, briefly.
		_ = raw.SetReadDeadline(time.Now().Add(time.Second))
		_, _ = io.Copy(io.Discard, io.LimitReader(raw, 64<<10))
	}
	_ = conn.SetReadDeadline(time.Time{})
	s.mu.Lock()
	delete(s.mu.sniffing, raw)
	s.mu.Unlock()
	switch {
	case err != nil:
		_ = conn.Close()
	case string(head) == preface:
		s.serve(conn)
	case string(head) == http2Preface:
		select {
		case l.conns <- &prefixConn{Conn: conn, prefix: head}:
		case <-l.done:
			_ = conn.Close()
		}
	default:
		s.log.Debug("framed: connection opened with neither preface, closing it", "from", conn.RemoteAddr())
		_ = conn.Close()
	}
}

// startTLS wraps conn in TLS if its first byte opens a TLS handshake. A
// framed client speaking plaintext is answered needTLS; any other
// plaintext fails. The handshake runs on the caller's first read.
func (s *Server) startTLS(conn net.Conn) (net.Conn, error) {
	first := make([]byte, 1)
	if _, err := io.ReadFull(conn, first); err != nil {
		return conn, err
	}
	const handshakeRecord = 0x16
	if first[0] == handshakeRecord {
		return tls.Server(&prefixConn{Conn: conn, prefix: first}, s.tls), nil
	}
	head := make([]byte, len(preface))
	head[0] = first[0]
	if _, err := io.ReadFull(conn, head[1:]); err == nil && string(head) == preface {
		_ = conn.SetWriteDeadline(time.Now().Add(prefaceTimeout))
		_, _ = io.WriteString(conn, needTLS)
	}
	s.log.Debug("framed: a plaintext connection to a TLS port, closing it", "from", conn.RemoteAddr())
	return conn, errors.New("framed: plaintext on a TLS port")
}

// http2Preface opens every gRPC connection.
const http2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

// serverConn is one framed connection being served.
type serverConn struct {
	conn   net.Conn
	peer   *peer.Peer
	md     metadata.MD     // the hello's; set before the first call, then read-only
	ctx    context.Context // ends when the connection closes
	cancel context.CancelFunc
	wmu    sync.Mutex // one answer written at a time
	mu     struct {
		sync.Mutex
		calls map[uint64]context.CancelFunc // running, by id: a cancel frame ends one
	}
}

// serve answers conn's calls until it closes or the server stops.
func (s *Server) serve(conn net.Conn) {
	c := &serverConn{conn: conn, peer: &peer.Peer{Addr: conn.RemoteAddr(), LocalAddr: conn.LocalAddr()}}
	if info, ok := tlsInfo(conn); ok {
		c.peer.AuthInfo = info
	}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	c.mu.calls = map[uint64]context.CancelFunc{}
	defer c.cancel()
	defer conn.Close()
	s.mu.Lock()
	if s.mu.stopped || len(s.mu.conns) >= maxConns {
		s.mu.Unlock()
		s.log.Warn("framed: connection refused", "from", conn.RemoteAddr(), "limit", maxConns)
		return
	}
	s.mu.conns[c] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.mu.conns, c)
		s.mu.Unlock()
	}()
	_ = conn.SetWriteDeadline(time.Now().Add(prefaceTimeout))
	if _, err := io.WriteString(conn, preface); err != nil {
		return
	}
	fr := newFrameReader(conn, &s.bufs)
	slots := make(chan struct{}, maxInFlight)
	calls := 0 // frames before the hello's
	for {
		body, err := fr.next(s.idle)
		if errors.Is(err, errIdle) && len(slots) > 0 {
			continue // idle only between requests, not while calls run
		}
		if err != nil {
			if errors.Is(err, errFrame) {
				s.log.Warn("framed: closing a connection", "from", conn.RemoteAddr(), "err", err)
			}
			return
		}
		req, err := parseRequest(body)
		if err != nil {
			s.bufs.put(body)
			s.log.Warn("framed: closing a connection", "from", conn.RemoteAddr(), "err", err)
			return
		}
		if req.method == helloMethod {
			err := c.hello(req.message, calls)
			s.bufs.put(body)
			if err != nil {
				s.log.Warn("framed: closing a connection", "from", conn.RemoteAddr(), "err", err)
				return
			}
			continue
		}
		calls++
		if req.method == "" { // a cancel frame
			s.bufs.put(body)
			c.mu.Lock()
			cancel := c.mu.calls[req.id]
			c.mu.Unlock()
			if cancel != nil {
				cancel()
			}
			continue
		}
		select {
		case slots <- struct{}{}:
		case <-c.ctx.Done():
			return
		}
		ctx, cancel := context.WithCancel(c.ctx)
		if req.timeout > 0 {
			ctx, cancel = context.WithTimeout(c.ctx, req.timeout)
		}
		c.mu.Lock()
		c.mu.calls[req.id] = cancel
		c.mu.Unlock()
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer func() { <-slots }()
			s.handle(ctx, c, req)
			s.bufs.put(body) // the handler decoded a copy of the message
			c.mu.Lock()
			delete(c.mu.calls, req.id)
			c.mu.Unlock()
			cancel()
		}()
	}
}

// hello keeps the metadata of a hello, which must come first and once.
func (c *serverConn) hello(msg []byte, before int) error {
	if before > 0 || c.md != nil {
		return fmt.Errorf("%w: a hello after other frames", errFrame)
	}
	if len(msg) < 4 || len(msg) > maxHello || int(binary.BigEndian.Uint32(msg)) != len(msg)-4 {
		return fmt.Errorf("%w: a hello of %d bytes", errFrame, len(msg))
	}
	md, err := parsePairs(msg[4:])
	if err != nil {
		return fmt.Errorf("%w: hello: %v", errFrame, err)
	}
	if md == nil {
		md = metadata.MD{}
	}
	c.md = md
	return nil
}

// handle runs one call and writes its answer.
func (s *Server) handle(ctx context.Context, c *serverConn, req request) {
	st := &stream{method: req.method}
	ctx = grpc.NewContextWithServerTransportStream(peer.NewContext(ctx, c.peer), st)
	if c.md != nil {
		ctx = metadata.NewIncomingContext(ctx, c.md)
	}
	var reply any
	var err error
	if m, ok := s.methods[req.method]; ok {
		dec := func(v any) error {
			if err := proto.Unmarshal(req.message, v.(proto.Message)); err != nil {
				return status.Errorf(codes.Internal, "framed: error unmarshalling request: %v", err)
			}
			return nil
		}
		reply, err = m.handler(m.impl, ctx, dec, s.intercept)
	} else {
		err = status.Errorf(codes.Unimplemented, "unknown method %s", req.method)
	}
	trailer := st.trailer()
	var b []byte
	if err == nil {
		if err = checkTrailer(trailer); err == nil {
			b, err = s.marshalAnswer(req.id, trailer, reply)
		}
	}
	if err != nil {
		// As gRPC's server: a handler's bare context error keeps its code.
		sts, ok := status.FromError(err)
		if !ok {
			sts = status.FromContextError(err)
		}
		if p := sts.Proto(); len(p.Details) > 0 {
			// Where gRPC carries them too.
			d, merr := proto.Marshal(p)
			if merr == nil {
				trailer = metadata.Join(trailer, metadata.Pairs(detailsKey, string(d)))
			}
		}
		if terr := checkTrailer(trailer); terr != nil {
			sts, trailer = status.Convert(terr), nil
		}
		b = finish(appendAnswerHead(nil, req.id, sts.Code(), sts.Message(), trailer))
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	_ = c.conn.SetWriteDeadline(bodyDeadline(len(b)))
	if _, err := c.conn.Write(b); err != nil {
		c.cancel()
		_ = c.conn.Close() // its reader ends
	}
	s.bufs.put(b)
}

// detailsKey is the trailer that carries a status's details, encoded as
// gRPC encodes them.
const detailsKey = "grpc-status-details-bin"

// checkTrailer refuses a trailer the wire cannot carry.
func checkTrailer(md metadata.MD) error {
	n := 0
	for k, vs := range md {
		if len(k) > 1<<16-1 {
			return status.Errorf(codes.Internal, "framed: trailer key of %d bytes", len(k))
		}
		for _, v := range vs {
			n += 6 + len(k) + len(v)
		}
	}
	if n > maxTrailer {
		return status.Errorf(codes.ResourceExhausted, "framed: trailer of %d bytes, more than %d", n, maxTrailer)
	}
	return nil
}

func (s *Server) marshalAnswer(id uint64, trailer metadata.MD, reply any) ([]byte, error) {
	m, ok := reply.(proto.Message)
	if !ok {
		return nil, status.Errorf(codes.Internal, "framed: reply %T is not a proto message", reply)
	}
	size := proto.Size(m)
	if size > MaxMessage {
		return nil, status.Errorf(codes.ResourceExhausted, "framed: reply of %d bytes, more than %d", size, MaxMessage)
	}
	b := appendAnswerHead(s.bufs.get(64 + size)[:0], id, codes.OK, "", trailer)
	b, err := proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(b, m)
	if err != nil {
		s.bufs.put(b)
		return nil, status.Errorf(codes.Internal, "framed: marshal reply: %v", err)
	}
	return finish(b), nil
}

// Stop closes the listeners and connections and waits for the calls in
// flight to return (their contexts are cancelled).
func (s *Server) Stop() {
	s.mu.Lock()
	s.mu.stopped = true
	lns := s.mu.lns
	var conns []*serverConn
	for c := range s.mu.conns {
		conns = append(conns, c)
	}
	for c := range s.mu.sniffing {
		_ = c.Close() // its sniff ends
	}
	s.mu.Unlock()
	for _, l := range lns {
		_ = l.Close()
	}
	for _, c := range conns {
		c.cancel()
		_ = c.conn.Close()
	}
	s.wg.Wait()
}

// stream is what grpc.SetTrailer and grpc.SetHeader see of a framed call.
// Headers are accepted and dropped: no master method sends any.
type stream struct {
	method string
	mu     sync.Mutex
	md     metadata.MD
}

func (t *stream) Method() string               { return t.method }
func (t *stream) SetHeader(metadata.MD) error  { return nil }
func (t *stream) SendHeader(metadata.MD) error { return nil }
func (t *stream) SetTrailer(md metadata.MD) error {
	t.mu.Lock()
	t.md = metadata.Join(t.md, md)
	t.mu.Unlock()
	return nil
}

func (t *stream) trailer() metadata.MD {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.md
}

// splitListener is the listener Split returns: the connections that
// opened with HTTP/2's preface.
type splitListener struct {
	ln    net.Listener
	conns chan net.Conn
	once  sync.Once
	done  chan struct{}
	err   error // why Accept fails, once done is closed
}

func (l *splitListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, l.err
	}
}

func (l *splitListener) fail(err error) {
	l.once.Do(func() {
		l.err = err
		close(l.done)
	})
	_ = l.ln.Close()
}

func (l *splitListener) Close() error {
	l.fail(fmt.Errorf("framed: %w", net.ErrClosed))
	return nil
}

func (l *splitListener) Addr() net.Addr { return l.ln.Addr() }

// prefixConn replays the preface Split read before its reads.
type prefixConn struct {
	net.Conn
	prefix []byte
}

func (c *prefixConn) Read(p []byte) (int, error) {
	if len(c.prefix) > 0 {
		n := copy(p, c.prefix)
		c.prefix = c.prefix[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}

// ConnectionState is the TLS state of a connection that Split read
// through a TLS listener (see TLSCredentials).
func (c *prefixConn) ConnectionState() (tls.ConnectionState, bool) {
	return connState(c.Conn)
}

func connState(conn net.Conn) (tls.ConnectionState, bool) {
	switch c := conn.(type) {
	case *tls.Conn:
		return c.ConnectionState(), true
	case *prefixConn:
		return c.ConnectionState()
	}
	return tls.ConnectionState{}, false
}

// tlsInfo is gRPC's account of a TLS connection, for peer.AuthInfo.
func tlsInfo(conn net.Conn) (credentials.TLSInfo, bool) {
	cs, ok := connState(conn)
	if !ok {
		return credentials.TLSInfo{}, false
	}
	return credentials.TLSInfo{State: cs, CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.PrivacyAndIntegrity}}, true
}

// TLSCredentials are a gRPC server's transport credentials when the
// listener given to Split terminates TLS (tls.NewListener): the
// handshake is done by the time gRPC sees a connection, so they only
// report its state, and an interceptor can name the peer by its
// certificate as with grpc's own TLS credentials. A connection that did
// not come through TLS is refused.
func TLSCredentials() credentials.TransportCredentials { return terminated{} }

type terminated struct{}

func (terminated) ClientHandshake(context.Context, string, net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("framed: TLSCredentials are a server's")
}

func (terminated) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	info, ok := tlsInfo(conn)
	if !ok {
		return nil, nil, errors.New("framed: a connection without TLS on a TLS listener")
	}
	return conn, info, nil
}

func (terminated) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "tls"}
}
func (t terminated) Clone() credentials.TransportCredentials { return t }
func (terminated) OverrideServerName(string) error           { return nil }
