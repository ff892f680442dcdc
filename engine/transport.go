package engine

import "context"

// OpKind says which way an Op moves bytes.
type OpKind uint8

const (
	OpRead  OpKind = iota + 1 // peer segment -> Buf
	OpWrite                   // Buf -> peer segment
)

func (k OpKind) String() string {
	switch k {
	case OpRead:
		return "read"
	case OpWrite:
		return "write"
	default:
		return "unknown"
	}
}

// Op is one contiguous transfer between a local buffer and a peer segment: what the engine hands a
// Transport after it has sliced a task.
type Op struct {
	Kind     OpKind
	Target   Target
	Offset   int64
	Buf      []byte
	Priority Priority // carried so a transport can map classes onto rails or queues
	// Rail is the peer address this op travels over, one of the target's
	// rails (see Target.Rails); the engine binds it when it dispatches the op.
	Rail string
}

// Transport moves the bytes of one Op. It is the plug-in point for the ways bytes can travel
// (tcp, shm, local and file, and twins with fault injection in tests).
//
// The contract:
//   - Do moves all of op.Buf or returns an error; it is safe for concurrent use.
//   - Do returns promptly once ctx is done, even if the peer is stuck (close what it is blocked on).
//   - Errors wrap the engine's sentinels: ErrSegmentNotFound and ErrOutOfRange as the peer reported
//     them, ErrUnavailable for dial and connection failures, ErrProtocol for malformed frames,
//     ErrClosed after Close.
//   - Do does not keep op.Buf after it returns.
//   - Close releases every connection and makes later Do calls fail with ErrClosed.
type Transport interface {
	Name() string
	Do(ctx context.Context, op *Op) error
	Close() error
}

// SliceSizer is implemented by transports whose per-slice cost calls for a
// larger base slice than the default 64 KiB (a TCP round trip costs a few
// system calls and wake-ups, an RDMA write almost nothing).
type SliceSizer interface {
	SliceBase() int
}
