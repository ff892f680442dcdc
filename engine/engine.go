package engine

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Config configures an Engine. The zero value is usable.
type Config struct {
	ConnsPerPeer int                   // pooled TCP connections per peer endpoint; default 4
	MaxInflight  int                   // concurrent tasks per engine; default 1024 (slices, not tasks, hold rail slots, so this only bounds memory)
	Registerer   prometheus.Registerer // nil = no metrics
	Logger       *slog.Logger          // nil = discard
	DialTimeout  time.Duration         // default 5s

	// Transport replaces the built-in TCP transport (tests use it for fakes with fault injection).
	// The engine owns it: Close closes it. nil = TCP built from the fields above.
	Transport Transport

	// RoundRobin deals slices to rails in turn when they are cut, as
	// Mooncake's engine does, instead of spraying them by predicted finish
	// time when they are dispatched. It is the baseline for benchmarks.
	RoundRobin bool
	// RailBandwidth is every rail's nominal bandwidth in bytes per second,
	// the seed of its estimate; default 1.25e9 (10 Gbit/s).
	RailBandwidth float64
	// TenantInflight caps the bytes in flight per tenant and peer; 0: no cap.
	TenantInflight int64
	// MaxServerConns caps the connections peers hold to this engine's
	// listeners: at the cap the longest idle one is closed for a new one,
	// or the new one is refused if none is idle. Default 4096.
	MaxServerConns int
	// MaxConnsPerPeer caps, the same way, the connections one peer host
	// (one IP address) holds, so that one host cannot take them all.
	// Default 1024.
	MaxConnsPerPeer int
	// IdleTimeout closes a server connection that has waited this long
	// for its next request (clients redial). Default 2 minutes.
	IdleTimeout time.Duration
	// StallTimeout fails a request whose peer sends nothing for this long
	// once the request has started. Default 5 seconds.
	StallTimeout time.Duration
	// Guard, if set, decides which peer requests this engine's server carries out: the store's
	// ticket check. nil = every well-formed request (tests, benchmarks). Same-process and
	// same-host transfers (local, shm, file) do not pass through it.
	Guard Guard
	// NoShm turns off the same-host transports that reach a peer's segment through /proc: shm
	// (shared memory) and file (FileBacked segments). Ops to other engines then go over the rails.
	NoShm bool
	// NoShmWarm leaves the pages of a peer's memory that shm maps to be
	// touched by the copies that first use them. By default a goroutine
	// reads one word of each page the peer has committed once the segment
	// is mapped, so those
	// first touches are not on the path of a put or get (see warm in
	// shm.go): on a VM whose host shadows page tables, 4 us a page.
	NoShmWarm bool
	// TLS, if set, is the server side of this engine's listeners: every
	// peer connection opens with a TLS handshake (within 10 s).
	TLS *tls.Config
	// AllowPlaintext, with TLS, also serves peers that open without a TLS
	// handshake: a request's authority is its ticket either way, and TLS
	// costs about half the bandwidth of a rail (docs/benchmarks.md).
	AllowPlaintext bool
	// PeerTLS, if set, is the client side of the TCP transport's dials:
	// peers must serve TLS with a certificate it accepts. Unlike TLS, it
	// does not apply to a Transport given in the config.
	PeerTLS *tls.Config
}

// Guard admits or refuses a peer's read or write before the server touches the segment.
type Guard interface {
	// Admit returns nil if the peer may move the n bytes at off of segment with ticket (the
	// request's, empty if it carried none), and the time by which the transfer must end (zero
	// for no limit beyond the server's own). A refusal should wrap ErrForbidden.
	Admit(kind OpKind, segment string, off, n uint64, ticket []byte) (until time.Time, err error)
}

const (
	defaultConnsPerPeer    = 4
	defaultMaxInflight     = 1024
	defaultDialTimeout     = 5 * time.Second
	defaultMaxServerConns  = 4096
	defaultMaxConnsPerPeer = 1024
	defaultIdleTimeout     = 2 * time.Minute
	defaultStallTimeout    = 5 * time.Second
)

func (c Config) withDefaults() Config {
	if c.ConnsPerPeer <= 0 {
		c.ConnsPerPeer = defaultConnsPerPeer
	}
	if c.MaxInflight <= 0 {
		c.MaxInflight = defaultMaxInflight
	}
	if c.DialTimeout <= 0 {
		c.DialTimeout = defaultDialTimeout
	}
	if c.MaxServerConns <= 0 {
		c.MaxServerConns = defaultMaxServerConns
	}
	if c.MaxConnsPerPeer <= 0 {
		c.MaxConnsPerPeer = defaultMaxConnsPerPeer
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = defaultIdleTimeout
	}
	if c.StallTimeout <= 0 {
		c.StallTimeout = defaultStallTimeout
	}
	if c.RailBandwidth <= 0 {
		c.RailBandwidth = 1.25e9
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// Engine moves bytes between local buffers and segments served by peer engines, and serves its
// own registered segments to peers. It is safe for concurrent use.
type Engine struct {
	cfg  Config
	log  *slog.Logger
	met  *metrics // nil without a Registerer
	tr   Transport
	segs segments

	// The transports tried before the rails, in order (see transfer); nil when off or with a
	// custom Transport.
	local *localTransport
	shm   *shmTransport
	file  *fileTransport
	near  []Transport // local, shm, file: those that are on

	slots chan struct{} // one per task in flight
	// scratch holds the staging buffers (scratchSize) for segments that are
	// not Mapped; at most maxScratch are ever made, so stalled peers cannot
	// make the server allocate without bound.
	scratch     chan *[]byte
	scratchMade atomic.Int32

	// ctx is canceled with cause ErrClosed by Close, which fails every task still in flight.
	ctx    context.Context
	cancel context.CancelCauseFunc
	// wg counts every goroutine the engine starts and every running Serve; Close waits for it.
	wg sync.WaitGroup

	peersMu sync.Mutex
	peers   map[peerKey]*peer

	mu struct {
		sync.Mutex
		closed    bool
		listeners map[net.Listener]struct{}
		conns     map[net.Conn]*connIdle
		perPeer   map[string]int // connections by peer host
	}
}

// connIdle is a server connection's state for the cap: when it began to
// wait for its next request (unix nanos), 0 while it serves one, or
// connGone once the cap closed it.
type connIdle struct {
	since atomic.Int64
	peer  string // its host
}

const connGone = -1

// scratchSize is the staging buffer for segments without Mapped: payloads move through it in
// pieces, so a large request never needs a buffer of its own size. maxScratch bounds how many
// exist (16 MiB).
const (
	scratchSize = 1 << 20
	maxScratch  = 16
)

// New returns an engine. It starts no goroutines until Serve or Batch.Submit.
func New(cfg Config) *Engine {
	cfg = cfg.withDefaults()
	e := &Engine{
		cfg:   cfg,
		log:   cfg.Logger,
		met:   newMetrics(cfg.Registerer, cfg.Logger),
		tr:    cfg.Transport,
		slots: make(chan struct{}, cfg.MaxInflight),
	}
	if e.tr == nil {
		tcp := newTCPTransport(cfg.ConnsPerPeer, cfg.DialTimeout, cfg.PeerTLS)
		e.tr = tcp
		e.local = newLocalTransport(&e.segs)
		e.near = append(e.near, e.local)
		if !cfg.NoShm {
			desc := func(ctx context.Context, addr, segment string) (shmInfo, error) {
				// A peer that cannot answer a describe quickly is not worth
				// sharing memory with: remember it as unsupported and use tcp.
				ctx, cancel := context.WithTimeout(ctx, time.Second)
				defer cancel()
				info, err := tcp.describe(ctx, addr, segment)
				if err != nil && !errors.Is(err, ErrSegmentNotFound) && !errors.Is(err, ErrUnsupported) {
					err = fmt.Errorf("%w: describe: %w", ErrUnsupported, err)
				}
				return info, err
			}
			e.shm, e.file = newShmTransport(desc, !cfg.NoShmWarm), newFileTransport(desc)
			e.near = append(e.near, e.shm, e.file)
		}
	}
	e.peers = map[peerKey]*peer{}
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(railCollector{e}); err != nil {
			e.log.Warn("engine: rail metrics not registered", "err", err)
		}
	}
	e.scratch = make(chan *[]byte, maxScratch)
	e.ctx, e.cancel = context.WithCancelCause(context.Background())
	e.mu.listeners = make(map[net.Listener]struct{})
	e.mu.conns = make(map[net.Conn]*connIdle)
	e.mu.perPeer = make(map[string]int)
	return e
}

// Register serves seg to peers under seg.Name(). Names are 1..255 bytes; a duplicate name is an
// error wrapping ErrExists.
func (e *Engine) Register(seg Segment) error {
	return e.segs.add(seg)
}

// Unregister stops serving the named segment: later requests for it fail with
// ErrSegmentNotFound. Requests already being served finish.
func (e *Engine) Unregister(name string) {
	e.segs.remove(name)
}

// Serve accepts peer connections on ln until Close, then returns nil. Serve closes ln. It may be
// called for several listeners.
func (e *Engine) Serve(ln net.Listener) error {
	e.mu.Lock()
	if e.mu.closed {
		e.mu.Unlock()
		ln.Close()
		return ErrClosed
	}
	e.mu.listeners[ln] = struct{}{}
	e.publishAddrs()
	e.wg.Add(1)
	e.mu.Unlock()
	defer func() {
		e.mu.Lock()
		delete(e.mu.listeners, ln)
		e.publishAddrs()
		e.mu.Unlock()
		ln.Close()
		e.wg.Done()
	}()

	var backoff time.Duration
	for {
		nc, err := ln.Accept()
		if err != nil {
			if e.closed() {
				return nil
			}
			if errors.Is(err, net.ErrClosed) {
				return fmt.Errorf("engine: listener closed: %w", err)
			}
			// Like net/http: ride out transient errors (EMFILE, ECONNABORTED) instead of giving up.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			e.log.Warn("engine: accept failed; retrying", "err", err, "backoff", backoff)
			t := time.NewTimer(backoff)
			select {
			case <-t.C:
			case <-e.ctx.Done():
				t.Stop()
				return nil
			}
			continue
		}
		backoff = 0
		idle, err := e.trackConn(nc)
		if err != nil {
			nc.Close()
			if errors.Is(err, ErrClosed) {
				return nil
			}
			continue
		}
		go e.serveConn(nc, idle)
	}
}

// trackConn registers a server connection so Close can close it, within
// MaxConnsPerPeer and MaxServerConns: at a cap it closes the connection
// idle longest (of nc's peer host, for the first), and refuses nc if none
// is. It fails with ErrClosed once the engine is.
func (e *Engine) trackConn(nc net.Conn) (*connIdle, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.mu.closed {
		return nil, ErrClosed
	}
	peer := peerHost(nc.RemoteAddr())
	if n := e.mu.perPeer[peer]; n >= e.cfg.MaxConnsPerPeer && !e.closeIdlest(peer) {
		e.met.droppedConn("refused")
		return nil, fmt.Errorf("engine: peer %s holds %d server connections, none idle", peer, n)
	}
	if len(e.mu.conns) >= e.cfg.MaxServerConns && !e.closeIdlest("") {
		e.met.droppedConn("refused")
		return nil, fmt.Errorf("engine: %d server connections, none idle", len(e.mu.conns))
	}
	idle := &connIdle{peer: peer}
	e.mu.conns[nc] = idle
	e.mu.perPeer[peer]++
	e.wg.Add(1)
	return idle, nil
}

// closeIdlest closes the server connection idle longest, of peer's host
// if not empty, and reports whether there was one. e.mu is held; the scan
// is over at most MaxServerConns.
func (e *Engine) closeIdlest(peer string) bool {
	var oldest net.Conn
	var since int64
	for c, idle := range e.mu.conns {
		if s := idle.since.Load(); s > 0 && (peer == "" || idle.peer == peer) && (oldest == nil || s < since) {
			oldest, since = c, s
		}
	}
	// The connection may have started a request meanwhile: then it keeps
	// serving.
	if oldest == nil || !e.mu.conns[oldest].since.CompareAndSwap(since, connGone) {
		return false
	}
	e.forget(oldest)
	oldest.Close()
	e.met.droppedConn("evicted")
	return true
}

// forget drops a tracked connection from the counts. e.mu is held.
func (e *Engine) forget(nc net.Conn) {
	idle, ok := e.mu.conns[nc]
	if !ok {
		return
	}
	delete(e.mu.conns, nc)
	if e.mu.perPeer[idle.peer]--; e.mu.perPeer[idle.peer] <= 0 {
		delete(e.mu.perPeer, idle.peer)
	}
}

// peerHost is the host of a connection's remote address: its IP for TCP.
func peerHost(a net.Addr) string {
	if t, ok := a.(*net.TCPAddr); ok {
		return t.IP.String()
	}
	if a == nil {
		return "?"
	}
	return a.String()
}

// getScratch returns a staging buffer, waiting up to wait for one if
// maxScratch are in use; false if none came.
func (e *Engine) getScratch(wait time.Duration) (*[]byte, bool) {
	select {
	case b := <-e.scratch:
		return b, true
	default:
	}
	if e.scratchMade.Add(1) <= maxScratch {
		b := make([]byte, scratchSize)
		return &b, true
	}
	e.scratchMade.Add(-1)
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case b := <-e.scratch:
		return b, true
	case <-t.C:
	case <-e.ctx.Done():
	}
	return nil, false
}

func (e *Engine) putScratch(b *[]byte) { e.scratch <- b } // never blocks: at most maxScratch exist

func (e *Engine) untrackConn(nc net.Conn) {
	e.mu.Lock()
	e.forget(nc)
	e.mu.Unlock()
	nc.Close()
}

// start counts a goroutine the engine is about to start; false once closed. Adding to wg only
// under mu and only while open is what makes Close's wg.Wait race-free.
func (e *Engine) start() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.mu.closed {
		return false
	}
	e.wg.Add(1)
	return true
}

func (e *Engine) closed() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.mu.closed
}

// Close stops the accept loops, closes every connection, fails the tasks in flight with ErrClosed,
// closes the transport and waits for every goroutine the engine started. It is idempotent.
func (e *Engine) Close() error {
	e.mu.Lock()
	if e.mu.closed {
		e.mu.Unlock()
		e.wg.Wait()
		return nil
	}
	e.mu.closed = true
	var closers []interface{ Close() error }
	for ln := range e.mu.listeners {
		closers = append(closers, ln)
	}
	for nc := range e.mu.conns {
		closers = append(closers, nc)
	}
	e.mu.Unlock()

	e.cancel(ErrClosed)
	for _, c := range closers {
		c.Close()
	}
	err := e.tr.Close()
	for _, tr := range e.near {
		tr.Close()
	}
	e.wg.Wait()
	return err
}

// NewBatch returns an empty batch bound to this engine.
func (e *Engine) NewBatch() *Batch {
	return &Batch{e: e}
}

// acquire takes an in-flight slot, or fails when ctx is done first.
func (e *Engine) acquire(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	select {
	case e.slots <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (e *Engine) release() { <-e.slots }
