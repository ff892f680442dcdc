package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/client/agent"
	"github.com/tidepool-kv/tidepool/engine"
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
	var cfg client.Config
	putFlags(fs, &cfg)
	d, err := parseDaemon(e, fs, args, "127.0.0.1:9092")
	if err != nil {
		return err
	}
	if *idle <= 0 {
		return fmt.Errorf("%w: --session-idle must be positive", errUsage)
	}
	if *maxSessions <= 0 {
		return fmt.Errorf("%w: --max-sessions must be positive", errUsage)
	}
	limit, err := tiers.ParseSize(*maxBytes)
	if err != nil || limit <= 0 {
		return fmt.Errorf("%w: --max-session-bytes %q: want a positive size such as 4GiB", errUsage, *maxBytes)
	}
	log := d.log

	ln, err := listenUnix(*socket)
	if err != nil {
		return err
	}
	cfg.Masters, cfg.Logger = m.list(), log.With("component", "client")
	cfg.EngineConfig = engine.Config{NoShm: *noShm, Registerer: d.reg}
	cfg.SharedBuffers = true // gets land in regions local processes write too
	c, err := client.New(cfg)
	if err != nil {
		ln.Close()
		return err
	}
	srv, err := agent.New(agent.Config{
		Client: c, SessionIdle: *idle, MaxSessionBytes: uint64(limit), MaxSessions: *maxSessions,
		Logger: log.With("component", "agent"), Registerer: d.reg,
	})
	if err != nil {
		ln.Close()
		return errors.Join(err, c.Close())
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	stop := func() error {
		err := srv.Close() // closes ln, which removes the socket file
		return errors.Join(err, <-served, c.Close())
	}
	stopHTTP, err := serveHTTP(d.http, d.reg, func() error { return masterReachable(ctx, c) }, nil, log)
	if err != nil {
		return errors.Join(err, stop())
	}
	log.Info("agent serving", "socket", *socket, "masters", cfg.Masters, "session_idle", *idle, "max_session_bytes", limit)
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

// masterReachable is the agent's readiness: a master leader answers.
func masterReachable(ctx context.Context, c *client.Client) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	_, err := c.Status(ctx)
	return err
}
