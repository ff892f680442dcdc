"""A storage backend for SGLang's hierarchical cache (HiCache).

:class:`HiCacheStorage` has the method names of SGLang's
``sglang.srt.mem_cache.hicache_storage.HiCacheStorage`` and answers as its
backends must: SGLang hands it page keys (the hex page hashes of
``sglang-sha256``), asks ``batch_exists`` for the count of leading pages it
has, reads pages into host memory with ``batch_get_v1`` and writes them with
``batch_set_v1``.

One shape differs, and it is a shim: SGLang calls ``batch_get_v1(keys,
host_indices, extra_info)`` and ``batch_set_v1(keys, host_indices,
extra_info)`` with a tensor of host *token* indices into the host KV pool
that it registered with ``register_mem_pool_host`` (``page_size`` indices
per page), and a real backend finds the pages' memory in that pool itself.
This class takes one writable (get) or readable (set) buffer per page
instead, e.g. views of the host pool's pages; plugging it into SGLang takes
a subclass that turns host indices into those views for the pool's layout.
SGLang's v2 interface (``batch_exists_v2``, ``batch_get_v2``,
``batch_set_v2``) is not implemented.

No method raises: SGLang calls them from its prefetch and backup threads,
which catch nothing else and would die for the life of the process (say,
while the agent restarts). A failure is logged (logger ``tidepool.sglang``)
and answered as a miss: 0 pages, False, None.

Keys are placed in a :class:`tidepool.hashing.Namespace` so that pages of
different models, parallel ranks, layouts and tenants never share an object
key.

``batch_exists`` is a lookup, not a count: Tidepool leases the pages it
reports present, so the ``batch_get_v1`` that follows finds them even under
eviction pressure (no stall on a page promised and then evicted).
"""

import logging
import threading
import time

from . import errors
from .client import DEFAULT_SHM_BYTES, DEFAULT_SOCKET, Client, nbytes
from .hashing import SGLANG_SHA256, Namespace

logger = logging.getLogger(__name__)

# A failing agent is reported at WARNING at most this often per method, and
# at DEBUG in between.
_WARN_EVERY = 10.0


def _prefix_keys(extra_info):
    if extra_info is None:
        return None
    if isinstance(extra_info, dict):
        return extra_info.get("prefix_keys")
    return getattr(extra_info, "prefix_keys", None)


def _ok(r, want):
    """A page read is good when it filled its buffer exactly."""
    return not isinstance(r, errors.Error) and r == want


class HiCacheStorage:
    """A HiCache storage backend on a Tidepool agent.

    Give it a :class:`tidepool.Client` (shared, not closed by close()) or
    the agent's ``socket`` and ``shm_bytes`` (a client of its own), and the
    namespace: ``model`` names everything that changes a page's bytes (the
    model, its TP, PP and context-parallel ranks, the host pool's layout;
    see :meth:`from_config`). ``chain`` records each page's parent (the
    previous page) so that eviction takes a prefix's leaves first.
    """

    def __init__(self, model, client=None, tenant="", socket=DEFAULT_SOCKET,
                 shm_bytes=DEFAULT_SHM_BYTES, scheme=SGLANG_SHA256, chain=True):
        self.namespace = Namespace(scheme, model, tenant)
        self.namespace.validate()
        self._own = client is None
        self.client = client if client is not None else Client(
            socket=socket, shm_bytes=shm_bytes, client_name="sglang-hicache")
        self.chain = chain
        self.mem_pool_host = None
        self._warn_lock = threading.Lock()
        self._warned = {}  # method -> time.monotonic() of its last WARNING; guarded by _warn_lock

    @classmethod
    def from_config(cls, storage_config, client=None, **kwargs):
        """Builds the backend from SGLang's HiCacheStorageConfig (any object
        with its fields). The namespace's model is the model name, with
        ``@tpRANK-SIZE`` unless the model is MLA (whose pages are the same
        on every TP rank), ``@ppRANK-SIZE`` where pipelined,
        ``@cpRANK-SIZE`` under attention context parallelism (each CP rank
        holds its own slice of every page) and ``@page-first`` for a host
        pool of the page-first layout (a page's bytes are laid out
        otherwise). extra_config may name "socket", "shm_bytes" and
        "tenant"."""
        model = getattr(storage_config, "model_name", None) or "unknown"
        if not getattr(storage_config, "is_mla_model", False):
            model += "@tp%d-%d" % (getattr(storage_config, "tp_rank", 0), getattr(storage_config, "tp_size", 1))
        if (getattr(storage_config, "pp_size", 1) or 1) > 1:
            model += "@pp%d-%d" % (storage_config.pp_rank, storage_config.pp_size)
        if (getattr(storage_config, "attn_cp_size", 1) or 1) > 1:
            model += "@cp%d-%d" % (storage_config.attn_cp_rank, storage_config.attn_cp_size)
        if getattr(storage_config, "is_page_first_layout", False):
            model += "@page-first"
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        for name in ("socket", "shm_bytes", "tenant"):
            if name in extra and name not in kwargs:
                kwargs[name] = extra[name]
        return cls(model, client=client, **kwargs)

    def register_mem_pool_host(self, mem_pool_host):
        """SGLang's hook, called once the backend is attached: keeps the host
        KV pool (SGLang's HostKVCache) as ``self.mem_pool_host``, for a
        subclass that turns SGLang's host indices into page buffers (see the
        module's doc)."""
        self.mem_pool_host = mem_pool_host

    def _key(self, key):
        return self.namespace.key(key)

    def _keys(self, keys):
        return [self.namespace.key(k) for k in keys]

    def _parent(self, extra_info):
        prefix = _prefix_keys(extra_info)
        return self._key(prefix[-1]) if prefix else None

    def _failed(self, what, e):
        """Logs a failure that SGLang must not see raised."""
        now = time.monotonic()
        with self._warn_lock:
            loud = now - self._warned.get(what, -_WARN_EVERY) >= _WARN_EVERY
            if loud:
                self._warned[what] = now
        if not isinstance(e, errors.Error):  # a bug, not the agent: always with its traceback
            logger.error("tidepool HiCache %s failed; answering a miss", what, exc_info=e)
        elif loud:
            logger.warning("tidepool HiCache %s failed; answering a miss (repeats within %.0fs are logged "
                           "at DEBUG): %s: %s", what, _WARN_EVERY, type(e).__name__, e)
        else:
            logger.debug("tidepool HiCache %s failed; answering a miss: %s: %s", what, type(e).__name__, e)

    # Existence.

    def batch_exists(self, keys, extra_info=None):
        """The number of leading keys present, each leased for the gets
        that follow; 0 on failure."""
        if not keys:
            return 0
        try:
            return self.client.lookup(self._keys(keys)).matched
        except Exception as e:  # noqa: BLE001 - SGLang's threads die on any exception
            self._failed("batch_exists", e)
            return 0

    def exists(self, key):
        """Whether key is present; False on failure."""
        try:
            return self.client.exists(self._key(key))
        except Exception as e:  # noqa: BLE001
            self._failed("exists", e)
            return False

    # Zero-copy pages: the v1 interface, one buffer per page (a shim: see
    # the module's doc).

    def _get_v1(self, keys, buffers):
        got = self.client.batch_get_into(self._keys(keys), buffers)
        return [_ok(r, nbytes(b)) for r, b in zip(got, buffers)]

    def batch_get_v1(self, keys, buffers, extra_info=None):
        """Reads page i into buffers[i]; per key, True when the page was
        there and filled its buffer exactly; all False on failure."""
        if not keys:
            return []
        try:
            return self._get_v1(keys, buffers)
        except Exception as e:  # noqa: BLE001
            self._failed("batch_get_v1", e)
            return [False] * len(keys)

    def batch_set_v1(self, keys, buffers, extra_info=None):
        """Writes page i from buffers[i]; per key, True when stored (or
        already there). extra_info.prefix_keys, when given, names the pages
        before keys[0]: the last one is keys[0]'s parent. All False on
        failure (a page larger than the client's region included)."""
        if not keys:
            return []
        try:
            res = self.client.batch_set(self._keys(keys), buffers, chain=self.chain,
                                        parent=self._parent(extra_info) if self.chain else None)
        except Exception as e:  # noqa: BLE001
            self._failed("batch_set_v1", e)
            return [False] * len(keys)
        return [r is True for r in res]

    # The older interface: values as bytes.

    def get(self, key, target_location=None, target_sizes=None):
        """The page as bytes, or None; with target_location (a writable
        buffer) the page is read into it and target_location returned."""
        if target_location is not None:
            return target_location if self.batch_get_v1([key], [target_location])[0] else None
        try:
            v = self.client.batch_get([self._key(key)])[0]
        except Exception as e:  # noqa: BLE001
            self._failed("get", e)
            return None
        return None if isinstance(v, errors.Error) else v

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        """Per key the page as bytes (or read into target_locations[i] and
        that returned), None where absent or on failure."""
        if target_locations is not None:
            ok = self.batch_get_v1(keys, target_locations)
            return [t if good else None for t, good in zip(target_locations, ok)]
        if not keys:
            return []
        try:
            got = self.client.batch_get(self._keys(keys))
        except Exception as e:  # noqa: BLE001
            self._failed("batch_get", e)
            return [None] * len(keys)
        return [None if isinstance(v, errors.Error) else v for v in got]

    def set(self, key, value=None, target_location=None, target_sizes=None):
        """True when the page was stored."""
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        """True when every page was stored."""
        return all(self.batch_set_v1(keys, values if values is not None else target_locations))

    # Housekeeping.

    def clear(self):
        """Removes every page of this backend's namespace; False on
        failure."""
        try:
            self.client.clear(self.namespace.prefix)
            return True
        except Exception as e:  # noqa: BLE001
            self._failed("clear", e)
            return False

    def get_stats(self):
        """The agent's counters (see Client.stats); None on failure."""
        try:
            return self.client.stats()
        except Exception as e:  # noqa: BLE001
            self._failed("get_stats", e)
            return None

    def close(self):
        if self._own:
            self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
