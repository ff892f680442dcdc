package client

import (
	"errors"
	"fmt"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

var (
	// ErrNotFound: no complete object has the key.
	ErrNotFound = errors.New("object not found")
	// ErrInvalidArgument: an empty or oversized key, an empty value, a short buffer.
	ErrInvalidArgument = errors.New("invalid argument")
	// ErrNoSpace: no segment has room for the value now.
	ErrNoSpace = errors.New("no segment has room")
	// ErrTooLarge: the value is larger than any segment could ever hold.
	ErrTooLarge = errors.New("value larger than any segment")
	// ErrConflict: another put of the key is in progress, or the put was
	// revoked before it ended.
	ErrConflict = errors.New("conflicting put")
	// ErrUnavailable: no master leader or store could be reached.
	ErrUnavailable = errors.New("unavailable")
	// ErrLeaseExpired: the bytes arrived after the read lease ended, so they
	// may have been overwritten; read again.
	ErrLeaseExpired = errors.New("read lease expired before the read finished")
	// ErrChecksum: the bytes read do not match the checksum written at put.
	ErrChecksum = errors.New("checksum mismatch")
	// ErrProtocol: the master answered something this client cannot use.
	ErrProtocol = errors.New("malformed answer from the master")
	// ErrShortBuffer: a get's buffer is shorter than the value. It is an
	// ErrInvalidArgument too.
	ErrShortBuffer = fmt.Errorf("%w: buffer shorter than the value", ErrInvalidArgument)
)

// MaxKeyLen is the longest key the master accepts.
const MaxKeyLen = 4096

func validKey(key string) error {
	switch {
	case key == "":
		return fmt.Errorf("%w: empty key", ErrInvalidArgument)
	case len(key) > MaxKeyLen:
		return fmt.Errorf("%w: key of %d bytes exceeds the %d-byte limit", ErrInvalidArgument, len(key), MaxKeyLen)
	}
	return nil
}

// fromCode maps a gRPC code to a sentinel.
func fromCode(c codes.Code) error {
	switch c {
	case codes.NotFound:
		return ErrNotFound
	case codes.InvalidArgument:
		return ErrInvalidArgument
	case codes.ResourceExhausted:
		return ErrNoSpace
	case codes.OutOfRange:
		return ErrTooLarge
	case codes.FailedPrecondition, codes.Aborted:
		return ErrConflict
	case codes.Unavailable, codes.DeadlineExceeded:
		return ErrUnavailable
	}
	return nil
}

// rpcError turns an RPC error into one that wraps a sentinel, keeping the
// server's message.
func rpcError(err error) error {
	if err == nil {
		return nil
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	if s := fromCode(st.Code()); s != nil {
		// The master's message often starts with the same words.
		if rest, ok := strings.CutPrefix(st.Message(), s.Error()); ok {
			return fmt.Errorf("%w%s", s, rest)
		}
		return fmt.Errorf("%w: %s", s, st.Message())
	}
	return fmt.Errorf("master: %s: %s", st.Code(), st.Message())
}

// itemError turns one batch item's status into an error.
func itemError(s *pb.ItemStatus) error {
	if s == nil || s.Code == 0 {
		return nil
	}
	return rpcError(status.Error(codes.Code(s.Code), s.Message))
}
