package master

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/tidepool-kv/tidepool/auth"
	"github.com/tidepool-kv/tidepool/master/framed"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
	"github.com/tidepool-kv/tidepool/master/logstore"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Defaults of the design card.
const (
	DefaultLeaseTTL   = 10 * time.Second
	DefaultPutTimeout = 30 * time.Second
	DefaultNodeTTL    = 10 * time.Second
	// DefaultReserveWindow: see Config.ReserveWindow.
	DefaultReserveWindow = 5 * time.Second
)

// Config configures one master.
type Config struct {
	// ID is this master's raft server id; it must be stable across restarts.
	ID string
	// Dir holds the raft log, stable store and snapshots.
	Dir string
	// RaftAddr is the address raft listens on when Transport is nil.
	RaftAddr string
	// RaftAdvertise is the raft address peers reach this master at;
	// default RaftAddr.
	RaftAdvertise string
	// Advertise is the gRPC address clients and stores reach this master at;
	// followers hand it out as the leader's address.
	Advertise string
	// Join starts a new master without bootstrapping a cluster: it waits
	// for a leader to add it (Admin.AddMember). Peers must be empty.
	Join bool
	// Peers are the voters a new cluster starts with; empty means this node
	// alone. Every peer must be given the same list. A master not among
	// them starts as Join does: it bootstraps nothing, so a deployment
	// that grows (a StatefulSet's new ordinals, given the first members'
	// list) cannot start a second cluster beside the first.
	Peers []raft.Server
	// Transport overrides raft's TCP transport (tests use raft's in-memory
	// one). Close closes it if it is an io.Closer.
	Transport raft.Transport

	LeaseTTL   time.Duration // read lease of GetReplicas; default 10 s
	PutTimeout time.Duration // unfinished puts are revoked after this; default 30 s
	NodeTTL    time.Duration // a store silent this long is dead; default 10 s
	// ReserveWindow is how long the leader places puts in one reservation
	// of a segment; default 5 s. After a failover, what an old leader
	// reserved and did not publish stays held for the window, the put
	// timeout and a late-write grace.
	ReserveWindow time.Duration
	// SweepInterval is how often the leader revokes stale puts, checks
	// heartbeats and evicts above the watermark; default 1 s.
	SweepInterval time.Duration
	// Placement orders segments within the preferred tier: FreeRatioFirst
	// (default), RandomOfTwo or LocalFirst.
	Placement string
	// HighWatermark is the fraction of a segment above which the leader
	// evicts, EvictRatio how far below it it goes; defaults 0.90 and 0.05.
	HighWatermark, EvictRatio float64
	// PromoteAfter is how many reads served from SSD alone make an object
	// hot enough to gain a DRAM replica; default DefaultPromoteAfter,
	// negative: never promote.
	PromoteAfter int
	// NoWriteBack turns off write-back: cold DRAM objects then gain an SSD
	// replica only when demoted, and a put that finds DRAM full lands in
	// SSD until the next demotion round. Write-back costs SSD writes for
	// objects that may never be demoted.
	NoWriteBack bool

	// Watcher, if set, hears which complete objects enter and leave
	// which tiers as this master applies the log (kvevents.Publisher);
	// its owner closes it after the master.
	Watcher Watcher

	// Security is who may call this master and what it shows its peers;
	// zero: plaintext, and every caller may do anything (as before TLS).
	Security Security

	Registerer prometheus.Registerer // nil: no metrics
	Logger     *slog.Logger          // nil: discard
	Now        func() time.Time      // nil: time.Now
}

// Security configures TLS and authentication.
type Security struct {
	// TLS, if set, is the server side of the master's port (gRPC and
	// framed) and, requiring a master's certificate, of raft.
	TLS *tls.Config
	// PeerTLS is the client side when this master calls another (raft,
	// announcements, probes): it presents this master's certificate. It
	// must be set with TLS.
	PeerTLS *tls.Config
	// Tokens, if set, are the bearer tokens callers may present. With
	// TLS or Tokens set, a call without a credential is refused.
	Tokens *auth.Tokens
	// PeerToken is the token of the master role this master presents to
	// the others where it has no certificate: a cluster of masters with
	// Tokens and without TLS needs it (raft itself is then plaintext, and
	// only TLS protects it).
	PeerToken string
}

func (s Security) enabled() bool { return s.TLS != nil || s.Tokens != nil }

// Server is one master: a raft node with the FSM and the gRPC services.
type Server struct {
	cfg Config
	// quotaVictims are the victims of quota eviction chosen ahead.
	quotaVictims victimLists
	log          *slog.Logger
	events       events
	fsm          *FSM
	raft         *raft.Raft
	logs         *logstore.Store
	trans        raft.Transport
	notify       chan bool
	// spilled is signaled when a put landed outside its preferred tier
	// because that tier was full: the leader demotes at once instead of
	// at the next sweep, so the next puts find room where they want it.
	spilled chan struct{}
	metrics *metrics
	puts    *putTable
	// listings is leader-local: the key order of paged Lists.
	listings *listings

	grpc   *grpc.Server
	framed *framed.Server
	auth   *auth.Authenticator // nil: every caller may do anything

	mu struct {
		sync.Mutex
		// leader is set once this node is raft leader and its FSM has
		// applied every earlier entry; only then does it serve.
		leader      bool
		leaderTerm  uint64 // the term in which this node caught up
		leaderSince time.Time
		lastSeen    map[string]time.Time    // node -> last heartbeat, leader only
		removing    map[string]int          // keys with a Remove in flight: no new leases
		copyQueue   map[string][]queuedCopy // node -> copies for its next heartbeat
		slowReads   map[string]int          // key -> reads served from a slow tier only: promotion
		promote     map[string]bool         // keys read often enough to promote
		drains      map[string]*pb.DrainProgress
		reclaim     map[string]reclaimList // segment -> written-back replicas puts may drop
		avoided     map[string]time.Time   // node -> until when placement avoids it (see avoid)
		diskFailing bool                   // the raft log's disk, at the last watchDisk
	}

	// removals counts the keys in mu.removing, so that a lease need not
	// take mu to learn that nothing is being removed.
	removals atomic.Int64

	memberMu sync.Mutex // one membership change at a time

	rngMu sync.Mutex
	rng   *rand.Rand // placement sampling; leader-local, never in Apply

	stop chan struct{}
	// goMu makes wg.Add of work started by requests and the Wait of Close
	// exclusive: after closing is set no goroutine starts.
	goMu      sync.Mutex
	closing   bool
	closeOnce sync.Once
	closeErr  error
	wg        sync.WaitGroup
}

// New opens the master's stores, starts raft and, for a new cluster,
// bootstraps it with cfg.Peers.
func New(cfg Config) (*Server, error) {
	if cfg.ID == "" {
		return nil, errors.New("master: config needs an ID")
	}
	if cfg.Dir == "" {
		return nil, errors.New("master: config needs a Dir")
	}
	if cfg.Join && len(cfg.Peers) > 0 {
		return nil, errors.New("master: a master that joins a cluster starts with no peers")
	}
	cfg.LeaseTTL = orDefault(cfg.LeaseTTL, DefaultLeaseTTL)
	cfg.PutTimeout = orDefault(cfg.PutTimeout, DefaultPutTimeout)
	cfg.NodeTTL = orDefault(cfg.NodeTTL, DefaultNodeTTL)
	cfg.SweepInterval = orDefault(cfg.SweepInterval, time.Second)
	cfg.ReserveWindow = orDefault(cfg.ReserveWindow, DefaultReserveWindow)
	switch cfg.Placement {
	case "":
		cfg.Placement = FreeRatioFirst
	case FreeRatioFirst, RandomOfTwo, LocalFirst:
	default:
		return nil, fmt.Errorf("master: unknown placement %q (want %s, %s or %s)", cfg.Placement, FreeRatioFirst, RandomOfTwo, LocalFirst)
	}
	if cfg.HighWatermark <= 0 || cfg.HighWatermark > 1 {
		cfg.HighWatermark = DefaultHighWatermark
	}
	if cfg.EvictRatio <= 0 || cfg.EvictRatio >= cfg.HighWatermark {
		cfg.EvictRatio = DefaultEvictRatio
	}
	if cfg.PromoteAfter == 0 {
		cfg.PromoteAfter = DefaultPromoteAfter
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if (cfg.Security.TLS == nil) != (cfg.Security.PeerTLS == nil) {
		return nil, errors.New("master: Security.TLS and Security.PeerTLS go together")
	}
	if sec := cfg.Security; sec.Tokens != nil && sec.TLS == nil && sec.PeerToken == "" && (len(cfg.Peers) > 1 || cfg.Join) {
		return nil, errors.New("master: masters with tokens and without TLS present a master's token to each other: give one (--token-file)")
	}
	s := &Server{cfg: cfg, log: cfg.Logger, fsm: NewFSM(), notify: make(chan bool, 8), spilled: make(chan struct{}, 1), stop: make(chan struct{}), puts: newPutTable(), listings: newListings()}
	if cfg.Watcher != nil {
		s.fsm.Watch(cfg.Watcher)
	}
	// Stop waits for the handlers, while raft still runs (see Close).
	opts := append(leaderconn.ServerOptions(), grpc.UnaryInterceptor(s.intercept),
		grpc.MaxRecvMsgSize(64<<20), grpc.MaxSendMsgSize(64<<20), grpc.WaitForHandlers(true))
	if cfg.Security.TLS != nil {
		opts = append(opts, grpc.Creds(framed.TLSCredentials()))
	}
	if cfg.Security.enabled() {
		a, err := auth.NewAuthenticator(auth.AuthenticatorConfig{Tokens: cfg.Security.Tokens, Policy: Policy(),
			Registerer: cfg.Registerer, Logger: cfg.Logger})
		if err != nil {
			return nil, fmt.Errorf("master: %w", err)
		}
		s.auth = a
		opts = append(opts, grpc.StreamInterceptor(a.StreamInterceptor()))
	}
	s.grpc = grpc.NewServer(opts...)
	// The same services' unary calls, framed, on the same port (see Serve).
	s.framed = framed.NewServer(s.intercept, cfg.Logger)
	if cfg.Security.TLS != nil {
		var failed func(net.Addr, error)
		if s.auth != nil {
			failed = s.auth.HandshakeFailed
		}
		s.framed.RequireTLS(cfg.Security.TLS, failed)
	}
	for _, r := range []grpc.ServiceRegistrar{s.grpc, s.framed} {
		pb.RegisterMasterServer(r, &masterService{s: s})
		pb.RegisterRegistryServer(r, &registryService{s: s})
		pb.RegisterAdminServer(r, &adminService{s: s})
	}
	s.rng = rand.New(rand.NewPCG(uint64(cfg.Now().UnixNano()), 0x7469646570))
	s.mu.lastSeen = map[string]time.Time{}
	s.mu.removing = map[string]int{}
	s.mu.copyQueue = map[string][]queuedCopy{}
	s.mu.slowReads = map[string]int{}
	s.mu.promote = map[string]bool{}
	s.mu.drains = map[string]*pb.DrainProgress{}
	s.mu.reclaim = map[string]reclaimList{}
	s.mu.avoided = map[string]time.Time{}
	if err := s.startRaft(); err != nil {
		s.closeStores()
		return nil, err
	}
	if cfg.Registerer != nil {
		m, err := newMetrics(cfg.Registerer, s)
		if err != nil {
			s.Close()
			return nil, err
		}
		s.metrics = m
	}
	s.wg.Add(2)
	go s.leaderLoop()
	go s.announceLoop()
	return s, nil
}

func orDefault(d, def time.Duration) time.Duration {
	if d <= 0 {
		return def
	}
	return d
}

func (s *Server) startRaft() error {
	if err := os.MkdirAll(s.cfg.Dir, 0o755); err != nil {
		return fmt.Errorf("master: create %s: %w", s.cfg.Dir, err)
	}
	hlog := hclog.New(&hclog.LoggerOptions{Name: "raft", Level: hclog.Info, Output: logWriter{s.log}, DisableTime: true})
	logs, err := logstore.Open(filepath.Join(s.cfg.Dir, "raft"))
	if err != nil {
		return fmt.Errorf("master: open raft log: %w", err)
	}
	s.logs = logs
	snaps, err := raft.NewFileSnapshotStoreWithLogger(s.cfg.Dir, 2, hlog)
	if err != nil {
		return fmt.Errorf("master: open snapshot store: %w", err)
	}
	s.trans = s.cfg.Transport
	if s.trans == nil {
		stream, err := listenRaft(s.cfg.RaftAddr, cmp.Or(s.cfg.RaftAdvertise, s.cfg.RaftAddr), s.cfg.Security)
		if err != nil {
			return err
		}
		s.trans = raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{Stream: stream, MaxPool: 4, Timeout: 10 * time.Second, Logger: hlog})
	}
	rc := raft.DefaultConfig()
	rc.LocalID = raft.ServerID(s.cfg.ID)
	rc.Logger = hlog
	rc.NotifyCh = s.notify
	rc.HeartbeatTimeout = 500 * time.Millisecond
	rc.ElectionTimeout = 500 * time.Millisecond
	rc.LeaderLeaseTimeout = leaderLeaseTimeout
	// Not BatchApplyCh: raft never answers what is still in that buffer
	// when it shuts down, and a handler whose proposal waits there would
	// outlive Close (review10_test.go); it gave puts at concurrency 8 about
	// 10% here.
	existing, err := raft.HasExistingState(logs, logs, snaps)
	if err != nil {
		return fmt.Errorf("master: inspect raft state: %w", err)
	}
	r, err := raft.NewRaft(rc, s.fsm, logs, logs, snaps, s.trans)
	if err != nil {
		return fmt.Errorf("master: start raft: %w", err)
	}
	s.raft = r
	member := len(s.cfg.Peers) == 0 || slices.ContainsFunc(s.cfg.Peers, func(p raft.Server) bool { return p.ID == rc.LocalID })
	if !existing && !member {
		s.log.Info("not among the initial voters (--peers): waiting to be added to the cluster (tidepool admin members add)", "id", rc.LocalID)
	}
	if !existing && !s.cfg.Join && member {
		peers := s.cfg.Peers
		if len(peers) == 0 {
			peers = []raft.Server{{ID: rc.LocalID, Address: s.trans.LocalAddr()}}
		}
		if err := r.BootstrapCluster(raft.Configuration{Servers: peers}).Error(); err != nil && !errors.Is(err, raft.ErrCantBootstrap) {
			_ = r.Shutdown().Error() // before the stores it uses are closed
			s.raft = nil
			return fmt.Errorf("master: bootstrap: %w", err)
		}
	}
	return nil
}

// Serve answers the Master, Registry and Admin services on ln until
// Close, over gRPC and, for unary calls, framed (package framed): a call
// costs about 60% of gRPC's round trip that way. It may be called once; it
// returns nil after Close.
func (s *Server) Serve(ln net.Listener) error {
	if err := s.grpc.Serve(s.framed.Split(ln)); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("master: serve: %w", err)
	}
	return nil
}

// Close stops the services and raft, and closes the stores. It is safe to
// call more than once.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		s.goMu.Lock()
		s.closing = true
		s.goMu.Unlock()
		close(s.stop)
		// Handlers and the leader's own work end first, while raft runs:
		// hashicorp/raft drops the entries committed but not yet applied
		// when it shuts down, and their futures never answer. But a leader
		// that keeps its lease and cannot commit (its followers' disks
		// stuck) answers none either, so after closeGrace raft shuts down
		// regardless, which fails the futures of what did not commit.
		quiet := make(chan struct{})
		go func() {
			s.grpc.Stop()
			s.framed.Stop()
			s.wg.Wait()
			close(quiet)
		}()
		var errs []error
		select {
		case <-quiet:
		case <-time.After(closeGrace):
			s.log.Warn("closing: raft work still in flight, shutting raft down under it", "grace", closeGrace)
		}
		if s.raft != nil {
			errs = append(errs, s.raft.Shutdown().Error())
		}
		select {
		case <-quiet:
		case <-time.After(closeGrace):
			errs = append(errs, fmt.Errorf("master: handlers still waiting on raft %v after it shut down", closeGrace))
		}
		errs = append(errs, s.closeStores())
		s.closeErr = errors.Join(errs...)
	})
	return s.closeErr
}

func (s *Server) closeStores() error {
	var errs []error
	if c, ok := s.trans.(io.Closer); ok {
		errs = append(errs, c.Close())
	}
	if s.logs != nil {
		errs = append(errs, s.logs.Close())
	}
	return errors.Join(errs...)
}

// goOwned runs f in a goroutine that Close waits for, unless the server is
// closing; it reports whether it started it.
func (s *Server) goOwned(f func()) bool {
	s.goMu.Lock()
	defer s.goMu.Unlock()
	if s.closing {
		return false
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		f()
	}()
	return true
}

// IsLeader reports whether this master is the raft leader and has caught
// up with the log, so it may serve.
//
// The term check covers a leadership lost and won back before leaderLoop
// has seen both changes: the new term has not been caught up yet.
func (s *Server) IsLeader() bool {
	s.mu.Lock()
	leader, term := s.mu.leader, s.mu.leaderTerm
	s.mu.Unlock()
	return leader && s.raft.State() == raft.Leader && s.raft.CurrentTerm() == term
}

// Leader returns the raft id and gRPC address of the current leader, if known.
func (s *Server) Leader() (id, addr string) {
	_, lid := s.raft.LeaderWithID()
	return string(lid), s.fsm.member(string(lid))
}

// Failed receives the error after which the raft log cannot go on (its
// disk failed under a write; see logstore.Store.Fatal). The master is then
// stuck for good and Close may hang: the process should log the error and
// exit, and be restarted once the disk is healthy; the other masters serve
// meanwhile, and it catches up from them.
func (s *Server) Failed() <-chan error { return s.logs.Fatal() }

// FSM exposes the state machine, for tests and status pages.
func (s *Server) FSM() *FSM { return s.fsm }

// closeGrace bounds how long Close waits for raft work in flight, before
// and after it shuts raft down.
const closeGrace = 2 * time.Second

// apply proposes cmd through raft and returns what FSM.Apply returned.
// It proposes nothing once ctx is done or the server is closing: a
// request of many rounds (an unpin of thousands of keys) stops there.
func (s *Server) apply(ctx context.Context, cmd *pb.Command) (any, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	select {
	case <-s.stop:
		return nil, fmt.Errorf("%w: master closing", ErrNotLeader)
	default:
	}
	if err := s.diskError(); err != nil {
		return nil, err
	}
	cmd.NowUnixNano = s.cfg.Now().UnixNano()
	data, err := proto.Marshal(cmd)
	if err != nil {
		return nil, fmt.Errorf("encode command: %w", err)
	}
	timeout := 10 * time.Second
	if d, ok := ctx.Deadline(); ok {
		if timeout = time.Until(d); timeout <= 0 {
			return nil, context.DeadlineExceeded // raft reads 0 as no timeout
		}
	}
	if _, ok := cmd.Op.(*pb.Command_PublishColumns); ok {
		// The FSM reads a publish without changing it, so while this
		// proposal waits it takes the command as it is rather than decode
		// its bytes (7% of a leader's CPU under batch puts).
		key := unsafe.SliceData(data)
		s.fsm.proposed.Store(key, cmd)
		defer s.fsm.proposed.Delete(key)
	}
	f := s.raft.Apply(data, timeout)
	if err := f.Error(); err != nil {
		switch {
		case errors.Is(err, raft.ErrNotLeader), errors.Is(err, raft.ErrLeadershipTransferInProgress):
			return nil, fmt.Errorf("%w: %v", ErrNotLeader, err)
		case errors.Is(err, raft.ErrLeadershipLost):
			// The entry may still commit under the next leader: the outcome
			// is unknown, so the caller must not blindly retry.
			return nil, fmt.Errorf("%w: %v", ErrOutcomeUnknown, err)
		case errors.Is(err, raft.ErrEnqueueTimeout), errors.Is(err, raft.ErrRaftShutdown):
			return nil, fmt.Errorf("%w: %v", ErrNotLeader, err)
		}
		return nil, fmt.Errorf("raft apply: %w", err)
	}
	if err, ok := f.Response().(error); ok {
		return nil, err
	}
	return f.Response(), nil
}

// leaderLoop tracks leadership and, while leader, sweeps: it revokes
// stale puts, declares silent stores dead, and evicts, demotes, promotes
// and drains. It also demotes as soon as a put spills out of its tier, at
// most every minSpillSweep.
func (s *Server) leaderLoop() {
	defer s.wg.Done()
	tick := time.NewTicker(s.cfg.SweepInterval)
	defer tick.Stop()
	var lastSpill time.Time
	for {
		select {
		case <-s.stop:
			return
		case leader := <-s.notify:
			if leader {
				leader = s.catchUp()
			}
			s.setLeader(leader)
		case <-tick.C:
			s.watchDisk()
			if s.IsLeader() {
				s.sweep()
			}
		case <-s.puts.kick:
			if s.IsLeader() {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				s.releaseDone(ctx, s.cfg.Now())
				cancel()
			}
		case <-s.spilled:
			if s.IsLeader() && time.Since(lastSpill) >= minSpillSweep {
				lastSpill = time.Now()
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				s.evictToWatermark(ctx, s.cfg.Now())
				s.writeBack(ctx, s.cfg.Now())
				cancel()
			}
		}
	}
}

// minSpillSweep bounds how often spilled puts start a demotion round.
const minSpillSweep = 50 * time.Millisecond

// spill notes that a put landed outside its preferred tier.
func (s *Server) spill() {
	select {
	case s.spilled <- struct{}{}:
	default:
	}
}

// catchUp waits until the FSM has applied every entry of earlier terms:
// raft announces leadership before that, and after a restart the FSM is
// still empty then. Serving earlier would answer "not found" for complete
// objects and "unknown node" to live stores.
func (s *Server) catchUp() bool {
	for {
		err := s.raft.Barrier(10 * time.Second).Error()
		if err == nil {
			return true
		}
		s.log.Warn("leader barrier", "err", err)
		select {
		case <-s.stop:
			return false
		default:
		}
		if s.raft.State() != raft.Leader {
			return false
		}
	}
}

func (s *Server) setLeader(leader bool) {
	now := s.cfg.Now()
	s.events.reset()
	s.mu.Lock()
	s.mu.leader = leader
	s.mu.leaderTerm = s.raft.CurrentTerm()
	s.mu.leaderSince = now
	clear(s.mu.lastSeen)
	clear(s.mu.copyQueue) // their copies expire and the sweep ends them
	clear(s.mu.slowReads)
	clear(s.mu.promote)
	clear(s.mu.drains)
	clear(s.mu.reclaim)
	clear(s.mu.avoided)
	s.puts.reset(s.mu.leaderTerm)
	if leader {
		// Every store gets a full TTL to reach the new leader.
		for id := range s.fsm.liveNodes() {
			s.mu.lastSeen[id] = now
		}
	}
	s.mu.Unlock()
	if !leader {
		return
	}
	s.log.Info("became raft leader", "id", s.cfg.ID)
	s.events.add(now, "leader", "%s became the leader", s.cfg.ID)
	if s.fsm.member(s.cfg.ID) != s.cfg.Advertise {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := s.apply(ctx, &pb.Command{Op: &pb.Command_Member{Member: &pb.MemberCmd{Id: s.cfg.ID, Address: s.cfg.Advertise}}}); err != nil {
			s.log.Warn("record leader address", "err", err)
		}
	}
}

// diskError is ErrLogDisk, with the reason, while the raft log's disk
// fails; a commit would only stall until it timed out.
func (s *Server) diskError() error {
	err, since, fails := s.logs.DiskError()
	if err == nil {
		return nil
	}
	return fmt.Errorf("%w on master %s since %s (%d failed flushes, the last: %v); it takes writes again once a flush succeeds",
		ErrLogDisk, s.cfg.ID, since.UTC().Format(time.RFC3339), fails, err)
}

// watchDisk logs the raft log's disk failing and recovering, and hands
// leadership to another master while it fails: a follower's disk may be
// fine.
func (s *Server) watchDisk() {
	err := s.diskError()
	s.mu.Lock()
	was := s.mu.diskFailing
	s.mu.diskFailing = err != nil
	s.mu.Unlock()
	switch {
	case err != nil && !was:
		s.log.Error("raft log disk failing: refusing writes", "err", err)
	case err == nil && was:
		s.log.Info("raft log disk recovered: taking writes again")
	}
	if err == nil || !s.IsLeader() {
		return
	}
	if servers, err := s.voters(); err == nil && len(servers) > 1 {
		if err := s.raft.LeadershipTransfer().Error(); err != nil {
			s.log.Warn("hand leadership to a master with a healthy disk", "err", err)
		}
	}
}

func (s *Server) sweep() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	now := s.cfg.Now()
	s.sweepPuts(ctx, now)
	if keys := s.fsm.expiredPuts(now.UnixNano()); len(keys) > 0 {
		out, err := s.apply(ctx, &pb.Command{Op: &pb.Command_PutRevoke{PutRevoke: &pb.KeysCmd{Keys: keys, OnlyExpired: true}}})
		if err != nil {
			s.log.Warn("revoke stale puts", "keys", len(keys), "err", err)
		} else if n := countNil(out.([]error)); n > 0 {
			s.log.Info("revoked stale puts", "keys", n)
			s.metrics.revoked(n)
		}
	}
	live := s.fsm.liveNodes()
	var dead []string
	s.mu.Lock()
	for id := range live {
		seen, ok := s.mu.lastSeen[id]
		if !ok {
			s.mu.lastSeen[id] = now // registered through another leader
		} else if now.Sub(seen) > s.cfg.NodeTTL {
			dead = append(dead, id)
		}
	}
	s.mu.Unlock()
	s.endExpiredCopies(ctx, now)
	s.prune()
	defer s.repair(ctx)
	defer s.drainNodes(ctx)
	defer s.promote(ctx)
	defer s.writeBack(ctx, now)
	defer s.evictToWatermark(ctx, now)
	defer s.enforceQuotas(ctx)
	for _, id := range dead {
		s.log.Warn("store node silent, declaring it dead", "node", id, "ttl", s.cfg.NodeTTL)
		if _, err := s.apply(ctx, &pb.Command{Op: &pb.Command_NodeDown{NodeDown: &pb.NodeDownCmd{Node: id, Epoch: live[id]}}}); err != nil {
			// Typically it registered again meanwhile: keep its heartbeat.
			s.log.Warn("declare node dead", "node", id, "err", err)
			continue
		}
		s.mu.Lock()
		delete(s.mu.lastSeen, id)
		delete(s.mu.copyQueue, id)
		delete(s.mu.avoided, id)
		s.mu.Unlock()
		s.events.add(now, "store", "store %s silent for %v, declared dead", id, s.cfg.NodeTTL)
	}
}

func countNil(errs []error) int {
	n := 0
	for _, err := range errs {
		if err == nil {
			n++
		}
	}
	return n
}

// lease grants read leases on objs, the objects read for keys (nil where
// missing), and reports the keys it refused because a Remove or eviction
// of them is in flight: such a key is answered as not found. The caller
// reads the objects again after: a removal that finished before the lease
// shows there (the object is gone), one in flight is refused here, one
// that starts later sees the lease. The leases are stored before the
// count of removals is read, and startRemove counts itself in before it
// reads the leases, so one of the two sees the other.
//
// The lease ends at exp (unix nanos), the expiry of the read tickets the
// caller hands out with it: a ticket must not outlast the lease, after
// which a removed object's space is reused.
func (s *Server) lease(keys []string, objs []*object, now, exp int64, cached bool) (refused map[string]bool) {
	for _, o := range objs {
		if o != nil {
			o.leaseUntil(now, exp, cached)
		}
	}
	if s.removals.Load() == 0 {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, k := range keys {
		if objs[i] != nil && s.mu.removing[k] > 0 {
			if refused == nil {
				refused = map[string]bool{}
			}
			refused[k] = true
		}
	}
	return refused
}

// prune forgets the leader's bookkeeping of segments that are gone.
func (s *Server) prune() {
	segs := map[string]bool{}
	for _, v := range s.fsm.segmentViews() {
		segs[v.id] = true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for id := range s.mu.reclaim {
		if !segs[id] {
			delete(s.mu.reclaim, id)
		}
	}
}

// beingRemoved reports whether a Remove or eviction of key is in flight.
func (s *Server) beingRemoved(key string) bool {
	if s.removals.Load() == 0 {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mu.removing[key] > 0
}

// startRemove marks keys as being removed and returns when their space may
// be reused: after every lease this leader granted on them, and after any
// lease an earlier leader may have granted. The returned func unmarks them.
func (s *Server) startRemove(keys []string) (time.Time, func()) {
	s.mu.Lock()
	for _, k := range keys {
		s.mu.removing[k]++
	}
	s.removals.Add(int64(len(keys)))
	s.mu.Unlock()
	done := func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, k := range keys {
			if s.mu.removing[k]--; s.mu.removing[k] <= 0 {
				delete(s.mu.removing, k)
			}
		}
		s.removals.Add(-int64(len(keys)))
	}
	return s.leaseEnd(keys), done // read after the keys are marked: see lease
}

func (s *Server) heartbeat(node string, epoch uint64) error {
	if e, ok := s.fsm.liveNodes()[node]; !ok || e != epoch {
		if s.fsm.drained(node, epoch) {
			return fmt.Errorf("%w: %s@%d", ErrDrained, node, epoch)
		}
		return fmt.Errorf("%w: %s@%d", ErrUnknownNode, node, epoch)
	}
	s.mu.Lock()
	s.mu.lastSeen[node] = s.cfg.Now()
	s.mu.Unlock()
	return nil
}

func (s *Server) alive(node string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.mu.lastSeen[node]
	return ok
}

// fresh reports whether node heartbeat recently: a replica there may be
// the only one left once another is dropped. A node silent for a few
// heartbeats may be dead though not yet declared so.
func (s *Server) fresh(node string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	seen, ok := s.mu.lastSeen[node]
	return ok && s.cfg.Now().Sub(seen) <= min(s.cfg.NodeTTL/2, freshFor)
}

// freshFor is how recent a heartbeat must be for fresh: three of a store's
// default interval.
const freshFor = 3 * time.Second

// keepsCount reports whether dropping o's replica on segment leaves it on
// as many nodes as its put asked for (or on as many as it has, if fewer),
// counting only nodes that heartbeat recently, and on one at least: a
// DRAM replica with an SSD copy on its own node, or a replica beyond the
// count.
func (s *Server) keepsCount(o evictable, segment string, nodeOf map[string]string) bool {
	return s.keepsCountWithout(o, func(id string) bool { return id == segment }, nodeOf)
}

// keepsCountWithout is keepsCount without every replica on a segment
// gone says.
func (s *Server) keepsCountWithout(o evictable, gone func(segment string) bool, nodeOf map[string]string) bool {
	var before, after []string
	for _, id := range o.segments {
		n := nodeOf[id]
		if !slices.Contains(before, n) {
			before = append(before, n)
		}
		if !gone(id) && s.fresh(n) && !slices.Contains(after, n) {
			after = append(after, n)
		}
	}
	return len(after) >= max(1, min(o.want, len(before)))
}

// segmentNodes maps segment ids to their nodes.
func (s *Server) segmentNodes() map[string]string {
	out := map[string]string{}
	for _, v := range s.fsm.segmentViews() {
		out[v.id] = v.node
	}
	return out
}

// logWriter turns raft's log lines ("[WARN]  raft: message: k=v", one per
// Write) into slog records at the matching level. Raft's INFO chatter
// (elections, snapshots) goes to Debug.
type logWriter struct{ l *slog.Logger }

func (w logWriter) Write(p []byte) (int, error) {
	line := strings.TrimSpace(string(p))
	level := slog.LevelDebug
	for prefix, l := range map[string]slog.Level{"[WARN]": slog.LevelWarn, "[ERROR]": slog.LevelError} {
		if rest, ok := strings.CutPrefix(line, prefix); ok {
			line, level = rest, l
		}
	}
	if rest, ok := strings.CutPrefix(line, "[INFO]"); ok {
		line = rest
	}
	line = strings.TrimSpace(line)
	// A lone node always times out waiting for a leader before it elects
	// itself; that is not worth a warning.
	if strings.Contains(line, "heartbeat timeout reached, starting election") {
		level = slog.LevelInfo
	}
	w.l.Log(context.Background(), level, line)
	return len(p), nil
}
