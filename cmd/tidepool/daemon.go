package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/net/netutil"

	"github.com/tidepool-kv/tidepool/auth"
	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/master"
	"github.com/tidepool-kv/tidepool/master/kvevents"
	"github.com/tidepool-kv/tidepool/statuspage"
	"github.com/tidepool-kv/tidepool/store"
	"github.com/tidepool-kv/tidepool/tiers"
)

const (
	defaultMaster = "127.0.0.1:50051"
	defaultRaft   = "127.0.0.1:50052"
	defaultEngine = "127.0.0.1:50061"
)

func newLogger(e *env, level string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("%w: --log-level %q: want debug, info, warn or error", errUsage, level)
	}
	return slog.New(slog.NewTextHandler(e.stderr, &slog.HandlerOptions{Level: l})), nil
}

// daemon is what every daemon command sets up: its logger, its metrics
// registry and the address of its HTTP endpoints.
type daemon struct {
	http, level string
	log         *slog.Logger
	reg         *prometheus.Registry
}

// parseDaemon adds --http and --log-level to fs, parses args and sets up
// the daemon.
func parseDaemon(e *env, fs *flag.FlagSet, args []string, httpDefault string) (*daemon, error) {
	httpAddr := fs.String("http", httpDefault, "address for /metrics, /healthz and /readyz (empty: off)")
	level := fs.String("log-level", "info", "debug, info, warn or error")
	if _, err := parse(fs, args, 0, 0); err != nil {
		return nil, err
	}
	log, err := newLogger(e, *level)
	if err != nil {
		return nil, err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return &daemon{http: *httpAddr, level: *level, log: log, reg: reg}, nil
}

// maxHTTPConns bounds the connections of a daemon's HTTP server.
const maxHTTPConns = 256

// serveHTTP serves /metrics, /healthz, /readyz and /debug/pprof/ until ctx ends.
// ready reports whether the daemon can do its work.
// rails, if not nil, is served as JSON at /debug/rails for `tidepool admin rails`.
// page, if not nil, is the status page at /.
func serveHTTP(addr string, reg *prometheus.Registry, ready func() error, rails func() []engine.RailInfo, page *statuspage.Page, log *slog.Logger) (func(), error) {
	if addr == "" {
		return func() {}, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen for HTTP on %q: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	// Go's profiler, for `go tool pprof http://ADDR/debug/pprof/profile`:
	// the HTTP address is an operator's port, like /metrics.
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	if rails != nil {
		mux.HandleFunc("/debug/rails", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(rails())
		})
	}
	if page != nil {
		page.Log = log
		mux.Handle("GET /{$}", page)
	}
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := ready(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	// Every connection has a deadline: a header within 5 s, a request within
	// 10 s, an answer within 2 minutes (a CPU profile takes 30 s), and a
	// keep-alive connection closes after a minute idle. At most
	// maxHTTPConns are open; more wait to be accepted.
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second,
		WriteTimeout: 2 * time.Minute, IdleTimeout: time.Minute}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(netutil.LimitListener(ln, maxHTTPConns)); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("http server", "err", err)
		}
	}()
	log.Info("serving metrics and health", "addr", "http://"+ln.Addr().String())
	return func() {
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
		<-done
	}, nil
}

// masterFlags are the flags of `tidepool master`, shared with `up`.
type masterFlags struct {
	id, dir, listen, advertise, raftAddr, peers string
	raftAdvertise                               string
	join                                        bool
	leaseTTL, putTimeout, nodeTTL               time.Duration
	highWatermark, evictRatio                   float64
	placement                                   string
	promoteAfter                                int
	noWriteBack                                 bool
	tls                                         auth.Files
	tokens, tokenFile                           string
	kvEvents                                    kvevents.Config
}

func (m *masterFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&m.id, "id", "m1", "raft server id of this master; stable across restarts")
	fs.StringVar(&m.dir, "dir", "tidepool-master", "directory for the raft log and snapshots")
	fs.StringVar(&m.listen, "listen", defaultMaster, "address for clients and stores (gRPC, and the same calls framed)")
	fs.StringVar(&m.advertise, "advertise", "", "gRPC address others reach this master at (default --listen)")
	fs.StringVar(&m.raftAddr, "raft", defaultRaft, "address for raft traffic between masters; outgoing raft connections leave from its host")
	fs.StringVar(&m.raftAdvertise, "raft-advertise", "", "raft address the other masters reach this one at, as named in --peers (default --raft)")
	fs.StringVar(&m.peers, "peers", "", "initial voters of a new cluster as id=raftaddr,...; empty: this master alone; a master not among them waits to be added, as with --join")
	fs.BoolVar(&m.join, "join", false, "start without a cluster and wait to be added to one (tidepool admin members add); needs no --peers")
	fs.DurationVar(&m.leaseTTL, "lease-ttl", master.DefaultLeaseTTL, "read lease granted with every get")
	fs.DurationVar(&m.putTimeout, "put-timeout", master.DefaultPutTimeout, "revoke a put neither ended nor revoked after this")
	fs.DurationVar(&m.nodeTTL, "node-ttl", master.DefaultNodeTTL, "declare a store dead after this long without a heartbeat")
	fs.StringVar(&m.placement, "placement", master.FreeRatioFirst, "order of segments within a tier: free-ratio (most free first), random (best of two random) or local (the client's host first)")
	fs.Float64Var(&m.highWatermark, "high-watermark", master.DefaultHighWatermark, "evict from a segment fuller than this fraction")
	fs.Float64Var(&m.evictRatio, "evict-ratio", master.DefaultEvictRatio, "how far below the high watermark eviction goes")
	promoteFlag(fs, &m.promoteAfter)
	tlsFlags(fs, &m.tls)
	fs.StringVar(&m.tokenFile, "token-file", "", "file whose first line is a master-role token this master presents to the others (needed with --tokens and without TLS, where masters have no certificate)")
	fs.StringVar(&m.tokens, "tokens", "", "tokens file (JSON: name, role, tenant, sha256 of each bearer token; reread on SIGHUP); with it or TLS, every call needs a token or a client certificate")
	kvEventsFlags(fs, &m.kvEvents)
	fs.BoolVar(&m.noWriteBack, "no-write-back", false, "copy cold DRAM objects to SSD only when demoting them, not ahead of need (fewer SSD writes; puts spill to SSD while DRAM is full)")
}

// kvEventsFlags are --kv-events and its companions, of master and up.
func kvEventsFlags(fs *flag.FlagSet, c *kvevents.Config) {
	fs.StringVar(&c.Endpoint, "kv-events", "", "publish the pool's KV events (vLLM's format, for KV-aware routers) on a ZMQ PUB socket bound at tcp://HOST:PORT (HOST * for every interface); empty: none")
	fs.StringVar(&c.ReplayEndpoint, "kv-events-replay", "", "with --kv-events: replay kept batches from a sequence number on a ZMQ ROUTER socket bound at tcp://HOST:PORT, as vLLM's replay_endpoint")
	fs.StringVar((*string)(&c.Encoding), "kv-events-encoding", string(kvevents.EncodingArray), "with --kv-events: array (msgspec's array_like, which every consumer reads) or map (tagged maps, as vLLM writes since mid-2026)")
}

// prefaultFlag is --prefault, of store and up.
func prefaultFlag(fs *flag.FlagSet, p *bool) {
	fs.BoolVar(p, "prefault", true, "commit the DRAM tiers' memory in the background at start, so puts take no first-touch page faults (false: commit pages as they are first written)")
}

// promoteFlag is --promote-after, of master and up.
func promoteFlag(fs *flag.FlagSet, n *int) {
	fs.IntVar(n, "promote-after", master.DefaultPromoteAfter, "give an object a DRAM replica after this many reads served from SSD alone (0: never)")
}

func (m *masterFlags) config(reg prometheus.Registerer, log *slog.Logger) (master.Config, error) {
	cfg := master.Config{
		ID: m.id, Dir: m.dir, RaftAddr: m.raftAddr, RaftAdvertise: m.raftAdvertise, Advertise: m.advertise,
		LeaseTTL: m.leaseTTL, PutTimeout: m.putTimeout, NodeTTL: m.nodeTTL,
		HighWatermark: m.highWatermark, EvictRatio: m.evictRatio, Placement: m.placement,
		PromoteAfter: m.promoteAfter, NoWriteBack: m.noWriteBack, Join: m.join,
		Registerer: reg, Logger: log.With("component", "master"),
	}
	switch {
	case m.promoteAfter < 0:
		return cfg, fmt.Errorf("%w: --promote-after must not be negative", errUsage)
	case m.promoteAfter == 0:
		cfg.PromoteAfter = -1 // never
	}
	if cfg.Advertise == "" {
		cfg.Advertise = m.listen
	}
	if m.tls.Enabled() {
		var err error
		if cfg.Security.TLS, err = m.tls.ServerConfig(false); err != nil {
			return cfg, fmt.Errorf("%w: %v", errUsage, err)
		}
		if cfg.Security.PeerTLS, err = m.tls.ClientConfig(auth.Master); err != nil {
			return cfg, fmt.Errorf("%w: %v", errUsage, err)
		}
	}
	if m.tokenFile != "" {
		tok, err := auth.ReadToken(m.tokenFile)
		if err != nil {
			return cfg, fmt.Errorf("%w: --token-file: %v", errUsage, err)
		}
		cfg.Security.PeerToken = tok
	}
	if m.tokens != "" {
		t, err := auth.LoadTokens(m.tokens)
		if err != nil {
			return cfg, fmt.Errorf("--tokens: %w", err)
		}
		cfg.Security.Tokens = t
	}
	if m.highWatermark <= 0 || m.highWatermark > 1 || m.evictRatio < 0 || m.evictRatio >= m.highWatermark {
		return cfg, fmt.Errorf("%w: --high-watermark must be in (0, 1] and --evict-ratio in [0, high watermark)", errUsage)
	}
	if m.join && m.peers != "" {
		return cfg, fmt.Errorf("%w: --join and --peers exclude each other: a joining master is added by the leader", errUsage)
	}
	for _, p := range strings.Split(m.peers, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		id, addr, ok := strings.Cut(p, "=")
		if !ok || id == "" || addr == "" {
			return cfg, fmt.Errorf("%w: --peers entry %q: want id=host:port", errUsage, p)
		}
		cfg.Peers = append(cfg.Peers, raft.Server{ID: raft.ServerID(id), Address: raft.ServerAddress(addr)})
	}
	return cfg, nil
}

// startMaster starts a master serving gRPC on the flags' listen address.
// done is closed if the gRPC server stops; stop closes the master and
// returns why the server stopped, if it failed.
func startMaster(m *masterFlags, reg prometheus.Registerer, log *slog.Logger) (srv *master.Server, done <-chan struct{}, stop func() error, err error) {
	cfg, err := m.config(reg, log)
	if err != nil {
		return nil, nil, nil, err
	}
	ln, err := net.Listen("tcp", m.listen)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("listen for gRPC on %q: %w", m.listen, err)
	}
	pub, err := startKVEvents(m.kvEvents, reg, log)
	if err != nil {
		ln.Close()
		return nil, nil, nil, err
	}
	closePub := func() error { return nil }
	if pub != nil {
		cfg.Watcher, closePub = pub, pub.Close
	}
	srv, err = master.New(cfg)
	if err != nil {
		ln.Close()
		return nil, nil, nil, errors.Join(err, closePub())
	}
	served := make(chan struct{})
	var serveErr error
	go func() {
		defer close(served)
		serveErr = srv.Serve(ln)
	}()
	log.Info("master serving", "id", m.id, "grpc", ln.Addr().String(), "raft", m.raftAddr, "dir", m.dir,
		"tls", m.tls.Enabled(), "tokens", m.tokens)
	stopReload := reloadOnHangup(cfg.Security.Tokens, log)
	stop = func() error {
		stopReload()
		err := srv.Close()
		<-served
		return errors.Join(err, serveErr, closePub())
	}
	return srv, served, stop, nil
}

// startKVEvents starts the KV events publisher c asks for (nil if none)
// and exports its counts.
func startKVEvents(c kvevents.Config, reg prometheus.Registerer, log *slog.Logger) (*kvevents.Publisher, error) {
	if c.Endpoint == "" {
		if c.ReplayEndpoint != "" {
			return nil, fmt.Errorf("%w: --kv-events-replay needs --kv-events", errUsage)
		}
		return nil, nil
	}
	c.Logger = log.With("component", "kvevents")
	pub, err := kvevents.New(c)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errUsage, err)
	}
	counter := func(name, help string, v func(kvevents.Stats) uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 { return float64(v(pub.Stats())) })
	}
	for _, col := range []prometheus.Collector{
		counter("tidepool_kv_events_published_total", "KV event batches sent on the --kv-events socket.", func(s kvevents.Stats) uint64 { return s.Published }),
		counter("tidepool_kv_events_dropped_total", "KV event batches dropped because the queue to the socket was full (their sequence numbers are skipped).", func(s kvevents.Stats) uint64 { return s.Dropped }),
		counter("tidepool_kv_events_lagged_total", "KV event messages a slow subscriber's queue had no room for.", func(s kvevents.Stats) uint64 { return s.Lagged }),
	} {
		if err := reg.Register(col); err != nil {
			return nil, errors.Join(err, pub.Close())
		}
	}
	log.Info("publishing KV events", "endpoint", pub.Addr(), "replay", pub.ReplayAddr(), "encoding", c.Encoding)
	return pub, nil
}

// reloadOnHangup rereads the tokens file on each SIGHUP until the
// returned stop; a file that fails to load leaves the tokens in use.
func reloadOnHangup(tokens *auth.Tokens, log *slog.Logger) (stop func()) {
	if tokens == nil {
		return func() {}
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-hup:
				if err := tokens.Reload(); err != nil {
					log.Error("tokens file not reloaded; the tokens read before stay in use", "err", err)
					continue
				}
				log.Info("tokens file reloaded", "tokens", tokens.Len())
			case <-done:
				return
			}
		}
	}()
	return func() {
		signal.Stop(hup)
		close(done)
		wg.Wait()
	}
}

func runMaster(ctx context.Context, e *env, args []string) error {
	fs := newFlags("master", "[flags]", "Run a master: the raft-replicated metadata service.", e.stderr)
	var m masterFlags
	m.register(fs)
	d, err := parseDaemon(e, fs, args, "127.0.0.1:9090")
	if err != nil {
		return err
	}
	log := d.log
	srv, served, stop, err := startMaster(&m, d.reg, log)
	if err != nil {
		return err
	}
	page := &statuspage.Page{Title: "master " + m.id, Status: srv.Status, Events: masterEvents(srv), Hits: srv.LookupHits, Tenants: masterTenants(srv)}
	stopHTTP, err := serveHTTP(d.http, d.reg, func() error { return leaderKnown(srv, m.id) }, nil, page, log)
	if err != nil {
		return errors.Join(err, stop())
	}
	select {
	case <-ctx.Done():
	case <-served:
		log.Error("gRPC server stopped; shutting down")
	case err := <-srv.Failed():
		return raftLogFailed(err)
	}
	log.Info("shutting down")
	stopHTTP()
	return stop()
}

// raftLogFailed is the error a master exits with when its raft log's disk
// failed under a write. It skips the orderly stop, which would wait on the
// goroutine the log parked.
func raftLogFailed(err error) error {
	return fmt.Errorf("the raft log's disk failed (%w); the master stops, as its log can no longer be trusted: "+
		"restart it once the disk is healthy (other masters serve meanwhile and it catches up from them)", err)
}

// leaderKnown is a master's readiness: a leader is known, and if it is this
// master, it has caught up with the log.
func leaderKnown(srv *master.Server, self string) error {
	if id, _ := srv.Leader(); id == "" || (id == self && !srv.IsLeader()) {
		return errors.New("no raft leader serving yet")
	}
	return nil
}

// storeFlags are the flags of `tidepool store`, shared with `up`.
type storeFlags struct {
	id, listen, advertise string
	tiers                 listFlag
	indexSync             time.Duration
	copies                int
	prefault              bool
}

func (s *storeFlags) register(fs *flag.FlagSet, defaultTier string) {
	host, _ := os.Hostname()
	fs.StringVar(&s.id, "id", host, "node id; stable across restarts of this node")
	fs.StringVar(&s.listen, "listen", defaultEngine, "transfer engine address, or several separated by commas: one rail each")
	fs.StringVar(&s.advertise, "advertise", "", "transfer engine address peers dial (default --listen)")
	fs.DurationVar(&s.indexSync, "index-sync", 5*time.Second, "how often an SSD tier's index of its objects is synced with the master")
	fs.IntVar(&s.copies, "copies", 4, "copies (demotion, promotion, drain) the master may have this node make at once")
	prefaultFlag(fs, &s.prefault)
	fs.Var(&s.tiers, "tier", "a tier to serve, repeatable: dram:SIZE (e.g. dram:8GiB); ssd:DIR:SIZE (a preallocated file in DIR whose objects survive a restart); hbm:SIZE[:DEVICE] (GPU memory of CUDA device DEVICE, default 0); "+
		"hbm-emulated:SIZE (host memory standing in for HBM on hosts without a GPU, shown as emulated) (default "+defaultTier+")")
}

// mountTiers creates the tiers the --tier flags describe. HBM tiers, real or
// emulated, are numbered together (hbm0, hbm1-emulated, ...); an emulated
// one's name ends in "-emulated", so status shows it as such.
func mountTiers(specs []string) ([]tiers.Tier, error) {
	var out []tiers.Tier
	fail := func(err error) ([]tiers.Tier, error) {
		for _, t := range out {
			t.Close()
		}
		return nil, err
	}
	counts := map[tiers.Kind]int{}
	for _, spec := range specs {
		kind, rest, _ := strings.Cut(spec, ":")
		var t tiers.Tier
		switch kind {
		case "dram":
			size, err := tiers.ParseSize(rest)
			if err != nil {
				return fail(fmt.Errorf("%w: --tier %q: %v", errUsage, spec, err))
			}
			if t, err = tiers.NewDRAM(fmt.Sprintf("dram%d", counts[tiers.DRAM]), size); err != nil {
				return fail(err)
			}
		case "hbm":
			sizeArg, devArg, hasDev := strings.Cut(rest, ":")
			size, err := tiers.ParseSize(sizeArg)
			if err != nil {
				return fail(fmt.Errorf("%w: --tier %q: %v", errUsage, spec, err))
			}
			device := 0
			if hasDev {
				if device, err = strconv.Atoi(devArg); err != nil || device < 0 {
					return fail(fmt.Errorf("%w: --tier %q: invalid CUDA device %q: want 0, 1, ...", errUsage, spec, devArg))
				}
			}
			hbm, err := tiers.NewHBM(fmt.Sprintf("hbm%d", counts[tiers.HBM]), device, size)
			if errors.Is(err, tiers.ErrNoGPU) {
				return fail(fmt.Errorf("--tier %q: no usable GPU: %w; use hbm-emulated:%s", spec, err, sizeArg))
			}
			if err != nil {
				return fail(err)
			}
			t = hbm
		case "hbm-emulated":
			size, err := tiers.ParseSize(rest)
			if err != nil {
				return fail(fmt.Errorf("%w: --tier %q: %v", errUsage, spec, err))
			}
			if t, err = tiers.NewHBMEmulated(fmt.Sprintf("hbm%d", counts[tiers.HBM]), size); err != nil {
				return fail(err)
			}
		case "ssd":
			// ssd:DIR:SIZE; DIR may itself hold colons, SIZE never does.
			i := strings.LastIndex(rest, ":")
			if i <= 0 {
				return fail(fmt.Errorf("%w: --tier %q: want ssd:DIR:SIZE", errUsage, spec))
			}
			size, err := tiers.ParseSize(rest[i+1:])
			if err != nil {
				return fail(fmt.Errorf("%w: --tier %q: %v", errUsage, spec, err))
			}
			if t, err = tiers.NewSSD(fmt.Sprintf("ssd%d", counts[tiers.SSD]), rest[:i], size); err != nil {
				return fail(err)
			}
		default:
			return fail(fmt.Errorf("%w: --tier %q: unknown tier kind %q (supported: dram, ssd, hbm, hbm-emulated)", errUsage, spec, kind))
		}
		counts[t.Kind()]++
		out = append(out, t)
	}
	return out, nil
}

// startStore starts a store node of the masters, showing them creds; with
// TLS, its engine serves TLS with creds' certificate.
func startStore(s *storeFlags, masters []string, creds *credentials, reg prometheus.Registerer, log *slog.Logger) (*store.Node, error) {
	mc, err := creds.masters()
	if err != nil {
		return nil, err
	}
	var ecfg engine.Config
	if creds.files.Enabled() {
		if ecfg.TLS, err = creds.files.ServerConfig(false); err != nil {
			return nil, fmt.Errorf("%w: %v", errUsage, err)
		}
		if ecfg.PeerTLS, err = creds.stores(); err != nil {
			return nil, err
		}
		ecfg.AllowPlaintext = creds.plainRails
	}
	ts, err := mountTiers(s.tiers)
	if err != nil {
		return nil, err
	}
	n, err := store.New(store.Config{
		ID: s.id, Masters: masters, Credentials: mc, Listen: s.listen, Advertise: s.advertise, Engine: ecfg,
		Tiers: ts, IndexSyncInterval: s.indexSync, CopyConcurrency: s.copies, Prefault: s.prefault, Registerer: reg, Logger: log.With("component", "store"),
	})
	if err != nil {
		for _, t := range ts {
			t.Close()
		}
		return nil, err
	}
	log.Info("store serving", "id", s.id, "engine", n.Endpoint(), "tiers", s.tiers.String())
	return n, nil
}

func runStore(ctx context.Context, e *env, args []string) error {
	fs := newFlags("store", "[flags]", "Run a store node: it serves its tiers' bytes to the pool.", e.stderr)
	var s storeFlags
	s.register(fs, "dram:1GiB")
	masters := mastersFlag(fs, e)
	d, err := parseDaemon(e, fs, args, "127.0.0.1:9091")
	if err != nil {
		return err
	}
	if len(s.tiers) == 0 {
		s.tiers = listFlag{"dram:1GiB"}
	}
	log := d.log
	n, err := startStore(&s, masters.list(), &masters.credentials, d.reg, log)
	if err != nil {
		return err
	}
	page := &statuspage.Page{Title: "store " + s.id, Status: n.Status, Node: s.id, Rails: n.Rails}
	stopHTTP, err := serveHTTP(d.http, d.reg, func() error { return registered(n) }, n.Rails, page, log)
	if err != nil {
		return errors.Join(err, n.Close())
	}
	<-ctx.Done()
	log.Info("shutting down")
	stopHTTP()
	return n.Close()
}

// masterEvents is the master's recent events for its status page.
func masterEvents(srv *master.Server) func() []statuspage.Event {
	return func() []statuspage.Event {
		var out []statuspage.Event
		for _, e := range srv.Events() {
			out = append(out, statuspage.Event{At: e.At, Kind: e.Kind, Text: e.Text})
		}
		return out
	}
}

// masterTenants is the master's tenants for its status page.
func masterTenants(srv *master.Server) func() []statuspage.Tenant {
	return func() []statuspage.Tenant {
		var out []statuspage.Tenant
		for _, t := range srv.TenantStats() {
			pt := statuspage.Tenant{Name: t.Tenant, Probed: t.Probed, Matched: t.Matched}
			for _, u := range t.Usage {
				pt.Tiers = append(pt.Tiers, statuspage.TenantTier{Tier: u.Tier.Name(), Bytes: u.Bytes, Objects: u.Objects,
					QuotaBytes: u.QuotaBytes, QuotaObjects: u.QuotaObjects})
			}
			out = append(out, pt)
		}
		return out
	}
}

func registered(n *store.Node) error {
	if n.Epoch() == 0 {
		return errors.New("not registered with a master")
	}
	return nil
}

func runUp(ctx context.Context, e *env, args []string) error {
	fs := newFlags("up", "[flags]", `Run an all-in-one local cluster: one master and one store in this process. With --masters N
or --stores M above 1, a local HA cluster instead: N masters and M stores, each its own process
with its own ports and data directory under --dir; Ctrl-C stops them all.`, e.stderr)
	nMasters := fs.Int("masters", 1, "masters of the local cluster (1, 3, 5: a raft group; each a process of its own when above 1)")
	nStores := fs.Int("stores", 1, "store nodes of the local cluster (each a process of its own when above 1)")
	dir := fs.String("dir", "tidepool-data", "directory for the master's raft log and snapshots")
	listen := fs.String("listen", defaultMaster, "master address (gRPC, and the same calls framed)")
	raftAddr := fs.String("raft", defaultRaft, "master raft address")
	engineAddr := fs.String("engine", defaultEngine, "store transfer engine address")
	dram := fs.String("dram", "1GiB", "size of the store's DRAM tier")
	ssd := fs.String("ssd", "1GiB", "size of the store's SSD tier, a file under --dir (0: none)")
	leaseTTL := fs.Duration("lease-ttl", master.DefaultLeaseTTL, "read lease granted with every get; for this long after it becomes leader the master evicts only what it made itself")
	var promoteAfter int
	promoteFlag(fs, &promoteAfter)
	var prefault bool
	prefaultFlag(fs, &prefault)
	plainRails := fs.Bool("plain-rails", false, "with --secure: the store also serves peers that move bytes without TLS (--plain-rails on theirs); the master's port stays TLS and every transfer still needs a ticket")
	var kv kvevents.Config
	kvEventsFlags(fs, &kv)
	secure := fs.Bool("secure", false, "TLS on every connection and a token or certificate for every call: makes a development CA, certificates and tokens under DIR/certs once (see tidepool certs init) and prints how to call the pool")
	d, err := parseDaemon(e, fs, args, "127.0.0.1:9090")
	if err != nil {
		return err
	}
	var certs devCerts
	if *secure {
		if certs, err = ensureDevCerts(filepath.Join(*dir, "certs"), d.log); err != nil {
			return err
		}
	}
	if *nMasters > 1 || *nStores > 1 {
		return runCluster(ctx, e, d, clusterSpec{
			masters: *nMasters, stores: *nStores, dir: *dir, listen: *listen, raft: *raftAddr, engine: *engineAddr,
			dram: *dram, ssd: *ssd, leaseTTL: *leaseTTL, promoteAfter: promoteAfter, prefault: prefault, certs: certs, plainRails: *plainRails,
			kvEvents: kv,
		})
	}
	log, reg := d.log, d.reg
	m := masterFlags{id: "m1", dir: *dir, listen: *listen, raftAddr: *raftAddr,
		leaseTTL: *leaseTTL, putTimeout: master.DefaultPutTimeout, nodeTTL: master.DefaultNodeTTL,
		highWatermark: master.DefaultHighWatermark, evictRatio: master.DefaultEvictRatio, promoteAfter: promoteAfter, kvEvents: kv}
	var storeCreds credentials
	if certs != "" {
		m.tls, m.tokens = certs.files(auth.Master), certs.path("tokens.json")
		storeCreds.files, storeCreds.plainRails = certs.files(auth.Store), *plainRails
	}
	srv, served, stopMaster, err := startMaster(&m, reg, log)
	if err != nil {
		return err
	}
	s := storeFlags{id: "store-0", listen: *engineAddr, tiers: listFlag{"dram:" + *dram}, indexSync: 5 * time.Second, prefault: prefault}
	if *ssd != "0" {
		s.tiers = append(s.tiers, "ssd:"+filepath.Join(*dir, "ssd")+":"+*ssd)
	}
	n, err := startStore(&s, []string{*listen}, &storeCreds, reg, log)
	if err != nil {
		return errors.Join(err, stopMaster())
	}
	page := &statuspage.Page{Title: "tidepool up (master m1, store store-0)", Status: srv.Status, Events: masterEvents(srv), Hits: srv.LookupHits, Tenants: masterTenants(srv),
		Node: s.id, Rails: n.Rails}
	stopHTTP, err := serveHTTP(d.http, reg, func() error {
		return errors.Join(leaderKnown(srv, m.id), registered(n))
	}, n.Rails, page, log)
	if err != nil {
		return errors.Join(err, n.Close(), stopMaster())
	}
	select {
	case <-n.Registered():
		if certs != "" {
			log.Info("tidepool is up, secure", "masters", *listen, "hint", certs.hint())
		} else {
			log.Info("tidepool is up", "masters", *listen, "hint", "tidepool put KEY FILE; tidepool get KEY")
		}
	case <-ctx.Done():
	}
	select {
	case <-ctx.Done():
	case <-served:
		log.Error("master gRPC server stopped; shutting down")
	case err := <-srv.Failed():
		return raftLogFailed(err)
	}
	log.Info("shutting down")
	stopHTTP()
	return errors.Join(n.Close(), stopMaster())
}
