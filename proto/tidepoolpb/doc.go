// Package tidepoolpb holds the Go code generated from proto/*.proto: the
// master's Master and Registry gRPC services and the raft command and
// snapshot messages. Do not edit the .pb.go files; run `make proto`.
package tidepoolpb
