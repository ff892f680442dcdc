// Package tidepoolpb holds the Go code generated from proto/*.proto: the
// master's Master and Registry gRPC services and the raft command and
// snapshot messages. Do not edit the .pb.go files; run `make proto`.
// keys.go, by hand, packs and unpacks a lookup's keys.
package tidepoolpb
