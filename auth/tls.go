package auth

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"slices"
)

// Files names the PEM files of one end's TLS (the flags --tls-cert,
// --tls-key and --tls-ca). Zero means plaintext, as before TLS existed.
type Files struct {
	Cert, Key, CA string
}

// Enabled reports whether any file is named.
func (f Files) Enabled() bool { return f != Files{} }

func (f Files) load(needCert bool) (*x509.CertPool, []tls.Certificate, error) {
	if f.CA == "" {
		return nil, nil, errors.New("TLS: --tls-ca is needed with --tls-cert and --tls-key")
	}
	if (f.Cert == "") != (f.Key == "") {
		return nil, nil, errors.New("TLS: give --tls-cert and --tls-key together")
	}
	if needCert && f.Cert == "" {
		return nil, nil, errors.New("TLS: a daemon needs --tls-cert and --tls-key")
	}
	pem, err := os.ReadFile(f.CA)
	if err != nil {
		return nil, nil, fmt.Errorf("TLS: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, nil, fmt.Errorf("TLS: %s holds no PEM certificate", f.CA)
	}
	if f.Cert == "" {
		return pool, nil, nil
	}
	cert, err := tls.LoadX509KeyPair(f.Cert, f.Key)
	if err != nil {
		return nil, nil, fmt.Errorf("TLS: load %s and %s: %w", f.Cert, f.Key, err)
	}
	return pool, []tls.Certificate{cert}, nil
}

// ServerConfig is a daemon's side. A client's certificate is verified
// against the CA when one is presented; requireClientCert refuses a
// connection without one (raft between masters, the engine's rails,
// where every peer is a Tidepool process with a certificate).
func (f Files) ServerConfig(requireClientCert bool) (*tls.Config, error) {
	pool, certs, err := f.load(true)
	if err != nil {
		return nil, err
	}
	auth := tls.VerifyClientCertIfGiven
	if requireClientCert {
		auth = tls.RequireAndVerifyClientCert
	}
	// h2: gRPC clients insist on ALPN; framed and raft clients offer none.
	return &tls.Config{Certificates: certs, ClientCAs: pool, ClientAuth: auth, MinVersion: tls.VersionTLS13, NextProtos: []string{"h2"}}, nil
}

// RequireRole returns cfg (a ServerConfig) requiring of every client a
// certificate the CA signed for one of roles: raft between masters, where
// a token is no use.
func RequireRole(cfg *tls.Config, roles ...Role) *tls.Config {
	cfg = cfg.Clone()
	cfg.ClientAuth = tls.RequireAndVerifyClientCert
	cfg.VerifyConnection = func(cs tls.ConnectionState) error {
		id, ok := PeerIdentity(cs)
		if !ok || !slices.Contains(roles, id.Role) {
			return fmt.Errorf("TLS: the client's certificate is for %q, not a %v", id.Role, roles)
		}
		return nil
	}
	return cfg
}

// ClientConfig is a caller's side: the server must present a certificate
// the CA signed, for the name dialled, whose role is one of servers. The
// caller presents its own certificate, if it has one.
func (f Files) ClientConfig(servers ...Role) (*tls.Config, error) {
	pool, certs, err := f.load(false)
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		Certificates: certs, RootCAs: pool, MinVersion: tls.VersionTLS13,
		VerifyConnection: func(cs tls.ConnectionState) error {
			id, ok := PeerIdentity(cs)
			if !ok || !slices.Contains(servers, id.Role) {
				return fmt.Errorf("TLS: the server's certificate is for %q, not a %v", id.Role, servers)
			}
			return nil
		},
	}, nil
}

// PeerIdentity is who a verified certificate names: its role (the
// subject's first OrganizationalUnit), its tenant (a client's first
// Organization) and its common name. ok is false without a verified
// certificate or with an unknown role.
func PeerIdentity(cs tls.ConnectionState) (Identity, bool) {
	if len(cs.VerifiedChains) == 0 || len(cs.VerifiedChains[0]) == 0 {
		return Identity{}, false
	}
	leaf := cs.VerifiedChains[0][0]
	if len(leaf.Subject.OrganizationalUnit) == 0 {
		return Identity{}, false
	}
	role, err := parseRole(leaf.Subject.OrganizationalUnit[0])
	if err != nil {
		return Identity{}, false
	}
	id := Identity{Name: leaf.Subject.CommonName, Role: role}
	if role == Client {
		if len(leaf.Subject.Organization) == 0 || ValidTenant(leaf.Subject.Organization[0]) != nil || leaf.Subject.Organization[0] == "" {
			return Identity{}, false
		}
		id.Tenant = leaf.Subject.Organization[0]
	}
	return id, true
}
