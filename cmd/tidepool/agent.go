package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/client/agent"
	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
	"github.com/tidepool-kv/tidepool/statuspage"
	"github.com/tidepool-kv/tidepool/store"
	"github.com/tidepool-kv/tidepool/tiers"
)

const defaultAgentSocket = "/tmp/tidepool-agent.sock"

func runAgent(ctx context.Context, e *env, args []string) error {
	fs := newFlags("agent", "[flags]", "Run the per-host agent: local processes (an inference engine's Python side) reach the pool\n"+
		"through it over a unix socket, with values moving through shared memory.", e.stderr)
	socket := fs.String("socket", defaultAgentSocket, "unix socket to serve on, mode 0600: only this user's processes (who alone can map the sessions' /proc/PID/fd regions) connect")
	m := mastersFlag(fs, e)
	noShm := fs.Bool("no-shm", false, "move bytes between the agent and stores over TCP even when a store is on this host (sessions' regions are shared memory regardless)")
	idle := fs.Duration("session-idle", agent.DefaultSessionIdle, "end a session after this long without a request naming it")
	maxBytes := fs.String("max-session-bytes", "4GiB", "largest shared-memory region one session may open")
	maxSessions := fs.Int("max-sessions", agent.DefaultMaxSessions, "sessions open at once; Open beyond it answers RESOURCE_EXHAUSTED")
	perProcess := fs.Int("max-sessions-per-process", agent.DefaultMaxSessionsPerProcess, "sessions one process may hold; a process's sessions end within a quarter second of its exit")
	segment := fs.String("segment", "0", "DRAM this agent contributes to the pool as a store node of its own, as a Mooncake client's global_segment_size does (0: none)")
	segListen := fs.String("segment-listen", "127.0.0.1:0", "with --segment: the store's transfer engine address (port 0: any free port)")
	segAdvertise := fs.String("segment-advertise", "", "with --segment: the engine address peers dial (default: the address listened on)")
	host, _ := os.Hostname()
	segID := fs.String("segment-id", fmt.Sprintf("%s-agent-%d", host, os.Getpid()), "with --segment: the store node's id")
	stdinLife := fs.Bool("exit-with-stdin", false, "shut down when standard input reaches its end: the process that started the agent with a pipe on it exited or closed it")
	var cfg client.Config
	putFlags(fs, &cfg)
	d, err := parseDaemon(e, fs, args, "127.0.0.1:9092")
	if err != nil {
		return err
	}
	if *idle <= 0 {
		return fmt.Errorf("%w: --session-idle must be positive", errUsage)
	}
	if *maxSessions <= 0 || *perProcess <= 0 {
		return fmt.Errorf("%w: --max-sessions and --max-sessions-per-process must be positive", errUsage)
	}
	limit, err := tiers.ParseSize(*maxBytes)
	if err != nil || limit <= 0 {
		return fmt.Errorf("%w: --max-session-bytes %q: want a positive size such as 4GiB", errUsage, *maxBytes)
	}
	var segBytes int64
	if *segment != "0" {
		if segBytes, err = tiers.ParseSize(*segment); err != nil {
			return fmt.Errorf("%w: --segment %q: want a size such as 4GiB, or 0", errUsage, *segment)
		}
	}
	log := d.log
	if *stdinLife {
		ctx = untilEOF(ctx, e.stdin, log)
	}

	if segBytes > 0 && (m.files.Enabled() || m.tokenFile != "") {
		return fmt.Errorf("%w: --segment makes the agent a store node, which a secure pool admits only with a store's certificate or token, not the agent's client one: run `tidepool store` beside the agent instead", errUsage)
	}
	ln, err := listenUnix(*socket)
	if err != nil {
		return err
	}
	cfg.Masters, cfg.Logger = m.list(), log.With("component", "client")
	cfg.EngineConfig = engine.Config{NoShm: *noShm, Registerer: d.reg}
	if cfg.Credentials, err = m.masters(); err != nil {
		ln.Close()
		return err
	}
	if cfg.EngineConfig.PeerTLS, err = m.stores(); err != nil {
		ln.Close()
		return err
	}
	cfg.SharedBuffers = true // gets land in regions local processes write too
	c, err := client.New(cfg)
	if err != nil {
		ln.Close()
		return err
	}
	var node *store.Node
	if segBytes > 0 {
		st := storeFlags{id: *segID, listen: *segListen, advertise: *segAdvertise, tiers: listFlag{"dram:" + *segment}, indexSync: 5 * time.Second, copies: 4}
		if node, err = startStore(&st, cfg.Masters, &m.credentials, d.reg, log); err != nil {
			ln.Close()
			return errors.Join(err, c.Close())
		}
	}
	closeNode := func() error {
		if node == nil {
			return nil
		}
		return node.Close()
	}
	// Processes of a secure pool go through the agent alone: it holds the
	// credentials, so it announces no masters to call directly, and it asks
	// its callers for its token.
	announced := cfg.Masters
	if cfg.Credentials != (leaderconn.Credentials{}) {
		announced = nil
	}
	if cfg.Credentials.TLS != nil && cfg.Credentials.Token == "" {
		ln.Close()
		return errors.Join(fmt.Errorf("%w: an agent of a TLS pool needs --token-file: the processes that call it must present that token", errUsage), closeNode(), c.Close())
	}
	srv, err := agent.New(agent.Config{
		Client: c, Masters: announced, Token: cfg.Credentials.Token, SessionIdle: *idle, MaxSessionBytes: uint64(limit), MaxSessions: *maxSessions, MaxSessionsPerProcess: *perProcess,
		Logger: log.With("component", "agent"), Registerer: d.reg,
	})
	if err != nil {
		ln.Close()
		return errors.Join(err, closeNode(), c.Close())
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	stop := func() error {
		err := srv.Close() // closes ln, which removes the socket file
		return errors.Join(err, <-served, closeNode(), c.Close())
	}
	ready := func() error {
		if node != nil {
			if err := registered(node); err != nil {
				return err
			}
		}
		return masterReachable(ctx, c)
	}
	var rails func() []engine.RailInfo
	if node != nil {
		rails = node.Rails
	}
	page := &statuspage.Page{Title: "agent " + *socket, Status: c.Status, Rails: rails}
	if node != nil {
		page.Node = node.ID()
	}
	stopHTTP, err := serveHTTP(d.http, d.reg, ready, rails, page, log)
	if err != nil {
		return errors.Join(err, stop())
	}
	log.Info("agent serving", "socket", *socket, "masters", cfg.Masters, "session_idle", *idle, "max_session_bytes", limit, "segment", segBytes)
	select {
	case <-ctx.Done():
	case err := <-served:
		served <- err // for stop
		log.Error("agent stopped serving; shutting down", "err", err)
	}
	log.Info("shutting down")
	stopHTTP()
	return stop()
}

// listenUnix listens on a unix socket at path that only this user may
// connect to. A socket file left by an agent that died is replaced; one
// that still answers, or a file that is not a socket, is left alone.
func listenUnix(path string) (net.Listener, error) {
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("--socket %s exists and is not a socket", path)
		}
		conn, err := net.DialTimeout("unix", path, time.Second)
		if err == nil {
			conn.Close()
			return nil, fmt.Errorf("--socket %s: another process is listening on it", path)
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("--socket %s: %w", path, err)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("remove stale socket: %w", err)
		}
	}
	// Created 0600 from the start (no window before a chmod); nothing else
	// in the process creates files yet.
	old := syscall.Umask(0o177)
	ln, err := net.Listen("unix", path)
	syscall.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	return ln, nil
}

// untilEOF returns a context canceled once r reaches its end (or fails):
// the agent's lifeline to the process that started it.
func untilEOF(ctx context.Context, r io.Reader, log *slog.Logger) context.Context {
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		defer cancel()
		_, err := io.Copy(io.Discard, r)
		log.Info("standard input closed; shutting down", "err", err)
	}()
	return ctx
}

// masterReachable is the agent's readiness: a master leader answers.
func masterReachable(ctx context.Context, c *client.Client) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	_, err := c.Status(ctx)
	return err
}
