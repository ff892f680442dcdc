// Package client is Tidepool's Go SDK. A Client asks the master (always
// its raft leader, followed transparently) where values live and moves the
// bytes itself, directly to and from store nodes through an embedded
// transfer engine; the master is never on the data path.
//
// Put is two-phase: PutStart places (or a grant the leader placed ahead
// for this shape of put is used), the client writes every replica, PutEnd
// publishes; any failure in between revokes the put, so a value is either
// complete and visible or absent. Get verifies the CRC-32C of every
// value and discards a read that finished after its lease expired, so it
// never returns bytes that the pool may have reused. A replica that fails
// the checksum is reported to the master, which drops it.
//
// Errors wrap the sentinels below; test them with errors.Is.
package client
