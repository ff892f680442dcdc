"""A storage backend for SGLang's hierarchical cache (HiCache).

:class:`HiCacheStorage` has the method shapes of SGLang's
``sglang.srt.mem_cache.hicache_storage.HiCacheStorage`` so it can sit behind
HiCache's storage layer: SGLang hands it page keys (the hex page hashes of
``sglang-sha256``), asks ``batch_exists`` for the count of leading pages it
has, reads pages into host memory with ``batch_get_v1`` and writes them with
``batch_set_v1``. Host memory is given as a list of writable buffers, one
per page (SGLang passes host indices into its host pool; an adapter turns
those into the pool's page views, e.g. ``host_pool.get_page(i)``-style
tensors, which expose the buffer protocol).

Keys are placed in a :class:`tidepool.hashing.Namespace` so that pages of
different models, parallel ranks and tenants never share an object key.

``batch_exists`` is a lookup, not a count: Tidepool leases the pages it
reports present, so the ``batch_get_v1`` that follows finds them even under
eviction pressure (no stall on a page promised and then evicted).
"""

from . import errors
from .client import DEFAULT_SHM_BYTES, DEFAULT_SOCKET, Client, nbytes
from .hashing import SGLANG_SHA256, Namespace


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
    model and its TP rank for non-MLA models; see :meth:`from_config`).
    ``chain`` records each page's parent (the previous page) so that
    eviction takes a prefix's leaves first.
    """

    def __init__(self, model, client=None, tenant="", socket=DEFAULT_SOCKET,
                 shm_bytes=DEFAULT_SHM_BYTES, scheme=SGLANG_SHA256, chain=True):
        self.namespace = Namespace(scheme, model, tenant)
        self.namespace.validate()
        self._own = client is None
        self.client = client if client is not None else Client(
            socket=socket, shm_bytes=shm_bytes, client_name="sglang-hicache")
        self.chain = chain

    @classmethod
    def from_config(cls, storage_config, client=None, **kwargs):
        """Builds the backend from SGLang's HiCacheStorageConfig (any object
        with its fields): the model name, with the TP rank and size unless
        the model is MLA (whose pages are the same on every rank), and the
        PP rank and size where pipelined. extra_config may name
        "socket", "shm_bytes" and "tenant"."""
        model = getattr(storage_config, "model_name", None) or "unknown"
        if not getattr(storage_config, "is_mla_model", False):
            model += "@tp%d-%d" % (getattr(storage_config, "tp_rank", 0), getattr(storage_config, "tp_size", 1))
        if getattr(storage_config, "pp_size", 1) > 1:
            model += "@pp%d-%d" % (storage_config.pp_rank, storage_config.pp_size)
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        for name in ("socket", "shm_bytes", "tenant"):
            if name in extra and name not in kwargs:
                kwargs[name] = extra[name]
        return cls(model, client=client, **kwargs)

    def _key(self, key):
        return self.namespace.key(key)

    def _keys(self, keys):
        return [self.namespace.key(k) for k in keys]

    def _parent(self, extra_info):
        prefix = _prefix_keys(extra_info)
        return self._key(prefix[-1]) if prefix else None

    # Existence.

    def batch_exists(self, keys, extra_info=None):
        """The number of leading keys present, each leased for the gets
        that follow."""
        if not keys:
            return 0
        return self.client.lookup(self._keys(keys)).matched

    def exists(self, key):
        return self.client.exists(self._key(key))

    # Zero-copy pages: the v1 interface.

    def batch_get_v1(self, keys, buffers, extra_info=None):
        """Reads page i into buffers[i]; per key, True when the page was
        there and filled its buffer exactly."""
        if not keys:
            return []
        got = self.client.batch_get_into(self._keys(keys), buffers)
        return [_ok(r, nbytes(b)) for r, b in zip(got, buffers)]

    def batch_set_v1(self, keys, buffers, extra_info=None):
        """Writes page i from buffers[i]; per key, True when stored (or
        already there). extra_info.prefix_keys, when given, names the pages
        before keys[0]: the last one is keys[0]'s parent."""
        if not keys:
            return []
        try:
            res = self.client.batch_set(self._keys(keys), buffers, chain=self.chain,
                                        parent=self._parent(extra_info) if self.chain else None)
        except errors.ValueTooLarge:
            return [False] * len(keys)
        return [r is True for r in res]

    # The older interface: values as bytes.

    def get(self, key, target_location=None, target_sizes=None):
        """The page as bytes, or None; with target_location (a writable
        buffer) the page is read into it and target_location returned."""
        if target_location is not None:
            return target_location if self.batch_get_v1([key], [target_location])[0] else None
        v = self.client.batch_get([self._key(key)])[0]
        return None if isinstance(v, errors.Error) else v

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        if target_locations is not None:
            ok = self.batch_get_v1(keys, target_locations)
            return [t if good else None for t, good in zip(target_locations, ok)]
        if not keys:
            return []
        return [None if isinstance(v, errors.Error) else v for v in self.client.batch_get(self._keys(keys))]

    def set(self, key, value=None, target_location=None, target_sizes=None):
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        """True when every page was stored."""
        return all(self.batch_set_v1(keys, values if values is not None else target_locations))

    # Housekeeping.

    def clear(self):
        """Removes every page of this backend's namespace."""
        self.client.clear(self.namespace.prefix)

    def get_stats(self):
        """The agent's counters (see Client.stats)."""
        return self.client.stats()

    def close(self):
        if self._own:
            self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
