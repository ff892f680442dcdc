"""Mooncake's Python store API on Tidepool.

``tidepool.mooncake.MooncakeDistributedStore`` answers the methods of
Mooncake's ``mooncake.store.MooncakeDistributedStore`` (names, argument
order, defaults, return codes), so the engines' Mooncake integrations
(SGLang's HiCache ``mooncake_store`` backend, vLLM's
``MooncakeStoreConnector``, LMCache's ``mooncakestore://`` backend) run on a
Tidepool pool unchanged. ``client/python/compat`` holds a ``mooncake``
package that re-exports this module as ``mooncake.store`` for them. See
docs/engines.md.
"""

from .codes import (CHECKSUM_MISMATCH, INTERNAL_ERROR, INVALID_PARAMS, LEASE_EXPIRED, NO_AVAILABLE_HANDLE,
                    OBJECT_NOT_FOUND, OK, REPLICA_IS_NOT_READY, RPC_FAIL, RPC_TIMEOUT, TRANSFER_FAIL)
from .memory import MooncakeHostMemAllocator
from .numa import bind_to_numa_node
from .store import (BufferHandle, Descriptor, DiskDescriptor, MemoryDescriptor, MooncakeDistributedStore,
                    ReplicaDescriptor, ReplicaStatus, ReplicateConfig)

__all__ = [
    "MooncakeDistributedStore", "ReplicateConfig", "MooncakeHostMemAllocator", "bind_to_numa_node",
    "BufferHandle", "ReplicaDescriptor", "ReplicaStatus", "MemoryDescriptor", "DiskDescriptor", "Descriptor",
    "OK", "INTERNAL_ERROR", "NO_AVAILABLE_HANDLE", "INVALID_PARAMS", "REPLICA_IS_NOT_READY", "OBJECT_NOT_FOUND",
    "LEASE_EXPIRED", "TRANSFER_FAIL", "CHECKSUM_MISMATCH", "RPC_FAIL", "RPC_TIMEOUT",
]
