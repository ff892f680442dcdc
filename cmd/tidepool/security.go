package main

import (
	"crypto/tls"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/tidepool-kv/tidepool/auth"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
)

// tlsFlags are --tls-cert, --tls-key and --tls-ca, of every command that
// serves or calls a daemon.
func tlsFlags(fs *flag.FlagSet, f *auth.Files) {
	fs.StringVar(&f.Cert, "tls-cert", "", "PEM certificate this process presents (a daemon's, or a client's for mutual TLS); with --tls-key")
	fs.StringVar(&f.Key, "tls-key", "", "PEM private key of --tls-cert")
	fs.StringVar(&f.CA, "tls-ca", "", "PEM CA that signs the pool's certificates: set, every connection is TLS (tidepool certs init makes one)")
}

// credentials are what a caller of the masters shows them: the TLS of
// --tls-* and the token of --token-file.
type credentials struct {
	files      auth.Files
	tokenFile  string
	plainRails bool
}

func (c *credentials) register(fs *flag.FlagSet) {
	tlsFlags(fs, &c.files)
	fs.StringVar(&c.tokenFile, "token-file", "", "file whose first line is the bearer token presented to the masters (tidepool certs init writes ROLE.token)")
	fs.BoolVar(&c.plainRails, "plain-rails", false, "with --tls-ca: move bytes to and from stores without TLS (a store: serve such peers too); every transfer still needs the master's ticket, but its bytes travel in the clear")
}

// masters is the client side of calls to the masters, which present a
// master's certificate.
func (c *credentials) masters() (leaderconn.Credentials, error) {
	var creds leaderconn.Credentials
	if c.files.Enabled() {
		cfg, err := c.files.ClientConfig(auth.Master)
		if err != nil {
			return creds, fmt.Errorf("%w: %v", errUsage, err)
		}
		creds.TLS = cfg
	}
	if c.tokenFile != "" {
		token, err := auth.ReadToken(c.tokenFile)
		if err != nil {
			return creds, fmt.Errorf("%w: --token-file: %v", errUsage, err)
		}
		creds.Token = token
	}
	return creds, nil
}

// stores is the client side of the engine's rails to store nodes (nil:
// plaintext).
func (c *credentials) stores() (*tls.Config, error) {
	if !c.files.Enabled() || c.plainRails {
		return nil, nil
	}
	cfg, err := c.files.ClientConfig(auth.Store)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errUsage, err)
	}
	return cfg, nil
}

// devCerts is the directory of the development CA, certificates and
// tokens that `up --secure` makes once (under --dir) and reuses after.
type devCerts string

// ensureDevCerts makes them in dir unless its CA is there already.
func ensureDevCerts(dir string, log *slog.Logger) (devCerts, error) {
	if _, err := os.Stat(filepath.Join(dir, "ca.crt")); err == nil {
		return devCerts(dir), nil
	}
	if _, err := auth.InitCerts(dir, auth.CertsOptions{}); err != nil {
		return "", fmt.Errorf("--secure: %w", err)
	}
	log.Info("wrote a development CA, certificates and tokens", "dir", dir)
	return devCerts(dir), nil
}

func (d devCerts) path(name string) string { return filepath.Join(string(d), name) }

// files are role's certificate, key and the CA.
func (d devCerts) files(role auth.Role) auth.Files {
	return auth.Files{Cert: d.path(string(role) + ".crt"), Key: d.path(string(role) + ".key"), CA: d.path("ca.crt")}
}

// flags are the command-line flags that give a process role's files.
func (d devCerts) flags(role auth.Role) []string {
	f := d.files(role)
	return []string{"--tls-cert", f.Cert, "--tls-key", f.Key, "--tls-ca", f.CA}
}

// hint tells a user how a command reaches the secure pool.
func (d devCerts) hint() string {
	return fmt.Sprintf("tidepool status --tls-ca %s --token-file %s (an admin's token; %s is a client's)",
		d.path("ca.crt"), d.path("admin.token"), d.path("client.token"))
}
