"""A storage backend for SGLang's hierarchical cache (HiCache).

:class:`HiCacheStorage` is a HiCache L3 backend, loadable through SGLang's
dynamic backend factory::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tidepool",
        "module_path": "tidepool.sglang", "class_name": "HiCacheStorage",
        "interface_v1": 1, "socket": "/tmp/tidepool-agent.sock"}'

SGLang builds it as ``HiCacheStorage(storage_config, kwargs)``, hands it the
host KV pool with ``register_mem_pool_host``, and then, from its prefetch
and backup threads, asks ``batch_exists`` for the count of leading pages
present, reads pages into host token indices with ``batch_get_v1`` and
writes them with ``batch_set_v1`` (``interface_v1``), or, without
``interface_v1``, moves flat page tensors with ``batch_get`` and
``batch_set``.

A page's memory in the pool comes from the pool itself
(``get_page_buffer_meta``), for every layout SGLang has: one object per
buffer where a page is one or two contiguous buffers (MHA K and V, or MLA,
in the page-first layouts), one object gathered from the page's per-layer
buffers otherwise (layer-first). When the pool's memory is shared with the
agent (allocated by ``tidepool.mooncake.MooncakeHostMemAllocator``), the
agent reads and writes the pool directly; otherwise each page is one
memmove through the session's region, with the GIL released.

``batch_exists`` is a lookup, not a count: Tidepool leases the pages it
reports present, so the ``batch_get_v1`` that follows finds them even under
eviction pressure.

No method raises: SGLang's prefetch and backup threads die on an exception
(for the life of the process, taking L3 with them). A failure is logged
(logger ``tidepool.sglang``) and answered as a miss.
"""

import ctypes
import logging
import os
import threading
import time

from . import errors
from .client import DEFAULT_SHM_BYTES, DEFAULT_SOCKET, Client
from .hashing import SGLANG_SHA256, Namespace
from .hostmem import HOST

logger = logging.getLogger(__name__)

# A failing agent is reported at WARNING at most this often per method, and
# at DEBUG in between.
_WARN_EVERY = 10.0

try:  # SGLang's factory loads only subclasses of its HiCacheStorage.
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except Exception:  # noqa: BLE001 - any failure to import SGLang: stand alone
    _Base = object

try:
    from sglang.srt.observability.metrics_collector import StorageMetrics as _StorageMetrics
except Exception:  # noqa: BLE001
    _StorageMetrics = None


def _prefix_keys(extra_info):
    if extra_info is None:
        return None
    if isinstance(extra_info, dict):
        return extra_info.get("prefix_keys")
    return getattr(extra_info, "prefix_keys", None)


def _model(storage_config):
    """The namespace's model for SGLang's HiCacheStorageConfig: everything
    that changes a page's bytes."""
    c = storage_config
    model = getattr(c, "model_name", None) or "unknown"
    if not getattr(c, "is_mla_model", False):
        model += "@tp%d-%d" % (getattr(c, "tp_rank", 0), getattr(c, "tp_size", 1))
    if (getattr(c, "pp_size", 1) or 1) > 1:
        model += "@pp%d-%d" % (c.pp_rank, c.pp_size)
    if (getattr(c, "attn_cp_size", 1) or 1) > 1:
        model += "@cp%d-%d" % (c.attn_cp_rank, c.attn_cp_size)
    return model


class HiCacheStorage(_Base):
    """A HiCache storage backend on a Tidepool agent.

    ``HiCacheStorage(storage_config, kwargs)`` is how SGLang's dynamic
    factory builds it (``storage_config`` an SGLang HiCacheStorageConfig;
    its ``extra_config`` may name ``socket``, ``shm_bytes`` and
    ``tenant``). ``HiCacheStorage("model name", client=...)`` names the
    namespace directly. ``client`` shares a :class:`tidepool.Client` (not
    closed by close()).
    """

    def __init__(self, storage_config=None, kwargs=None, *, client=None, tenant="", socket=None,
                 shm_bytes=None, chain=True):
        if isinstance(storage_config, str):
            model, cfg, extra = storage_config, None, {}
        else:
            cfg = storage_config
            model = _model(cfg) if cfg is not None else "unknown"
            extra = dict(getattr(cfg, "extra_config", None) or {})
        extra.update(kwargs or {})
        self.storage_config = cfg
        self._model = model
        self._tenant = tenant or str(extra.get("tenant", "") or "")
        self._layout = "page_first" if getattr(cfg, "is_page_first_layout", False) else ""
        self.namespace = self._namespace()
        self._own = client is None
        if client is None:
            client = Client(socket=socket or extra.get("socket") or os.environ.get("TIDEPOOL_AGENT_SOCKET")
                            or DEFAULT_SOCKET,
                            shm_bytes=int(shm_bytes or extra.get("shm_bytes") or DEFAULT_SHM_BYTES),
                            client_name="sglang-hicache")
        self.client = client
        self.chain = chain
        self.mem_pool_host = None
        self._per_page = 1  # the pool's buffers per page, from get_page_buffer_meta
        self._warn_lock = threading.Lock()
        self._warned = {}  # method -> time.monotonic() of its last WARNING; guarded by _warn_lock
        self._stats_lock = threading.Lock()
        self._stats = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []}
        self._page_gb = 0.0
        HOST.users.add(self)  # told when shared memory it attached is freed

    def _forget(self, att):
        """Shared memory is being freed: the agent lets go of it too."""
        try:
            self.client.detach(att)
        except Exception as e:  # noqa: BLE001
            self._failed("detach", e)

    @classmethod
    def from_config(cls, storage_config, client=None, **kwargs):
        """HiCacheStorage(storage_config, client=client, ...)."""
        return cls(storage_config, client=client, **kwargs)

    def _namespace(self):
        # A page's bytes are laid out by the host pool's layout: pages of
        # one layout are never read into another.
        model = self._model + ("@" + self._layout.replace("_", "-") if self._layout else "")
        ns = Namespace(SGLANG_SHA256, model, self._tenant)
        ns.validate()
        return ns

    def register_mem_pool_host(self, mem_pool_host):
        """SGLang's hook, called once the backend is attached: the host KV
        pool (SGLang's HostKVCache) whose token indices batch_get_v1 and
        batch_set_v1 name."""
        self.mem_pool_host = mem_pool_host
        layout = getattr(mem_pool_host, "layout", None)
        if layout:
            self._layout = str(layout)
            self.namespace = self._namespace()
        page = getattr(mem_pool_host, "page_size", None)
        meta = getattr(mem_pool_host, "get_page_buffer_meta", None)
        if page and callable(meta) and getattr(mem_pool_host, "kv_buffer", None) is not None:
            try:
                import torch  # noqa: PLC0415 - SGLang's pools are torch tensors

                ptrs, sizes = meta(torch.arange(page, dtype=torch.int64))
                self._per_page = len(ptrs) if len(ptrs) <= 2 else 1
                self._page_gb = sum(sizes) / float(1 << 30)
            except Exception as e:  # noqa: BLE001
                self._failed("register_mem_pool_host", e)

    # Keys.

    def _key(self, key):
        return self.namespace.key(key)

    def _objects(self, keys, flat=False):
        """The object keys of pages: one per page, or one per buffer (K
        and V) where a page is two; flat pages (batch_get, batch_set) are
        objects of their own."""
        if flat:
            return [self._key(k) + "/flat" for k in keys]
        if self._per_page == 1:
            return [self._key(k) for k in keys]
        return [self._key(k) + "/%d" % j for k in keys for j in range(self._per_page)]

    def _parent(self, extra_info, flat=False):
        prefix = _prefix_keys(extra_info)
        if not prefix:
            return None
        return self._objects(prefix[-1:], flat)[-1]

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

    # Where pages are in the host pool.

    def _spans(self, host_indices, n):
        """Per object of n pages at host_indices, where its bytes are: an
        attached span of shared memory, or the page's parts to copy."""
        pool = self.mem_pool_host
        if pool is None:
            raise errors.FailedPrecondition("no host pool: SGLang calls register_mem_pool_host first")
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        if len(ptrs) % n or len(ptrs) != len(sizes):
            raise errors.Internal("the host pool answered %d buffers for %d pages" % (len(ptrs), n))
        per = len(ptrs) // n
        out = []
        if per <= 2:
            for p, s in zip(ptrs, sizes):
                a = HOST.find(p, s)
                out.append((a.att, p - a.addr, s) if a is not None else [(p, s, ctypes.memmove)])
        else:  # a page is many buffers (layer-first): one object gathered from them
            for i in range(n):
                out.append([(p, s, ctypes.memmove) for p, s in zip(ptrs[i * per:(i + 1) * per],
                                                                  sizes[i * per:(i + 1) * per])])
        return out

    @staticmethod
    def _length(span):
        return span[2] if isinstance(span, tuple) else sum(s for _, s, _ in span)

    def _pages(self, results, n):
        """Per page, whether all its objects succeeded."""
        per = len(results) // n if n else 1
        return [all(results[i * per:(i + 1) * per]) for i in range(n)]

    def _record(self, what, pages, started):
        took = time.monotonic() - started
        with self._stats_lock:
            self._stats[what + "_pgs"].append(pages)
            if took > 0 and self._page_gb:
                self._stats[what + "_bandwidth"].append(pages / took * self._page_gb)

    # Existence.

    def batch_exists(self, keys, extra_info=None):
        """The number of leading pages present, each leased for the gets
        that follow; 0 on failure."""
        if not keys:
            return 0
        try:
            return self.client.lookup(self._objects(keys)).matched // self._per_page
        except Exception as e:  # noqa: BLE001 - SGLang's threads die on any exception
            self._failed("batch_exists", e)
            return 0

    def exists(self, key):
        """Whether the page is present; False on failure."""
        return self.batch_exists([key]) == 1

    # Pages by host index: the v1 interface.

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        """Reads page i into the host pool at host_indices[i*page_size:]:
        per page True when all of it was there; all False on failure."""
        if not keys:
            return []
        try:
            started = time.monotonic()
            spans = self._spans(host_indices, len(keys))
            got = self.client.batch_get_regions(self._objects(keys), spans)
            ok = self._pages([not isinstance(r, errors.Error) and r == self._length(sp)
                              for r, sp in zip(got, spans)], len(keys))
            self._record("prefetch", sum(ok), started)
            return ok
        except Exception as e:  # noqa: BLE001
            self._failed("batch_get_v1", e)
            return [False] * len(keys)

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        """Writes page i from the host pool at host_indices[i*page_size:]:
        per page True when stored (or already there). extra_info's
        prefix_keys names the pages before keys[0], so pages chain to
        their parents. All False on failure."""
        if not keys:
            return []
        try:
            started = time.monotonic()
            spans = self._spans(host_indices, len(keys))
            res = self.client.batch_set_regions(self._objects(keys), spans, chain=self.chain,
                                                parent=self._parent(extra_info) if self.chain else None)
            ok = self._pages([r is True for r in res], len(keys))
            self._record("backup", sum(ok), started)
            return ok
        except Exception as e:  # noqa: BLE001
            self._failed("batch_set_v1", e)
            return [False] * len(keys)

    # Flat pages: the generic interface (tensors from get_dummy_flat_data_page
    # and get_data_page).

    def get(self, key, target_location=None, target_sizes=None):
        """The page read into target_location (a flat tensor or buffer) and
        that returned; None when absent or on failure."""
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        """Per page its flat tensor, filled (or bytes without
        target_locations); None where absent or on failure."""
        if not keys:
            return []
        try:
            objs = self._objects(keys, flat=True)
            if target_locations is None:
                return [None if isinstance(v, errors.Error) else v for v in self.client.batch_get(objs)]
            got = self.client.batch_get_into(objs, target_locations)
            return [t if not isinstance(r, errors.Error) and r and r == _nbytes(t) else None
                    for t, r in zip(target_locations, got)]
        except Exception as e:  # noqa: BLE001
            self._failed("batch_get", e)
            return [None] * len(keys)

    def set(self, key, value=None, target_location=None, target_sizes=None):
        """True when the page was stored."""
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        """True when every page was stored."""
        if not keys:
            return True
        values = values if values is not None else target_locations
        try:
            res = self.client.batch_set(self._objects(keys, flat=True), values, chain=self.chain)
            return all(r is True for r in res)
        except Exception as e:  # noqa: BLE001
            self._failed("batch_set", e)
            return False

    # Housekeeping.

    def clear(self):
        """Removes every page of this backend's namespace."""
        try:
            self.client.clear(self.namespace.prefix)
        except Exception as e:  # noqa: BLE001
            self._failed("clear", e)

    def get_stats(self):
        """Pages moved and bandwidths (GB/s) since the last call, as
        SGLang's StorageMetrics when SGLang is importable (else a dict of
        the same lists)."""
        with self._stats_lock:
            stats, self._stats = self._stats, {k: [] for k in self._stats}
        if _StorageMetrics is None:
            return stats
        m = _StorageMetrics()
        for k, v in stats.items():
            getattr(m, k).extend(v)
        return m

    def close(self):
        if self._own:
            self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _nbytes(t):
    if callable(getattr(t, "data_ptr", None)):
        return t.numel() * t.element_size()
    return memoryview(t).nbytes
