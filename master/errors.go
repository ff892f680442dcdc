package master

import "errors"

// Errors the FSM and the services return. The gRPC layer maps each to a
// status code (see code in grpc.go); clients map the codes back.
var (
	ErrNotFound       = errors.New("object not found")
	ErrNoSpace        = errors.New("no segment has room")
	ErrOverQuota      = errors.New("over the tenant's quota")
	ErrTooLarge       = errors.New("value larger than any segment")
	ErrNoSegments     = errors.New("no store segments registered")
	ErrPutInProgress  = errors.New("a put of this key is in progress")
	ErrNotInProgress  = errors.New("no put of this key is in progress")
	ErrUnknownNode    = errors.New("unknown node or stale epoch")
	ErrInvalidRequest = errors.New("invalid argument")
	ErrNotLeader      = errors.New("not the raft leader")
	ErrStoreGone      = errors.New("store left the pool")
	ErrPinned         = errors.New("object is pinned")
	ErrCopyInProgress = errors.New("a copy of this object is in progress")
	ErrDraining       = errors.New("node is draining")
	ErrDrained        = errors.New("node was drained by an operator; it stays out of the pool until restarted")
	ErrOutcomeUnknown = errors.New("leadership lost while committing: the change may or may not have been made")
	ErrPutExpired     = errors.New("the put's deadline passed before it was placed")
	// ErrQuorum: a membership change would leave the cluster without a
	// quorum of masters that answer.
	ErrQuorum = errors.New("would lose quorum")
	// ErrLogDisk: the disk under this master's raft log is full or
	// failing; it takes no writes until the disk recovers.
	ErrLogDisk = errors.New("the raft log's disk is full or failing")
)
