package main

import (
	"context"
	"fmt"
	"path/filepath"

	"github.com/tidepool-kv/tidepool/auth"
)

// runCerts is `tidepool certs init DIR`.
func runCerts(_ context.Context, e *env, args []string) error {
	fs := newFlags("certs", "init DIR", "Write a development CA, a key and certificate for each role (admin, client, store, master), "+
		"a token for each of admin, client and store, and the tokens file the masters read (tokens.json, hashes only). "+
		"Never overwrites a file. Production deployments bring their own CA: see docs/operations.md.", e.stderr)
	var hosts listFlag
	fs.Var(&hosts, "host", "a name or address the master and store certificates are also valid for, repeatable (always: localhost, 127.0.0.1, ::1 and this host's name)")
	tenant := fs.String("tenant", "default", "tenant of the client certificate and token")
	pos, err := parse(fs, args, 2, 2)
	if err != nil {
		return err
	}
	if pos[0] != "init" {
		return fmt.Errorf("%w: unknown subcommand %q (want init)", errUsage, pos[0])
	}
	written, err := auth.InitCerts(pos[1], auth.CertsOptions{Hosts: hosts, Tenant: *tenant})
	if err != nil {
		return err
	}
	for _, p := range written {
		fmt.Fprintln(e.stdout, p)
	}
	dir := pos[1]
	fmt.Fprintf(e.stderr, "wrote a development CA valid for a year; e.g. tidepool status --tls-ca %s --tls-cert %s --tls-key %s\n",
		filepath.Join(dir, "ca.crt"), filepath.Join(dir, "admin.crt"), filepath.Join(dir, "admin.key"))
	return nil
}
