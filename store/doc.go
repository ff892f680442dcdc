// Package store is the store node daemon. A Node mounts its tiers, serves
// their bytes to peers through an embedded transfer engine, registers the
// tiers' segments with the master and heartbeats.
//
// Each registration starts a new epoch; segments are served under the
// names the master gives them ("node/tier@epoch"), so a replica descriptor
// handed out before a restart addresses a segment that no longer exists and
// fails with engine.ErrSegmentNotFound instead of reading the wrong bytes.
// When the master no longer knows the node at its epoch (it was declared
// dead, or a master's state was lost), the node registers again; when it
// was drained by an operator, it leaves the pool until restarted.
//
// Peers' reads and writes are admitted only with a ticket the master
// signed for their bytes (package ticket; guard.go): the node makes a key
// when it starts and hands it over with each registration.
//
// Heartbeats are also the master's command channel: their answers carry
// copies for the node to make (read a replica, check its checksum, write a
// new replica), at most Config.CopyConcurrency at once, and the next
// heartbeat, sent as soon as one ends, reports how they went.
package store
