// Package integration tests Tidepool end to end with the real binary.
//
// TestMain builds cmd/tidepool once; each test then runs masters, stores
// and client commands as separate processes on loopback, with ports picked
// at run time, and kills (SIGKILL) or stops (SIGTERM) them to check what
// survives. Readiness is the daemons' /readyz endpoint; conditions are
// polled, never slept on. A failing test logs the output of every process
// it started.
//
// The package holds only tests:
//
//	go test ./integration/
//	go test -short ./integration/ # skips the 60 s unreachable-master timeout
package integration
