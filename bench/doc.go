// Package bench measures a running cluster; cmd/tidepool's `bench`
// subcommands parse flags and print what it returns.
//
// Meta measures the master alone, as Mooncake's master_bench does: batches
// of metadata calls with tiny values and no data transfer (a put is
// BatchPutStart and PutEnd of the batch's keys; a get is GetReplicas; an
// exists is Exists), so the figures are the raft log and the master's CPU,
// not the wire.
package bench
