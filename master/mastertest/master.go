package mastertest

import (
	"log/slog"
	"net"
	"os"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/tidepool-kv/tidepool/master"
)

// The master's timeouts unless Start's cfg changes them.
const (
	SweepInterval = 50 * time.Millisecond
	NodeTTL       = time.Second
	PutTimeout    = 3 * time.Second
)

// Master is one master in this process on loopback: real raft on an
// in-memory transport, real gRPC. Its methods must be called from the
// test's goroutine.
type Master struct {
	t        testing.TB
	cfg      func(*master.Config)
	base     string // holds every Dir; removed after the last Stop
	dir      string
	raftAddr raft.ServerAddress
	addr     string // a restarted master listens here again
	srv      *master.Server
	served   chan error
}

// Start starts a master with ID "m0" on a fresh Dir and a free loopback
// port; cfg, if not nil, adjusts its Config before each start. The master
// stops when the test ends.
func Start(t testing.TB, cfg func(*master.Config)) *Master {
	t.Helper()
	m := &Master{t: t, cfg: cfg, base: t.TempDir()}
	t.Cleanup(m.Stop)
	m.dir = m.newDir()
	m.start()
	return m
}

// newDir makes an empty Dir under base, so that the test removes it only
// after the master that uses it has stopped.
func (m *Master) newDir() string {
	m.t.Helper()
	dir, err := os.MkdirTemp(m.base, "master")
	if err != nil {
		m.t.Fatal(err)
	}
	return dir
}

// Addr is the master's gRPC address; it stays the same across restarts.
func (m *Master) Addr() string { return m.addr }

// Server is the running server, nil while the master is stopped.
func (m *Master) Server() *master.Server { return m.srv }

func (m *Master) start() {
	m.t.Helper()
	listen := m.addr
	if listen == "" {
		listen = "127.0.0.1:0"
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		m.t.Fatalf("master listen: %v", err)
	}
	m.addr = ln.Addr().String()
	addr, trans := raft.NewInmemTransport(m.raftAddr)
	m.raftAddr = addr
	cfg := master.Config{
		ID: "m0", Dir: m.dir, Advertise: m.addr, Transport: trans,
		SweepInterval: SweepInterval, NodeTTL: NodeTTL, PutTimeout: PutTimeout,
		Logger: Logger(),
	}
	if m.cfg != nil {
		m.cfg(&cfg)
	}
	srv, err := master.New(cfg)
	if err != nil {
		ln.Close()
		m.t.Fatalf("master: %v", err)
	}
	m.srv, m.served = srv, make(chan error, 1)
	go func() { m.served <- srv.Serve(ln) }()
}

// Stop closes the master and waits for it to stop serving. Stopping a
// stopped master does nothing. The cleanups stop the stores first; a
// store closed after its master has stopped waits out its Leave call.
func (m *Master) Stop() {
	if m.srv == nil {
		return
	}
	if err := m.srv.Close(); err != nil {
		m.t.Errorf("close master: %v", err)
	}
	if err := <-m.served; err != nil {
		m.t.Errorf("master Serve: %v", err)
	}
	m.srv = nil
}

// Restart stops the master and starts a new Server on the same Dir, gRPC
// and raft addresses: it replays its state.
func (m *Master) Restart() {
	m.t.Helper()
	m.Stop()
	m.start()
}

// RestartFresh stops the master and starts one with an empty Dir and a new
// raft address on the same gRPC address: a master that lost its state.
func (m *Master) RestartFresh() {
	m.t.Helper()
	m.Stop()
	m.dir, m.raftAddr = m.newDir(), ""
	m.start()
}

// Logger discards logs unless TIDEPOOL_TEST_LOG is set. It writes to
// stderr, not t.Log, so a late line from a background goroutine is
// harmless.
func Logger() *slog.Logger {
	if os.Getenv("TIDEPOOL_TEST_LOG") == "" {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
}
