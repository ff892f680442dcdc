package auth

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// TestAuthenticatorOverGRPC: a gRPC server behind TLS and an Authenticator
// whose policy lets clients call Check and only admins List (the health
// service stands in for Tidepool's). Each caller is named by its token or
// its certificate, refused with the right code otherwise, and counted.
func TestAuthenticatorOverGRPC(t *testing.T) {
	dir := t.TempDir()
	if _, err := InitCerts(dir, CertsOptions{Tenant: "a"}); err != nil {
		t.Fatal(err)
	}
	tokens, err := LoadTokens(filepath.Join(dir, "tokens.json"))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	a, err := NewAuthenticator(AuthenticatorConfig{Tokens: tokens, Registerer: reg, Policy: Policy{
		"/grpc.health.v1.Health/":      {Admin},
		"/grpc.health.v1.Health/Check": {Admin, Client},
	}})
	if err != nil {
		t.Fatal(err)
	}
	srvTLS, err := files(dir, Master).ServerConfig(false)
	if err != nil {
		t.Fatal(err)
	}
	var seen Identity
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(srvTLS)),
		grpc.ChainUnaryInterceptor(a.UnaryInterceptor(), func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			seen, _ = FromContext(ctx)
			return h(ctx, req)
		}))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)

	token := func(r Role) string {
		tok, err := ReadToken(filepath.Join(dir, string(r)+".token"))
		if err != nil {
			t.Fatal(err)
		}
		return tok
	}
	dial := func(f Files, tok string) healthpb.HealthClient {
		cfg, err := f.ClientConfig(Master)
		if err != nil {
			t.Fatal(err)
		}
		opts := []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(cfg))}
		if tok != "" {
			opts = append(opts, grpc.WithPerRPCCredentials(Token(tok, false)))
		}
		cc, err := grpc.NewClient(ln.Addr().String(), opts...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.Close() })
		return healthpb.NewHealthClient(cc)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	caOnly := Files{CA: filepath.Join(dir, "ca.crt")}
	check := func(c healthpb.HealthClient) error {
		_, err := c.Check(ctx, &healthpb.HealthCheckRequest{})
		return err
	}
	list := func(c healthpb.HealthClient) error {
		_, err := c.List(ctx, &healthpb.HealthListRequest{})
		return err
	}
	for _, tc := range []struct {
		name string
		c    healthpb.HealthClient
		call func(healthpb.HealthClient) error
		want codes.Code
		who  Identity
	}{
		{"client token", dial(caOnly, token(Client)), check, codes.OK, Identity{Name: "dev-client", Role: Client, Tenant: "a"}},
		{"client cert", dial(files(dir, Client), ""), check, codes.OK, Identity{Name: "tidepool-client", Role: Client, Tenant: "a"}},
		{"client token, admin method", dial(caOnly, token(Client)), list, codes.PermissionDenied, Identity{}},
		{"store token", dial(caOnly, token(Store)), check, codes.PermissionDenied, Identity{}},
		{"admin token", dial(caOnly, token(Admin)), list, codes.OK, Identity{Name: "dev-admin", Role: Admin}},
		{"token beats cert", dial(files(dir, Admin), token(Client)), list, codes.PermissionDenied, Identity{}},
		{"nothing", dial(caOnly, ""), check, codes.Unauthenticated, Identity{}},
		{"wrong token", dial(caOnly, "not-a-token-0123456789"), check, codes.Unauthenticated, Identity{}},
	} {
		seen = Identity{}
		err := tc.call(tc.c)
		if status.Code(err) != tc.want || seen != tc.who {
			t.Errorf("%s: %v, seen %+v; want %v as %+v", tc.name, err, seen, tc.want, tc.who)
		}
		if err != nil && strings.Contains(err.Error(), token(Client)) {
			t.Errorf("%s: the error names the token: %v", tc.name, err)
		}
	}
	for reason, want := range map[string]float64{reasonRole: 3, reasonNoCredential: 1, reasonUnknownToken: 1} {
		if got := testutil.ToFloat64(a.refused.WithLabelValues(reason)); got != want {
			t.Errorf("refused{reason=%s} = %v, want %v", reason, got, want)
		}
	}

	// A plaintext connection to the TLS port gets nowhere.
	cc, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	short, cancelShort := context.WithTimeout(ctx, 2*time.Second)
	defer cancelShort()
	if _, err := healthpb.NewHealthClient(cc).Check(short, &healthpb.HealthCheckRequest{}); status.Code(err) != codes.Unavailable && status.Code(err) != codes.DeadlineExceeded {
		t.Errorf("plaintext to a TLS server: %v", err)
	}
	// A token is never sent in the clear.
	clear, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithPerRPCCredentials(Token("0123456789abcdef", false)))
	if err == nil {
		defer clear.Close()
		_, err = healthpb.NewHealthClient(clear).Check(short, &healthpb.HealthCheckRequest{})
	}
	if err == nil || !strings.Contains(err.Error(), "transport") {
		t.Errorf("a token over plaintext: %v; want a refusal to send it", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "empty.token"), []byte("\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadToken(filepath.Join(dir, "empty.token")); err == nil {
		t.Error("an empty token file was read")
	}
}

func TestOpenAuthenticator(t *testing.T) {
	a, err := NewAuthenticator(AuthenticatorConfig{Open: true, Policy: Policy{"/s/": {Admin}}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, err := a.Check(context.Background(), "/s/M")
	if err != nil {
		t.Fatal(err)
	}
	if id, ok := FromContext(ctx); !ok || id.Role != Admin || id.Tenant != "" {
		t.Fatalf("open pool's caller: %+v %v", id, ok)
	}
	if _, err := a.Check(context.Background(), "/other/M"); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a method the policy does not name: %v", err)
	}
}

func TestHasToken(t *testing.T) {
	const token = "0123456789abcdef-agent"
	for _, tc := range []struct {
		name string
		md   metadata.MD
		want bool
	}{
		{"the token", metadata.Pairs("authorization", "Bearer "+token), true},
		{"no metadata", nil, false},
		{"another token", metadata.Pairs("authorization", "Bearer 0123456789abcdef-other"), false},
		{"a prefix of it", metadata.Pairs("authorization", "Bearer "+token[:10]), false},
		{"not bearer", metadata.Pairs("authorization", token), false},
		{"twice", metadata.Pairs("authorization", "Bearer "+token, "authorization", "Bearer "+token), false},
	} {
		ctx := context.Background()
		if tc.md != nil {
			ctx = metadata.NewIncomingContext(ctx, tc.md)
		}
		if got := HasToken(ctx, token); got != tc.want {
			t.Errorf("%s: HasToken %v, want %v", tc.name, got, tc.want)
		}
	}
}
