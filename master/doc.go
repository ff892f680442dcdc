// Package master is Tidepool's metadata service: a hashicorp/raft group
// whose log lives on pebble (package logstore) and whose FSM holds the
// object table, the store nodes and their segments, and a deterministic
// offset allocator per segment.
//
// The master is never on the data path. A put is two-phase: PutStart picks
// a segment and allocates space (the object is PROCESSING and invisible),
// the client writes the bytes to the store through the transfer engine, and
// PutEnd makes the object COMPLETE. GetReplicas describes where the bytes
// are and grants a read lease. Read leases, store heartbeats and the sweep
// that revokes abandoned puts and declares silent stores dead are soft
// state of the leader, rebuilt on each election.
//
// Mutations go through raft.Apply; reads are served from the leader's
// memory. A follower refuses both with codes.Unavailable and the leader's
// gRPC address in the LeaderTrailer trailer.
package master
