"""Errors of the Tidepool SDK.

Every error is a :class:`Error`. A whole request that fails raises the
subclass named after its gRPC code (:class:`NotFound`,
:class:`InvalidArgument`, :class:`Unavailable`, ...). Batch calls do not
raise for one item's failure: they return, in that item's place, an
instance of the same classes (never raised), so ``isinstance(r,
tidepool.Error)`` tells a failed item from a result.
"""

import grpc


class Error(Exception):
    """A Tidepool error: a gRPC code and a message."""

    #: The gRPC status code this class stands for.
    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message="", code=None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __eq__(self, other):
        return (type(self) is type(other) and self.code == other.code
                and self.message == other.message)

    def __hash__(self):
        return hash((type(self), self.code, self.message))

    def __repr__(self):
        return "%s(%r)" % (type(self).__name__, self.message)


class Cancelled(Error):
    code = grpc.StatusCode.CANCELLED


class Unknown(Error):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(Error):
    """A bad key, span, batch or argument."""
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(Error):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(Error):
    """No such key (an item of a batch), or no such session."""
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(Error):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(Error):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(Error):
    """The pool has no room for a value."""
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(Error):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(Error):
    """A put raced another, or a read outlived its lease: try again."""
    code = grpc.StatusCode.ABORTED


class OutOfRange(Error):
    """A value longer than the buffer or span given for it, or larger than
    any segment of the pool."""
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(Error):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(Error):
    code = grpc.StatusCode.INTERNAL


class Unavailable(Error):
    """The agent (or the cluster behind it) cannot be reached."""
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(Error):
    """A value failed its checksum."""
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(Error):
    code = grpc.StatusCode.UNAUTHENTICATED


class ValueTooLarge(InvalidArgument):
    """A value does not fit the session's shared-memory region; open the
    Client with a larger ``shm_bytes``."""


class RegionTimeout(DeadlineExceeded):
    """Waiting for room in the session's shared-memory region timed out:
    other calls of the Client held it for the whole ``timeout``. Nothing
    was sent to the agent."""


class ClientClosed(Error):
    """The Client was closed."""
    code = grpc.StatusCode.FAILED_PRECONDITION


_BY_CODE = {c.code: c for c in (
    Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
    PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange,
    Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated)}
_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def from_code(code, message=""):
    """Returns the error for a gRPC code, given as a grpc.StatusCode or as
    its number (an ItemStatus's code)."""
    if not isinstance(code, grpc.StatusCode):
        number = int(code)
        code = _BY_NUMBER.get(number)
        if code is None:
            return Unknown("code %d: %s" % (number, message))
    return _BY_CODE.get(code, Unknown)(message, code)


def from_rpc(err, what=""):
    """Turns a grpc.RpcError into the matching Error."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    message = "%s: %s" % (what, details) if what else (details or "")
    return from_code(code, message)
