"""Mooncake's return codes (its ``ErrorCode`` values) and the one table that
maps Tidepool's errors onto them.

Mooncake's store API answers ints, not exceptions: 0 for success, a
negative code for an error. docs/engines.md lists every code this layer
answers and when.
"""

from .. import errors

OK = 0
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
LEASE_EXPIRED = -707
TRANSFER_FAIL = -800
CHECKSUM_MISMATCH = -801
RPC_FAIL = -900
RPC_TIMEOUT = -901

#: health_check's answers.
HEALTHY, NOT_INITIALIZED, MASTER_UNREACHABLE = 0, 1, 2

# Per error class, the code of a whole request (the agent or the master
# failed) and of one item (one key's transfer failed). First match wins, so
# subclasses come before their bases.
_TABLE = (
    (errors.ClientClosed, INVALID_PARAMS, INVALID_PARAMS),
    (errors.RegionTimeout, RPC_TIMEOUT, RPC_TIMEOUT),
    (errors.ValueTooLarge, INVALID_PARAMS, INVALID_PARAMS),
    (errors.NotFound, OBJECT_NOT_FOUND, OBJECT_NOT_FOUND),
    (errors.InvalidArgument, INVALID_PARAMS, INVALID_PARAMS),
    (errors.OutOfRange, INVALID_PARAMS, INVALID_PARAMS),
    (errors.ResourceExhausted, NO_AVAILABLE_HANDLE, NO_AVAILABLE_HANDLE),
    (errors.DataLoss, CHECKSUM_MISMATCH, CHECKSUM_MISMATCH),
    (errors.DeadlineExceeded, RPC_TIMEOUT, TRANSFER_FAIL),
    (errors.Cancelled, RPC_TIMEOUT, TRANSFER_FAIL),
    (errors.Unavailable, RPC_FAIL, TRANSFER_FAIL),
)


def of(err, item=False, put=False):
    """The Mooncake code for a Tidepool error: of a whole request, or of one
    item. On a put, OutOfRange (larger than any segment) is no space, and
    Aborted (another put of the key is under way) is success, as Mooncake
    answers a put of a key that exists; on a read Aborted is an expired
    lease."""
    if isinstance(err, errors.Aborted):
        return OK if put else LEASE_EXPIRED
    if put and isinstance(err, errors.OutOfRange):
        return NO_AVAILABLE_HANDLE
    for cls, whole, one in _TABLE:
        if isinstance(err, cls):
            return one if item else whole
    return INTERNAL_ERROR
