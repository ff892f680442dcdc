// Package agent serves the Go client to the other processes of its host:
// `tidepool agent` embeds one client.Client (and its transfer engine) and
// answers the Agent gRPC service (proto/agent.proto) on a unix socket, so an
// inference engine's Python side gets and puts KV blocks without speaking
// the engine protocol.
//
// Values never cross the socket. A process opens a session and the agent
// creates a shared-memory region for it (a memfd, mapped MAP_SHARED) and
// answers its path, /proc/<agent pid>/fd/<fd>; the process opens and maps
// that path read-write. A get names spans of the region and the transfer
// engine lands each value straight in its span (a memcpy when the store is
// on the same host); a put names the spans holding the values. Opening the
// path takes the agent's user (or root) in the agent's pid namespace, which
// is why the socket is the agent user's alone.
//
// A process may also attach memfds of its own to its session (Attach, with
// the /proc/PID/fd/N path of a memfd created with MFD_ALLOW_SEALING): the
// agent seals it against resizing, maps it, and spans name it by region id,
// so gets land in the process's own memory and puts leave from it with no
// copy through the session's region. Attaching the same memory again
// answers the same region; the session's own region cannot be attached.
// Regions are unmapped by Detach or when the session ends, once no request
// uses them.
//
// Sessions end with Close, when the Server closes, when the process that
// opened them exits (the agent knows it by its pid on the unix socket; a
// session another process uses ends with its opener all the same), or
// after SessionIdle without a request that names them (BatchGet, BatchPut,
// Stats, Close; Stats of the session serves as a heartbeat). One process
// holds at most MaxSessionsPerProcess. Session ids are random, so a
// process that outlives an agent restart gets NotFound, never another
// process's region. A session's region is unmapped only once no request
// is using it; the caller's own mapping stays valid after the session
// ends.
//
// Lookup is the client's Lookup: it answers the cached prefix of a chain and
// leases it. The agent keeps the leased blocks' locations (agent-wide, up to
// Config.LeasedBlocks) and a BatchGet of them within the lease reads them
// without asking the master again, so a block promised by a lookup cannot
// be evicted before the get that follows; other keys are read with
// client.BatchGetInto.
//
// Exists and Describe answer per key what the master says (present; size,
// checksum and replicas); Clear removes a prefix's complete objects, or the
// whole pool's, optionally narrowed by an RE2 pattern, a List page at a
// time. Open answers the agent's masters, so a process may ask them
// directly what moves no bytes.
//
// Per-item results follow the master's convention: one ItemStatus per key,
// code 0 for success, else a gRPC code and a message. NotFound: no such
// key; InvalidArgument: a bad key or a span outside the region; OutOfRange:
// on a get, the value is longer than its span; on a put, the value is
// larger than any segment. Whole requests fail with InvalidArgument when
// keys and spans differ in number, there are no keys or more than
// MaxBatchKeys, and with NotFound for an unknown session.
package agent
