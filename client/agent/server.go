package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/auth"
	"github.com/tidepool-kv/tidepool/client"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

const (
	// DefaultSessionIdle is how long a session lasts without a request.
	DefaultSessionIdle = 10 * time.Minute
	// DefaultMaxSessionBytes is the largest region a session may open.
	DefaultMaxSessionBytes = 4 << 30
	// DefaultLeasedBlocks is how many leased blocks the agent keeps.
	DefaultLeasedBlocks = 1 << 16
	// DefaultMaxSessions is how many sessions may be open at once.
	DefaultMaxSessions = 256
	// DefaultMaxSessionsPerProcess is how many one process may hold.
	DefaultMaxSessionsPerProcess = 32
	// ownerCheck is how often the agent looks whether the processes that
	// hold sessions still run: a session ends within it of its process.
	ownerCheck = 250 * time.Millisecond
	// MaxBatchKeys is the most keys one request may name (the master's
	// limit for one batch).
	MaxBatchKeys = 16384
	// maxMessage bounds gRPC messages: MaxBatchKeys keys of the longest
	// length do not fit, but any chain of real block hashes does.
	maxMessage = 64 << 20
)

// Config configures a Server.
type Config struct {
	// Client reaches the cluster. The Server does not close it.
	Client *client.Client
	// Masters are the cluster's master addresses, told to each session so
	// that a process can ask them directly what moves no bytes.
	Masters []string
	// SessionIdle ends a session after this long without a request that
	// names it; 0 means DefaultSessionIdle.
	SessionIdle time.Duration
	// MaxSessionBytes is the largest region one session may ask for; 0
	// means DefaultMaxSessionBytes.
	MaxSessionBytes uint64
	// MaxSessions caps the sessions open at once; 0 means
	// DefaultMaxSessions.
	MaxSessions int
	// MaxSessionsPerProcess caps those one process holds (known by its
	// pid on the unix socket); 0 means DefaultMaxSessionsPerProcess.
	MaxSessionsPerProcess int
	// LeasedBlocks is how many blocks leased by lookups the agent keeps for
	// the gets that follow; 0 means DefaultLeasedBlocks, negative none.
	LeasedBlocks int
	// Token, if set, is the bearer token every caller must present (the
	// token the agent shows the masters, so only processes of its tenant
	// use it): a call without it is refused with Unauthenticated.
	Token  string
	Logger *slog.Logger
	// Registerer gets the tidepool_agent_* metrics; nil means none.
	Registerer prometheus.Registerer
}

// Server is the agent: it serves the Agent service for local processes.
type Server struct {
	cfg    Config
	c      *client.Client
	log    *slog.Logger
	grpc   *grpc.Server
	leases *leases // nil: gets do not use lookups' leases
	stats  counters
	met    prometheus.Collector // nil without a Registerer

	mu struct {
		sync.Mutex
		sessions map[uint64]*session
		closed   bool
	}

	stop      chan struct{} // closed by Close: the reaper returns
	wg        sync.WaitGroup
	closeOnce sync.Once
	closeErr  error
}

// New returns an agent of cfg.Client; Serve serves it.
func New(cfg Config) (*Server, error) {
	if cfg.Client == nil {
		return nil, errors.New("agent: no client")
	}
	if cfg.SessionIdle < 0 {
		return nil, fmt.Errorf("agent: negative session idle timeout %v", cfg.SessionIdle)
	}
	if cfg.SessionIdle == 0 {
		cfg.SessionIdle = DefaultSessionIdle
	}
	if cfg.MaxSessions <= 0 {
		cfg.MaxSessions = DefaultMaxSessions
	}
	if cfg.MaxSessionBytes == 0 {
		cfg.MaxSessionBytes = DefaultMaxSessionBytes
	}
	if cfg.MaxSessionBytes > 1<<50 { // more than any host maps; keeps int conversions safe
		return nil, fmt.Errorf("agent: max session bytes %d is implausible", cfg.MaxSessionBytes)
	}
	if cfg.MaxSessionsPerProcess == 0 {
		cfg.MaxSessionsPerProcess = DefaultMaxSessionsPerProcess
	}
	if cfg.MaxSessionsPerProcess < 0 {
		return nil, fmt.Errorf("agent: negative max sessions per process %d", cfg.MaxSessionsPerProcess)
	}
	if cfg.LeasedBlocks == 0 {
		cfg.LeasedBlocks = DefaultLeasedBlocks
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s := &Server{cfg: cfg, c: cfg.Client, log: cfg.Logger, stop: make(chan struct{})}
	s.mu.sessions = map[uint64]*session{}
	if cfg.LeasedBlocks > 0 {
		s.leases = newLeases(cfg.LeasedBlocks)
	}
	// WaitForHandlers: Close must not unmap a region or return while a
	// handler still runs.
	opts := []grpc.ServerOption{grpc.Creds(peerCreds{}), grpc.WaitForHandlers(true), grpc.MaxRecvMsgSize(maxMessage), grpc.MaxSendMsgSize(maxMessage)}
	if cfg.Token != "" {
		opts = append(opts, grpc.UnaryInterceptor(s.checkToken))
	}
	s.grpc = grpc.NewServer(opts...)
	pb.RegisterAgentServer(s.grpc, &service{s: s})
	if cfg.Registerer != nil {
		met := newCollector(s)
		if err := cfg.Registerer.Register(met); err != nil {
			s.log.Warn("agent metrics not registered", "err", err)
		} else {
			s.met = met
		}
	}
	s.wg.Add(1)
	go s.reap()
	return s, nil
}

// Serve answers the Agent service on ln until Close; it returns nil after
// Close.
func (s *Server) Serve(ln net.Listener) error {
	if err := s.grpc.Serve(ln); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("agent: serve: %w", err)
	}
	return nil
}

// Close stops serving (requests in flight are canceled and waited for),
// ends every session and stops the reaper. It is safe to call more than
// once.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		close(s.stop)
		s.grpc.Stop()
		s.wg.Wait()
		s.mu.Lock()
		s.mu.closed = true
		sessions := s.mu.sessions
		s.mu.sessions = map[uint64]*session{}
		s.mu.Unlock()
		var errs []error
		for _, ss := range sessions {
			errs = append(errs, ss.end())
		}
		if s.met != nil {
			s.cfg.Registerer.Unregister(s.met)
		}
		s.closeErr = errors.Join(errs...)
	})
	return s.closeErr
}

// reap ends sessions idle for longer than SessionIdle, until Close.
func (s *Server) reap() {
	defer s.wg.Done()
	every := min(max(s.cfg.SessionIdle/4, time.Millisecond), 10*time.Second)
	t := time.NewTicker(every)
	defer t.Stop()
	owners := time.NewTicker(ownerCheck)
	defer owners.Stop()
	for {
		select {
		case <-s.stop:
			return
		case now := <-t.C:
			s.reapIdle(now)
		case <-owners.C:
			s.reapOrphans()
		}
	}
}

// reapOrphans ends the sessions whose process has exited.
func (s *Server) reapOrphans() {
	s.mu.Lock()
	owners := map[process]bool{}
	for _, ss := range s.mu.sessions {
		if ss.owner.known() {
			owners[ss.owner] = true
		}
	}
	s.mu.Unlock()
	for p := range owners {
		owners[p] = p.alive() // outside the lock: a read of /proc each
	}
	s.endWhere(&s.stats.orphaned, "its process exited", func(ss *session) bool {
		alive, checked := owners[ss.owner]
		return checked && !alive
	})
}

func (s *Server) reapIdle(now time.Time) {
	s.endWhere(&s.stats.expired, "idle", func(ss *session) bool { return now.Sub(ss.lastUsed()) > s.cfg.SessionIdle })
}

// endWhere ends the sessions not in use that match, counting them.
func (s *Server) endWhere(count *atomic.Uint64, why string, match func(*session) bool) {
	var gone []*session
	s.mu.Lock()
	for id, ss := range s.mu.sessions {
		// active is raised under s.mu, so a session in use is never taken.
		if ss.active.Load() == 0 && match(ss) {
			delete(s.mu.sessions, id)
			gone = append(gone, ss)
		}
	}
	s.mu.Unlock()
	for _, ss := range gone {
		count.Add(1)
		if err := ss.end(); err != nil {
			s.log.Warn("end session", "session", ss.id, "client", ss.client, "why", why, "err", err)
		}
		s.log.Info("session ended: "+why, "session", ss.id, "client", ss.client, "pid", ss.owner)
	}
}

// sessionCount returns the open sessions and their regions' bytes.
func (s *Server) sessionCount() (n int, bytes uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ss := range s.mu.sessions {
		bytes += ss.size
	}
	return len(s.mu.sessions), bytes
}

// checkToken refuses a call that does not carry the agent's token.
func (s *Server) checkToken(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if !auth.HasToken(ctx, s.cfg.Token) {
		var from process
		if p, ok := peer.FromContext(ctx); ok {
			if pi, ok := p.AuthInfo.(peerInfo); ok {
				from = pi.owner
			}
		}
		s.log.Warn("refused a call without the agent's token", "method", info.FullMethod, "pid", from)
		return nil, status.Error(codes.Unauthenticated, "agent: this agent needs its tenant's token (the Python SDK reads it from token_file or $TIDEPOOL_TOKEN_FILE)")
	}
	return h(ctx, req)
}
