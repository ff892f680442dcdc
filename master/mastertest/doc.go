// Package mastertest runs a Tidepool cluster inside a test process, for
// tests of the packages built on the master (client, client/agent, store).
// It is test support, like raft's testing.go or engine/enginetest: nothing
// outside a _test.go file should import it.
//
// Start runs one real master: raft on its in-memory transport, gRPC on a
// loopback port. StartStore runs a real store node with one DRAM tier that
// registers with it. Both close when the test ends:
//
//	m := mastertest.Start(t, nil)
//	node, tier := mastertest.StartStore(t, []string{m.Addr()}, "s0", 64<<20, nil)
//	...
//	m.Restart()      // same Dir and addresses: the state survives
//	m.RestartFresh() // same gRPC address, empty Dir: a master that lost its state
//
// The timeouts (SweepInterval, NodeTTL, PutTimeout, Heartbeat) are short
// enough that sweeps, dead stores and abandoned puts show up within a
// test, and long enough for -race on a busy machine. Logs are discarded
// unless TIDEPOOL_TEST_LOG is set.
package mastertest
