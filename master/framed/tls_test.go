package framed

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/auth"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// pki is a development CA's files, and a second CA's, for foreign
// certificates.
type pki struct{ dir, foreign string }

func testPKI(t *testing.T) pki {
	t.Helper()
	p := pki{dir: t.TempDir(), foreign: t.TempDir()}
	for _, dir := range []string{p.dir, p.foreign} {
		if _, err := auth.InitCerts(dir, auth.CertsOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	return p
}

func (p pki) files(dir string, role auth.Role) auth.Files {
	return auth.Files{Cert: filepath.Join(dir, string(role)+".crt"), Key: filepath.Join(dir, string(role)+".key"), CA: filepath.Join(p.dir, "ca.crt")}
}

// startTLSServer is startServer behind TLS: gRPC through TLSCredentials.
// seen receives each framed or gRPC call's peer and metadata.
func startTLSServer(t *testing.T, cfg *tls.Config, seen chan<- context.Context, failed func(net.Addr, error)) *testServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	intercept := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		select {
		case seen <- ctx:
		default:
		}
		return h(ctx, req)
	}
	s := &testServer{addr: ln.Addr().String(), grpc: grpc.NewServer(grpc.Creds(TLSCredentials()), grpc.UnaryInterceptor(intercept)),
		framed: NewServer(intercept, nil), done: make(chan struct{})}
	s.framed.RequireTLS(cfg, failed)
	for _, r := range []grpc.ServiceRegistrar{s.grpc, s.framed} {
		pb.RegisterMasterServer(r, &testMaster{})
	}
	split := s.framed.Split(ln)
	go func() {
		defer close(s.done)
		_ = s.grpc.Serve(split)
	}()
	t.Cleanup(s.stop)
	return s
}

// TestTLS: framed and gRPC calls through a TLS listener see the client's
// certificate and the hello's metadata; a plaintext client, a foreign CA
// and a refused client certificate each fail at once with Unauthenticated
// and a message that says which, without falling back to gRPC.
func TestTLS(t *testing.T) {
	p := testPKI(t)
	srvCfg, err := p.files(p.dir, auth.Master).ServerConfig(false)
	if err != nil {
		t.Fatal(err)
	}
	seen := make(chan context.Context, 1)
	var failures atomic.Int64
	s := startTLSServer(t, srvCfg, seen, func(net.Addr, error) { failures.Add(1) })
	ctx := context.Background()
	exists := func(c *Client) error {
		_, err := pb.NewMasterClient(c).Exists(ctx, &pb.KeysRequest{Keys: []string{"y"}})
		return err
	}

	clientCfg, err := p.files(p.dir, auth.Client).ClientConfig(auth.Master)
	if err != nil {
		t.Fatal(err)
	}
	fb := &failingConn{}
	c := NewClient(s.addr, fb, Credentials{TLS: clientCfg, Metadata: metadata.Pairs("authorization", "Bearer x")})
	defer c.Close()
	if err := exists(c); err != nil {
		t.Fatalf("framed over TLS: %v", err)
	}
	got := <-seen
	pr, _ := peer.FromContext(got)
	info, ok := pr.AuthInfo.(credentials.TLSInfo)
	if !ok {
		t.Fatalf("framed call's peer has no TLS info: %#v", pr.AuthInfo)
	}
	if id, ok := auth.PeerIdentity(info.State); !ok || id.Role != auth.Client {
		t.Errorf("framed call's peer identity %+v %v, want a client", id, ok)
	}
	if md, _ := metadata.FromIncomingContext(got); len(md.Get("authorization")) != 1 || md.Get("authorization")[0] != "Bearer x" {
		t.Errorf("framed call's metadata %v, want the hello's", md)
	}
	if fb.used.Load() != 0 {
		t.Errorf("the fallback carried %d calls", fb.used.Load())
	}

	// gRPC through the same listener.
	gc, err := grpc.NewClient(s.addr, grpc.WithTransportCredentials(credentials.NewTLS(clientCfg)))
	if err != nil {
		t.Fatal(err)
	}
	defer gc.Close()
	if _, err := pb.NewMasterClient(gc).Exists(ctx, &pb.KeysRequest{Keys: []string{"y"}}); err != nil {
		t.Fatalf("gRPC over TLS: %v", err)
	}
	pr, _ = peer.FromContext(<-seen)
	if info, ok := pr.AuthInfo.(credentials.TLSInfo); !ok {
		t.Errorf("gRPC call's peer has no TLS info: %#v", pr.AuthInfo)
	} else if id, ok := auth.PeerIdentity(info.State); !ok || id.Role != auth.Client {
		t.Errorf("gRPC call's peer identity %+v %v, want a client", id, ok)
	}

	foreignCA, err := auth.Files{CA: filepath.Join(p.foreign, "ca.crt")}.ClientConfig(auth.Master)
	if err != nil {
		t.Fatal(err)
	}
	foreignCert, err := auth.Files{Cert: filepath.Join(p.foreign, "client.crt"), Key: filepath.Join(p.foreign, "client.key"),
		CA: filepath.Join(p.dir, "ca.crt")}.ClientConfig(auth.Master)
	if err != nil {
		t.Fatal(err)
	}
	expired := clientConfigWith(t, expiredClientCert(t, p.dir), filepath.Join(p.dir, "ca.crt"))
	for _, tc := range []struct {
		name  string
		creds Credentials
		want  string
	}{
		{"plaintext", Credentials{}, "serves TLS only"},
		{"foreign CA", Credentials{TLS: foreignCA}, "unknown authority"},
		{"foreign client certificate", Credentials{TLS: foreignCert}, "refused this client's certificate"},
		{"expired client certificate", Credentials{TLS: expired}, "refused this client's certificate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := failures.Load()
			fb := &failingConn{}
			c := NewClient(s.addr, fb, tc.creds)
			defer c.Close()
			err := exists(c)
			if status.Code(err) != codes.Unauthenticated || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want Unauthenticated saying %q", err, tc.want)
			}
			if fb.used.Load() != 0 {
				t.Errorf("the fallback carried %d calls", fb.used.Load())
			}
			// The server may learn of it after the client gave up.
			for deadline := time.Now().Add(5 * time.Second); failures.Load() == before && time.Now().Before(deadline); {
				time.Sleep(10 * time.Millisecond)
			}
			if failures.Load() == before {
				t.Error("the server did not report the refused connection")
			}
		})
	}
}

// expiredClientCert is a client certificate of tenant "default" that dir's
// CA signed and that expired an hour ago.
func expiredClientCert(t *testing.T, dir string) tls.Certificate {
	t.Helper()
	ca, err := tls.LoadX509KeyPair(filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key"))
	if err != nil {
		t.Fatal(err)
	}
	caCert, err := x509.ParseCertificate(ca.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: "expired", OrganizationalUnit: []string{"client"}, Organization: []string{"default"}},
		NotBefore:    time.Now().Add(-48 * time.Hour), NotAfter: time.Now().Add(-time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, ca.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// clientConfigWith is a client's TLS presenting cert and trusting caFile.
func clientConfigWith(t *testing.T, cert tls.Certificate, caFile string) *tls.Config {
	t.Helper()
	cfg, err := auth.Files{CA: caFile}.ClientConfig(auth.Master)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Certificates = []tls.Certificate{cert}
	return cfg
}
