// Package auth is who may talk to a Tidepool daemon and as whom: the TLS
// configuration of every connection, the tokens file that maps bearer
// tokens to a tenant and a role, and the identity a call carries.
//
// # Roles
//
// A caller is an admin (operators' commands), a client (puts, gets and
// lookups of its tenant's keys), a store (registration and heartbeats of a
// store node) or a master (raft between masters). A certificate names its
// role in its subject's OrganizationalUnit and, for a client, its tenant in
// its Organization; a token names them in the tokens file. The master
// derives the namespace of every key from the caller's tenant: no request
// field names it.
//
// # The tokens file
//
// JSON, read at start and again on SIGHUP:
//
//	{"tokens": [
//	  {"name": "ops", "role": "admin", "sha256": "9f86d0..."},
//	  {"name": "vllm-a", "role": "client", "tenant": "a", "token": "..."}
//	]}
//
// An entry gives the token itself or, better, the hex SHA-256 of it, so the
// file does not hold the secret. Names appear in logs; tokens never do.
//
// # Certificates
//
// InitCerts writes a development CA and one certificate per role, enough
// for `tidepool up --secure` on one host. Production deployments bring
// their own CA; any certificate it signs with the role in its subject
// works.
package auth
