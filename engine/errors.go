package engine

import "errors"

// Sentinel errors. The engine returns them wrapped with context (operation, target, message from
// the peer); test for them with errors.Is.
var (
	// ErrSegmentNotFound: the peer serves no segment of that name. Stores rely on it to fence stale
	// descriptors (a segment that was unregistered or re-registered under a new name).
	ErrSegmentNotFound = errors.New("engine: segment not found")
	// ErrOutOfRange: the offset or length lies outside the segment.
	ErrOutOfRange = errors.New("engine: out of range")
	// ErrClosed: the engine or transport was closed.
	ErrClosed = errors.New("engine: closed")
	// ErrTimedOut: the task's deadline passed before it finished.
	ErrTimedOut = errors.New("engine: timed out")
	// ErrProtocol: a peer sent a malformed frame, or a request the peer could not parse.
	ErrProtocol = errors.New("engine: protocol error")
	// ErrUnavailable: the peer could not be dialed, or the connection broke mid-transfer.
	ErrUnavailable = errors.New("engine: peer unavailable")
	// ErrRemote: the peer accepted the request but failed to carry it out (its segment's I/O failed).
	ErrRemote = errors.New("engine: peer failed the operation")
	// ErrInvalid: the caller asked for something that can never succeed (empty endpoint, segment
	// name longer than 255 bytes, a batch reused after Submit).
	ErrInvalid = errors.New("engine: invalid argument")
	// ErrForbidden: the peer's Guard refused the request: no ticket, a forged or expired one, or
	// one for other bytes or another operation. Asking again with the same ticket cannot help.
	ErrForbidden = errors.New("engine: forbidden")
	// ErrExists: a segment of that name is already registered.
	ErrExists = errors.New("engine: segment already registered")
	// ErrUnsupported: the transport cannot reach this segment (shm: the peer is on another host,
	// its segment cannot be shared, or its memory cannot be mapped); the engine falls over to the
	// next transport.
	ErrUnsupported = errors.New("engine: unsupported by this transport")
)
