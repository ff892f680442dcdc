package master

import (
	"context"
	"crypto/tls"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/tidepool-kv/tidepool/auth"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Policy is which roles may call each of the master's methods: clients
// (and admins) the data path, stores the registry, admins the Admin
// service; everyone Status and Members, which leaderconn asks to find the
// leader; masters announce themselves through AddMember.
func Policy() auth.Policy {
	all := []auth.Role{auth.Admin, auth.Client, auth.Store, auth.Master}
	svc := func(d grpc.ServiceDesc) string { return "/" + d.ServiceName + "/" }
	m, r, a := svc(pb.Master_ServiceDesc), svc(pb.Registry_ServiceDesc), svc(pb.Admin_ServiceDesc)
	return auth.Policy{
		m:               {auth.Client, auth.Admin},
		m + "Status":    all,
		r:               {auth.Store},
		a:               {auth.Admin},
		a + "Members":   all,
		a + "AddMember": {auth.Admin, auth.Master},
	}
}

// peerCreds are what this master shows another.
func (s *Server) peerCreds() leaderconn.Credentials {
	return leaderconn.Credentials{TLS: s.cfg.Security.PeerTLS, Token: s.cfg.Security.PeerToken}
}

// authorize names the caller of a unary call (nil auth: the anonymous
// admin of a pool without security).
func (s *Server) authorize(ctx context.Context, method string) (context.Context, error) {
	if s.auth == nil {
		return ctx, nil
	}
	actx, err := s.auth.Check(ctx, method)
	if err != nil {
		return ctx, err
	}
	return actx, nil
}

// handshakeTimeout bounds a raft connection's TLS handshake.
const handshakeTimeout = 10 * time.Second

// raftTLS is the TLS of raft's stream layer: both ends present a
// master's certificate.
type raftTLS struct {
	server, client *tls.Config
}

func newRaftTLS(sec Security) *raftTLS {
	if sec.TLS == nil {
		return nil
	}
	return &raftTLS{server: auth.RequireRole(sec.TLS, auth.Master), client: sec.PeerTLS}
}

// accepted wraps an accepted connection; its handshake runs on its first
// read or write, within handshakeTimeout, so a peer that never finishes
// one holds only its own connection's goroutine, and not for long.
func (t *raftTLS) accepted(conn net.Conn) net.Conn {
	return &lazyHandshake{Conn: tls.Server(conn, t.server)}
}

// dialled shakes hands on a dialled connection before raft uses it.
func (t *raftTLS) dialled(conn net.Conn, host string, timeout time.Duration) (net.Conn, error) {
	cfg := t.client.Clone()
	if cfg.ServerName == "" {
		cfg.ServerName = host
	}
	tc := tls.Client(conn, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := tc.HandshakeContext(ctx); err != nil {
		_ = conn.Close()
		return nil, err
	}
	return tc, nil
}

type lazyHandshake struct {
	*tls.Conn
	once sync.Once
	err  error
}

func (c *lazyHandshake) handshake() error {
	c.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), handshakeTimeout)
		defer cancel()
		c.err = c.Conn.HandshakeContext(ctx)
	})
	return c.err
}

func (c *lazyHandshake) Read(p []byte) (int, error) {
	if err := c.handshake(); err != nil {
		return 0, err
	}
	return c.Conn.Read(p)
}

func (c *lazyHandshake) Write(p []byte) (int, error) {
	if err := c.handshake(); err != nil {
		return 0, err
	}
	return c.Conn.Write(p)
}
