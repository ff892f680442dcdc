package auth

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// certValidity is how long InitCerts's certificates last: a development
// CA, renewed by running it again in a new directory.
const certValidity = 365 * 24 * time.Hour

// CertsOptions say what InitCerts makes.
type CertsOptions struct {
	// Hosts are the names and addresses the master and store certificates
	// are valid for, beside localhost, 127.0.0.1 and ::1.
	Hosts []string
	// Tenant is the tenant of the client certificate and token.
	Tenant string
	// Now is the start of validity (time.Now if zero).
	Now time.Time
}

// InitCerts writes, in dir (created, and empty of the files it writes): a
// development CA (ca.crt, ca.key); a key and certificate for each role
// (admin, client, store, master: ROLE.crt, ROLE.key); a token for each of
// admin, client and store (ROLE.token, mode 0600); and tokens.json, the
// tokens file the masters read, which holds only the tokens' SHA-256. It
// returns the paths written.
func InitCerts(dir string, o CertsOptions) ([]string, error) {
	if o.Tenant == "" {
		o.Tenant = "default"
	}
	if err := ValidTenant(o.Tenant); err != nil {
		return nil, err
	}
	if o.Now.IsZero() {
		o.Now = time.Now()
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	w := &certWriter{dir: dir}
	for _, name := range []string{"ca.crt", "ca.key", "tokens.json"} {
		w.check(name)
	}
	for _, r := range []Role{Admin, Client, Store, Master} {
		w.check(string(r) + ".crt")
		w.check(string(r) + ".key")
		if r != Master {
			w.check(string(r) + ".token")
		}
	}
	if w.err != nil {
		return nil, w.err
	}

	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	caTmpl := &x509.Certificate{
		SerialNumber: serial(), Subject: pkix.Name{CommonName: "Tidepool development CA", Organization: []string{"Tidepool"}},
		NotBefore: o.Now.Add(-time.Hour), NotAfter: o.Now.Add(certValidity),
		IsCA: true, BasicConstraintsValid: true, MaxPathLenZero: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, err
	}
	w.pem("ca.crt", "CERTIFICATE", caDER, 0o644)
	w.key("ca.key", caKey)

	hosts := append([]string{"localhost", "127.0.0.1", "::1"}, o.Hosts...)
	if h, err := os.Hostname(); err == nil && h != "" {
		hosts = append(hosts, h)
	}
	var file tokensFile
	for _, r := range []Role{Admin, Client, Store, Master} {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, err
		}
		subj := pkix.Name{CommonName: "tidepool-" + string(r), OrganizationalUnit: []string{string(r)}}
		if r == Client {
			subj.Organization = []string{o.Tenant}
		}
		tmpl := &x509.Certificate{
			SerialNumber: serial(), Subject: subj,
			NotBefore: o.Now.Add(-time.Hour), NotAfter: o.Now.Add(certValidity),
			KeyUsage:    x509.KeyUsageDigitalSignature,
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		}
		if r == Master || r == Store {
			// Daemons serve too: gRPC and raft (masters), rails (stores).
			tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
			for _, h := range hosts {
				if ip := net.ParseIP(h); ip != nil {
					tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
				} else {
					tmpl.DNSNames = append(tmpl.DNSNames, h)
				}
			}
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			return nil, err
		}
		w.pem(string(r)+".crt", "CERTIFICATE", der, 0o644)
		w.key(string(r)+".key", key)
		if r == Master {
			continue
		}
		token := newToken()
		w.write(string(r)+".token", []byte(token+"\n"), 0o600)
		sum := sha256.Sum256([]byte(token))
		e := tokenEntry{Name: "dev-" + string(r), Role: string(r), SHA256: hex.EncodeToString(sum[:])}
		if r == Client {
			e.Tenant = o.Tenant
		}
		file.Tokens = append(file.Tokens, e)
	}
	js, err := json.MarshalIndent(file, "", "  ")
	if err != nil {
		return nil, err
	}
	w.write("tokens.json", append(js, '\n'), 0o644)
	return w.written, w.err
}

// certWriter writes files into dir, keeping the first error.
type certWriter struct {
	dir     string
	written []string
	err     error
}

func (w *certWriter) check(name string) {
	p := filepath.Join(w.dir, name)
	if _, err := os.Lstat(p); err == nil {
		w.fail(fmt.Errorf("%s exists: certificates and tokens are never overwritten; remove it or choose another directory", p))
	} else if !errors.Is(err, fs.ErrNotExist) {
		w.fail(err)
	}
}

func (w *certWriter) fail(err error) {
	if w.err == nil {
		w.err = err
	}
}

func (w *certWriter) write(name string, b []byte, mode os.FileMode) {
	if w.err != nil {
		return
	}
	p := filepath.Join(w.dir, name)
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		w.fail(err)
		return
	}
	_, err = f.Write(b)
	w.fail(errors.Join(err, f.Sync(), f.Close()))
	if w.err == nil {
		w.written = append(w.written, p)
	}
}

func (w *certWriter) pem(name, typ string, der []byte, mode os.FileMode) {
	w.write(name, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), mode)
}

func (w *certWriter) key(name string, k *ecdsa.PrivateKey) {
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		w.fail(err)
		return
	}
	w.pem(name, "PRIVATE KEY", der, 0o600)
}

// serial is a random 127-bit serial number, as RFC 5280 wants.
func serial() *big.Int {
	b := make([]byte, 16)
	_, _ = rand.Read(b) // never fails (crypto/rand's contract)
	b[0] &= 0x7f
	return new(big.Int).SetBytes(b)
}

// newToken is 32 random bytes, base64url: 256 bits no one guesses.
func newToken() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b) // never fails (crypto/rand's contract)
	return base64.RawURLEncoding.EncodeToString(b)
}
