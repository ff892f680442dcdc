package agent

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/client"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

var (
	// ErrValueTooLong: a get's value is longer than the span given for it.
	ErrValueTooLong = errors.New("value longer than its span")
	// ErrTooManySessions: Open would exceed Config.MaxSessions.
	ErrTooManySessions = errors.New("too many sessions")
	// ErrOverlap: a get's span overlaps another span of the same request.
	ErrOverlap = fmt.Errorf("%w: span overlaps another of the request", client.ErrInvalidArgument)
)

// code maps an error of the agent or the client to a gRPC code.
func code(err error) codes.Code {
	switch {
	case err == nil:
		return codes.OK
	case errors.Is(err, ErrValueTooLong), errors.Is(err, client.ErrTooLarge):
		return codes.OutOfRange
	case errors.Is(err, ErrUnknownSession), errors.Is(err, client.ErrNotFound):
		return codes.NotFound
	case errors.Is(err, client.ErrInvalidArgument):
		return codes.InvalidArgument
	case errors.Is(err, client.ErrNoSpace), errors.Is(err, ErrTooManySessions), errors.Is(err, ErrTooManyRegions):
		return codes.ResourceExhausted
	case errors.Is(err, client.ErrConflict), errors.Is(err, client.ErrLeaseExpired):
		return codes.Aborted // retry the put or the read
	case errors.Is(err, client.ErrChecksum):
		return codes.DataLoss
	case errors.Is(err, client.ErrUnavailable), errors.Is(err, ErrClosed):
		return codes.Unavailable
	case errors.Is(err, context.DeadlineExceeded):
		return codes.DeadlineExceeded
	case errors.Is(err, context.Canceled):
		return codes.Canceled
	}
	return codes.Internal
}

func itemStatus(err error) *pb.ItemStatus {
	if err == nil {
		return &pb.ItemStatus{}
	}
	return &pb.ItemStatus{Code: int32(code(err)), Message: err.Error()}
}

func toStatus(err error) error {
	if err == nil {
		return nil
	}
	return status.Error(code(err), err.Error())
}

// valueTooLong is a get's error for a value that did not fit its span.
func valueTooLong(key string, span int, why error) error {
	if why != nil {
		return fmt.Errorf("%w: %q does not fit its span of %d bytes (%v)", ErrValueTooLong, key, span, why)
	}
	return fmt.Errorf("%w: %q does not fit its span of %d bytes", ErrValueTooLong, key, span)
}

// miss reports whether err says the key is absent: an answer, not a
// failure, for the errors counter.
func miss(err error) bool {
	return errors.Is(err, client.ErrNotFound)
}
