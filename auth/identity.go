package auth

import (
	"context"
	"errors"
	"fmt"
)

// Role is what a caller may do.
type Role string

const (
	// Admin runs operators' commands (drain, evict, members) and may do
	// anything a client may, in any tenant.
	Admin Role = "admin"
	// Client puts, gets and looks up the keys of its tenant.
	Client Role = "client"
	// Store registers a store node and heartbeats for it.
	Store Role = "store"
	// Master is a master's certificate: raft between masters, and the
	// gRPC a master serves other masters (membership announcements).
	Master Role = "master"
)

func parseRole(s string) (Role, error) {
	switch r := Role(s); r {
	case Admin, Client, Store, Master:
		return r, nil
	}
	return "", fmt.Errorf("unknown role %q (want admin, client, store or master)", s)
}

// Identity is an authenticated caller.
type Identity struct {
	// Name is the token's name or the certificate's common name: for
	// logs, never a secret.
	Name string
	Role Role
	// Tenant is the tenant whose keys a client reaches; empty for the
	// other roles, and for everyone in a pool without tenants.
	Tenant string
}

// Errors of authentication, mapped to gRPC codes by the servers.
var (
	// ErrUnauthenticated: no credential, or one that names nobody.
	ErrUnauthenticated = errors.New("auth: unauthenticated")
	// ErrPermissionDenied: a known caller whose role may not do this.
	ErrPermissionDenied = errors.New("auth: permission denied")
)

type identityKey struct{}

// WithIdentity returns ctx carrying id.
func WithIdentity(ctx context.Context, id Identity) context.Context {
	return context.WithValue(ctx, identityKey{}, id)
}

// FromContext returns the identity a server's interceptor put in ctx.
func FromContext(ctx context.Context) (Identity, bool) {
	id, ok := ctx.Value(identityKey{}).(Identity)
	return id, ok
}
