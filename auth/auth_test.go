package auth

import (
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func files(dir string, r Role) Files {
	return Files{Cert: filepath.Join(dir, string(r)+".crt"), Key: filepath.Join(dir, string(r)+".key"), CA: filepath.Join(dir, "ca.crt")}
}

// handshake runs a TLS server with srv on loopback and dials it with cli;
// it returns what the server saw of the client and the client's error.
func handshake(t *testing.T, srv, cli *tls.Config) (Identity, bool, error) {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", srv)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	type seen struct {
		id  Identity
		ok  bool
		err error
	}
	got := make(chan seen, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			got <- seen{err: err}
			return
		}
		defer c.Close()
		tc := c.(*tls.Conn)
		_ = tc.SetDeadline(time.Now().Add(10 * time.Second))
		err = tc.Handshake()
		if err == nil {
			_, err = tc.Write([]byte{1}) // the client waits for it
		}
		id, ok := PeerIdentity(tc.ConnectionState())
		got <- seen{id, ok, err}
	}()
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 10 * time.Second}, "tcp", ln.Addr().String(), cli)
	if err == nil {
		// TLS 1.3: the server verifies the client's certificate after the
		// client's handshake returns; the server's byte, or a refusal, tells.
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err = c.Read(make([]byte, 1))
		c.Close()
	}
	s := <-got
	if err == nil {
		err = s.err
	}
	return s.id, s.ok, err
}

func TestInitCertsHandshakes(t *testing.T) {
	dir := t.TempDir()
	written, err := InitCerts(dir, CertsOptions{Tenant: "a"})
	if err != nil {
		t.Fatal(err)
	}
	if len(written) != 14 {
		t.Fatalf("wrote %d files: %v", len(written), written)
	}
	for _, name := range []string{"ca.key", "admin.key", "client.token"} {
		st, err := os.Stat(filepath.Join(dir, name))
		if err != nil || st.Mode().Perm() != 0o600 {
			t.Fatalf("%s: %v, mode %v; want 0600", name, err, st.Mode())
		}
	}
	srv, err := files(dir, Master).ServerConfig(false)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		role       Role
		wantTenant string
	}{{Client, "a"}, {Admin, ""}, {Store, ""}, {Master, ""}} {
		cli, err := files(dir, tc.role).ClientConfig(Master)
		if err != nil {
			t.Fatal(err)
		}
		cli.ServerName = "127.0.0.1"
		id, ok, err := handshake(t, srv, cli)
		if err != nil || !ok || id.Role != tc.role || id.Tenant != tc.wantTenant {
			t.Fatalf("%s: identity %+v ok %v err %v", tc.role, id, ok, err)
		}
	}

	// No certificate: allowed when not required (a token may follow), and
	// then it names nobody; refused when required.
	anon, err := Files{CA: filepath.Join(dir, "ca.crt")}.ClientConfig(Master)
	if err != nil {
		t.Fatal(err)
	}
	anon.ServerName = "localhost"
	if _, ok, err := handshake(t, srv, anon); err != nil || ok {
		t.Fatalf("anonymous client: ok %v err %v; want a connection naming nobody", ok, err)
	}
	strict, err := files(dir, Master).ServerConfig(true)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := handshake(t, strict, anon); err == nil {
		t.Fatal("a server that requires a client certificate took a connection without one")
	}

	// A certificate of another CA is refused both ways.
	other := t.TempDir()
	if _, err := InitCerts(other, CertsOptions{}); err != nil {
		t.Fatal(err)
	}
	foreign, err := files(other, Client).ClientConfig(Master)
	if err != nil {
		t.Fatal(err)
	}
	foreign.RootCAs = anon.RootCAs // trusts our server, presents a foreign cert
	foreign.ServerName = "localhost"
	if _, _, err := handshake(t, strict, foreign); err == nil {
		t.Fatal("a client certificate of another CA was accepted")
	}
	foreignSrv, err := files(other, Master).ServerConfig(false)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := handshake(t, foreignSrv, anon); err == nil {
		t.Fatal("a server certificate of another CA was accepted")
	}

	// A store's certificate cannot pose as a master.
	storeSrv, err := files(dir, Store).ServerConfig(false)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := handshake(t, storeSrv, anon); err == nil || !strings.Contains(err.Error(), "not a [master]") {
		t.Fatalf("a store's certificate served as a master's: %v", err)
	}

	// The tokens written match the tokens file.
	tokens, err := LoadTokens(filepath.Join(dir, "tokens.json"))
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range []Role{Admin, Client, Store} {
		b, err := os.ReadFile(filepath.Join(dir, string(r)+".token"))
		if err != nil {
			t.Fatal(err)
		}
		id, ok := tokens.Lookup(strings.TrimSpace(string(b)))
		if !ok || id.Role != r || (r == Client) != (id.Tenant == "a") {
			t.Fatalf("token of %s: %+v %v", r, id, ok)
		}
	}
	if _, ok := tokens.Lookup("guess"); ok {
		t.Fatal("a guess is a token")
	}

	// Never overwrites.
	if _, err := InitCerts(dir, CertsOptions{}); err == nil || !strings.Contains(err.Error(), "exists") {
		t.Fatalf("InitCerts into a used directory: %v", err)
	}
}

func TestFilesErrors(t *testing.T) {
	dir := t.TempDir()
	if _, err := InitCerts(dir, CertsOptions{}); err != nil {
		t.Fatal(err)
	}
	f := files(dir, Master)
	for _, tc := range []struct {
		name string
		f    Files
		want string
	}{
		{"no CA", Files{Cert: f.Cert, Key: f.Key}, "--tls-ca is needed"},
		{"cert without key", Files{Cert: f.Cert, CA: f.CA}, "together"},
		{"CA not PEM", Files{Cert: f.Cert, Key: f.Key, CA: f.Key + ".missing"}, "no such file"},
		{"key of another cert", Files{Cert: f.Cert, Key: filepath.Join(dir, "admin.key"), CA: f.CA}, "private key does not match"},
	} {
		if _, err := tc.f.ServerConfig(false); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want %q", tc.name, err, tc.want)
		}
	}
	if _, err := (Files{CA: f.CA}).ServerConfig(false); err == nil || !strings.Contains(err.Error(), "a daemon needs") {
		t.Errorf("server without a certificate: %v", err)
	}
}

func TestTokensFile(t *testing.T) {
	sum := sha256.Sum256([]byte("0123456789abcdef-admin"))
	good := `{"tokens": [
	  {"name": "ops", "role": "admin", "sha256": "` + hex.EncodeToString(sum[:]) + `"},
	  {"name": "a", "role": "client", "tenant": "a", "token": "0123456789abcdef-a"},
	  {"name": "s", "role": "store", "token": "0123456789abcdef-s"}
	]}`
	path := filepath.Join(t.TempDir(), "tokens.json")
	write := func(s string) {
		if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(good)
	tokens, err := LoadTokens(path)
	if err != nil {
		t.Fatal(err)
	}
	for token, want := range map[string]Identity{
		"0123456789abcdef-admin": {Name: "ops", Role: Admin},
		"0123456789abcdef-a":     {Name: "a", Role: Client, Tenant: "a"},
		"0123456789abcdef-s":     {Name: "s", Role: Store},
	} {
		if id, ok := tokens.Lookup(token); !ok || id != want {
			t.Errorf("Lookup(%q) = %+v, %v; want %+v", token, id, ok, want)
		}
	}
	for _, tc := range []struct{ name, file, want string }{
		{"not JSON", `{`, "unexpected EOF"},
		{"unknown field", `{"tokens": [], "extra": 1}`, "unknown field"},
		{"no name", `{"tokens": [{"role": "admin", "token": "0123456789abcdef"}]}`, "no name"},
		{"bad role", `{"tokens": [{"name": "x", "role": "root", "token": "0123456789abcdef"}]}`, "unknown role"},
		{"client without tenant", `{"tokens": [{"name": "x", "role": "client", "token": "0123456789abcdef"}]}`, "needs a tenant"},
		{"admin with tenant", `{"tokens": [{"name": "x", "role": "admin", "tenant": "a", "token": "0123456789abcdef"}]}`, "only a client"},
		{"bad tenant", `{"tokens": [{"name": "x", "role": "client", "tenant": "a/b", "token": "0123456789abcdef"}]}`, "only letters"},
		{"short token", `{"tokens": [{"name": "x", "role": "admin", "token": "short"}]}`, "at least 16"},
		{"token and sha", `{"tokens": [{"name": "x", "role": "admin", "token": "0123456789abcdef", "sha256": "00"}]}`, "exactly one"},
		{"bad sha", `{"tokens": [{"name": "x", "role": "admin", "sha256": "zz"}]}`, "hex digits"},
		{"duplicate name", `{"tokens": [{"name": "x", "role": "admin", "token": "0123456789abcdef"}, {"name": "x", "role": "admin", "token": "0123456789abcdeg"}]}`, "used twice"},
		{"duplicate token", `{"tokens": [{"name": "x", "role": "admin", "token": "0123456789abcdef"}, {"name": "y", "role": "store", "token": "0123456789abcdef"}]}`, "same token"},
	} {
		write(tc.file)
		err := tokens.Reload()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want %q", tc.name, err, tc.want)
		}
		// A bad file changes nothing.
		if id, ok := tokens.Lookup("0123456789abcdef-a"); !ok || id.Tenant != "a" {
			t.Fatalf("%s: the table in use changed: %+v %v", tc.name, id, ok)
		}
	}
	write(`{"tokens": []}`)
	if err := tokens.Reload(); err != nil || tokens.Len() != 0 {
		t.Fatalf("reload to an empty table: %v, %d tokens", err, tokens.Len())
	}
	if _, err := LoadTokens(path + ".missing"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing file: %v", err)
	}
}
