// Package logstore implements hashicorp/raft's LogStore and StableStore on
// top of cockroachdb/pebble, replacing raft-boltdb (which no longer builds
// cleanly with current modules). A single pebble DB holds both the raft log
// and the stable key/value pairs under distinct one-byte key prefixes.
// Every write is committed with pebble.Sync, so acknowledged data survives a
// crash. Open leaves pebble writing a WAL file that is already written in
// full, so the fdatasync of a commit has no file size to journal.
package logstore
