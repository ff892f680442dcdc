package auth

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// Policy says which roles may call each method: keys are full methods
// ("/tidepool.Admin/Drain") or services ("/tidepool.Admin/"), the exact
// method first. A method it does not name is refused to everyone.
type Policy map[string][]Role

func (p Policy) roles(method string) []Role {
	if r, ok := p[method]; ok {
		return r
	}
	if i := strings.LastIndexByte(method, '/'); i > 0 {
		return p[method[:i+1]]
	}
	return nil
}

// anonymous is the caller of a pool without credentials: allowed
// everything, in the pool's only tenant, as before authentication existed.
func anonymous() Identity { return Identity{Name: "anonymous", Role: Admin} }

// Authenticator names the caller of each call and checks it against a
// Policy. With neither tokens nor verified certificates (Open), every
// caller is an anonymous admin.
type Authenticator struct {
	tokens *Tokens
	open   bool
	policy Policy
	log    *slog.Logger

	refused *prometheus.CounterVec
	logged  sync.Map // reason -> time of the last log line, so a flood logs little
}

// AuthenticatorConfig configures an Authenticator.
type AuthenticatorConfig struct {
	// Tokens, if set, are the bearer tokens callers may present.
	Tokens *Tokens
	// Open admits callers without a credential as an anonymous admin: a pool with
	// neither a tokens file nor TLS.
	Open   bool
	Policy Policy
	// Registerer, if set, gets tidepool_auth_refused_total.
	Registerer prometheus.Registerer
	Logger     *slog.Logger
}

// NewAuthenticator returns an Authenticator.
func NewAuthenticator(cfg AuthenticatorConfig) (*Authenticator, error) {
	a := &Authenticator{tokens: cfg.Tokens, open: cfg.Open, policy: cfg.Policy, log: cfg.Logger}
	if a.log == nil {
		a.log = slog.New(slog.DiscardHandler)
	}
	a.refused = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tidepool_auth_refused_total",
		Help: "Calls refused by authentication (no credential, an unknown token) or authorization (a role that may not call the method).",
	}, []string{"reason"})
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(a.refused); err != nil {
			return nil, fmt.Errorf("auth: register metrics: %w", err)
		}
	}
	return a, nil
}

// Reasons a call is refused, the values of the metric's label.
const (
	reasonNoCredential = "no_credential"
	reasonUnknownToken = "unknown_token"
	reasonNoTokens     = "no_tokens_file"
	reasonRole         = "role"
	reasonTLS          = "tls"
)

// Check names the caller of method from ctx (a bearer token in the
// "authorization" metadata, else a verified client certificate) and
// checks the policy. It returns ctx with the Identity, or a gRPC status
// error (Unauthenticated, PermissionDenied) that names no secret.
func (a *Authenticator) Check(ctx context.Context, method string) (context.Context, error) {
	id, err := a.identify(ctx)
	if err != nil {
		return nil, err
	}
	if !slices.Contains(a.policy.roles(method), id.Role) {
		return nil, a.refuse(ctx, reasonRole, codes.PermissionDenied,
			fmt.Sprintf("%s (role %s) may not call %s", id.Name, id.Role, method))
	}
	return WithIdentity(ctx, id), nil
}

func (a *Authenticator) identify(ctx context.Context) (Identity, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if vals := md.Get(authorization); len(vals) > 0 {
		token, ok := strings.CutPrefix(vals[0], bearerPrefix)
		switch {
		case a.tokens == nil:
			return Identity{}, a.refuse(ctx, reasonNoTokens, codes.Unauthenticated, "a token was given, but this server has no tokens file")
		case !ok:
			return Identity{}, a.refuse(ctx, reasonUnknownToken, codes.Unauthenticated, `the authorization metadata is not "Bearer TOKEN"`)
		}
		id, ok := a.tokens.Lookup(token)
		if !ok {
			return Identity{}, a.refuse(ctx, reasonUnknownToken, codes.Unauthenticated, "unknown token")
		}
		return id, nil
	}
	if p, ok := peer.FromContext(ctx); ok {
		if info, ok := p.AuthInfo.(credentials.TLSInfo); ok {
			if id, ok := PeerIdentity(info.State); ok {
				return id, nil
			}
		}
	}
	if a.open {
		return anonymous(), nil
	}
	return Identity{}, a.refuse(ctx, reasonNoCredential, codes.Unauthenticated, "no token and no client certificate")
}

// HandshakeFailed counts and logs a connection refused before any call:
// a TLS handshake that failed (no certificate the CA signed, an expired
// one, plaintext on a TLS port).
func (a *Authenticator) HandshakeFailed(from net.Addr, err error) {
	a.count(reasonTLS, from, err.Error())
}

// refuse counts and logs a refusal (at most once a second per reason) and
// returns its status.
func (a *Authenticator) refuse(ctx context.Context, reason string, code codes.Code, msg string) error {
	var from net.Addr
	if p, ok := peer.FromContext(ctx); ok {
		from = p.Addr
	}
	a.count(reason, from, msg)
	return status.Error(code, msg)
}

func (a *Authenticator) count(reason string, from net.Addr, msg string) {
	a.refused.WithLabelValues(reason).Inc()
	now := time.Now()
	if last, ok := a.logged.Load(reason); !ok || now.Sub(last.(time.Time)) > time.Second {
		a.logged.Store(reason, now)
		addr := "unknown"
		if from != nil {
			addr = from.String()
		}
		a.log.Warn("refused a call", "reason", reason, "from", addr, "why", msg)
	}
}

// UnaryInterceptor checks every unary call.
func (a *Authenticator) UnaryInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		ctx, err := a.Check(ctx, info.FullMethod)
		if err != nil {
			return nil, err
		}
		return h(ctx, req)
	}
}

// StreamInterceptor checks every stream.
func (a *Authenticator) StreamInterceptor() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		ctx, err := a.Check(ss.Context(), info.FullMethod)
		if err != nil {
			return err
		}
		return h(srv, &identified{ss, ctx})
	}
}

type identified struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *identified) Context() context.Context { return s.ctx }

// Token is a caller's bearer token as gRPC per-call credentials. Sent only
// over TLS unless insecure is set (a test, or a loopback-only pool).
func Token(token string, insecure bool) credentials.PerRPCCredentials {
	return bearer{token, !insecure}
}

type bearer struct {
	token     string
	secureReq bool
}

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{authorization: bearerPrefix + b.token}, nil
}

// HasToken reports whether an incoming call carries token as its bearer
// token: the agent's check of its callers. The comparison is of SHA-256
// sums in constant time, so its time says nothing of how much of a guess
// was right.
func HasToken(ctx context.Context, token string) bool {
	md, _ := metadata.FromIncomingContext(ctx)
	vals := md.Get(authorization)
	if len(vals) != 1 {
		return false
	}
	got, ok := strings.CutPrefix(vals[0], bearerPrefix)
	want, have := sha256.Sum256([]byte(token)), sha256.Sum256([]byte(got))
	return ok && subtle.ConstantTimeCompare(want[:], have[:]) == 1
}

// BearerMetadata is token as the metadata a server reads it from (framed
// connections send it once, in their hello).
func BearerMetadata(token string) metadata.MD {
	return metadata.Pairs(authorization, bearerPrefix+token)
}

// The metadata of a bearer token.
const (
	authorization = "authorization"
	bearerPrefix  = "Bearer "
)

func (b bearer) RequireTransportSecurity() bool { return b.secureReq }

// ReadToken reads a token file (ROLE.token of InitCerts): the token is its
// first line, without surrounding space.
func ReadToken(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("token file: %w", err)
	}
	line, _, _ := strings.Cut(string(b), "\n")
	token := strings.TrimSpace(line)
	if token == "" {
		return "", fmt.Errorf("token file %s is empty", path)
	}
	return token, nil
}
