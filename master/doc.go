// Package master is Tidepool's metadata service: a hashicorp/raft group
// whose log lives on pebble (package logstore) and whose FSM holds the
// object table, the store nodes and their segments, and a deterministic
// offset allocator per segment.
//
// The master is never on the data path. A put is two-phase and costs one
// raft entry: PutStart places it in space the leader reserved through raft
// ahead of need (ReserveCmd; the put is the leader's, in memory, and
// invisible), the client writes the bytes to the store through the
// transfer engine, and PutEnd publishes it (PublishCmd carves its extent
// out of the reservation). A new leader never places puts in an earlier
// one's reservations and frees what they did not publish only once no
// write there can land (see puts.go). GetReplicas describes where the
// bytes are and grants a read lease. Read leases, store heartbeats, the
// puts in flight and the sweep that forgets abandoned puts and declares
// silent stores dead are soft state of the leader, rebuilt on each
// election.
//
// The object table is sized for millions of objects: records without Go
// pointers (object.go) in a sharded open-addressing index (table.go), with
// read leases and recency as atomic fields of the records.
//
// Mutations go through raft.Apply; reads are served from the leader's
// memory. A follower refuses both with codes.Unavailable and the leader's
// gRPC address in the LeaderTrailer trailer.
package master
