// Package logstore implements hashicorp/raft's LogStore and StableStore on
// top of cockroachdb/pebble, replacing raft-boltdb (which no longer builds
// cleanly with current modules). A single pebble DB holds both the raft log
// and the stable key/value pairs under distinct one-byte key prefixes.
// Every write is committed with pebble.Sync, so acknowledged data survives a
// crash.
package logstore
