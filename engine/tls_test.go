package engine

import (
	"bytes"
	"crypto/tls"
	"errors"
	"path/filepath"
	"testing"

	"github.com/tidepool-kv/tidepool/auth"
)

// TestRailsTLS: a rail with TLS serves a client that trusts its CA, in
// both directions, and refuses one that does not and one in plaintext;
// with AllowPlaintext it serves the plaintext one too.
func TestRailsTLS(t *testing.T) {
	dir := t.TempDir()
	if _, err := auth.InitCerts(dir, auth.CertsOptions{}); err != nil {
		t.Fatal(err)
	}
	foreign := t.TempDir()
	if _, err := auth.InitCerts(foreign, auth.CertsOptions{}); err != nil {
		t.Fatal(err)
	}
	files := func(ca string) auth.Files {
		return auth.Files{Cert: filepath.Join(dir, "store.crt"), Key: filepath.Join(dir, "store.key"), CA: filepath.Join(ca, "ca.crt")}
	}
	srvTLS, err := files(dir).ServerConfig(false)
	if err != nil {
		t.Fatal(err)
	}
	trusting, err := auth.Files{CA: filepath.Join(dir, "ca.crt")}.ClientConfig(auth.Store)
	if err != nil {
		t.Fatal(err)
	}
	distrusting, err := auth.Files{CA: filepath.Join(foreign, "ca.crt")}.ClientConfig(auth.Store)
	if err != nil {
		t.Fatal(err)
	}
	for _, allow := range []bool{false, true} {
		mem := make([]byte, 1<<20)
		p := startPeer(t, Config{TLS: srvTLS, AllowPlaintext: allow}, NewMemSegment("dram", mem))
		for _, tc := range []struct {
			name string
			tls  *tls.Config
			ok   bool
		}{
			{"trusting", trusting, true},
			{"foreign CA", distrusting, false},
			{"plaintext", nil, allow},
		} {
			c := newClient(t, Config{PeerTLS: tc.tls, DialTimeout: 2e9})
			value := bytes.Repeat([]byte(tc.name), 1000)
			_, werr := run(t, c, func(b *Batch) *Task {
				return b.Write(value, Target{Endpoint: p.addr, Segment: "dram"}, 4096, Options{})
			})
			got := make([]byte, len(value))
			_, rerr := run(t, c, func(b *Batch) *Task {
				return b.Read(got, Target{Endpoint: p.addr, Segment: "dram"}, 4096, Options{})
			})
			switch {
			case tc.ok && (werr != nil || rerr != nil || !bytes.Equal(got, value)):
				t.Errorf("allow plaintext %v, %s: write %v, read %v, same bytes %v", allow, tc.name, werr, rerr, bytes.Equal(got, value))
			case !tc.ok && (werr == nil || rerr == nil):
				t.Errorf("allow plaintext %v, %s: write %v, read %v; want both refused", allow, tc.name, werr, rerr)
			case !tc.ok && !errors.Is(werr, ErrUnavailable) && tc.tls != nil:
				t.Errorf("allow plaintext %v, %s: %v, want ErrUnavailable", allow, tc.name, werr)
			}
		}
	}
}
