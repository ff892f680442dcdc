"""Tidepool's Python SDK: a client of the per-host `tidepool agent`.

    import tidepool

    with tidepool.Client("/tmp/tidepool-agent.sock") as c:
        c.batch_set(["a", "b"], [b"one", b"two"])
        c.batch_get(["a", "b", "c"])          # [b"one", b"two", None]

Requests go over the agent's gRPC unix socket; values move through a
shared-memory region the agent maps for the session. ``tidepool.hashing``
names KV blocks as vLLM, SGLang and Dynamo do; ``tidepool.sglang`` and
``tidepool.vllm`` fit those engines' storage interfaces.

Needs Debian's python3-grpcio, python3-protobuf, python3-cbor2 and
python3-xxhash.
"""

from .client import (DEFAULT_SHM_BYTES, DEFAULT_SOCKET, MAX_BATCH_KEYS, MAX_KEY_LEN, Attachment, BlockInfo, Client, Match,
                     Replica)
from .errors import (Aborted, AlreadyExists, Cancelled, ClientClosed, DataLoss, DeadlineExceeded,
                     Error, FailedPrecondition, Internal, InvalidArgument, NotFound, OutOfRange,
                     PermissionDenied, RegionTimeout, ResourceExhausted, Unauthenticated,
                     Unavailable, Unimplemented, Unknown, ValueTooLarge)

__all__ = [
    "Client", "Match", "BlockInfo", "Replica", "Attachment", "DEFAULT_SOCKET", "DEFAULT_SHM_BYTES", "MAX_BATCH_KEYS", "MAX_KEY_LEN",
    "Error", "Aborted", "AlreadyExists", "Cancelled", "ClientClosed", "DataLoss", "DeadlineExceeded",
    "FailedPrecondition", "Internal", "InvalidArgument", "NotFound", "OutOfRange", "PermissionDenied",
    "RegionTimeout", "ResourceExhausted", "Unauthenticated", "Unavailable", "Unimplemented", "Unknown", "ValueTooLarge",
]
