"""A helper shaped for vLLM's KV connectors.

vLLM asks a connector, per request, how many of its prompt's tokens are
cached outside the GPU (``get_num_new_matched_tokens``), then loads those
blocks and later saves new ones. :class:`KVConnector` does each of these for
a request's token ids: it hashes them with vLLM's own scheme
(``vllm-sha256-cbor``), finds the cached prefix with one lookup (which
leases it for the load that follows), and loads or saves whole blocks
between the pool and per-block buffers (e.g. views of a host staging area).
Saved blocks are chained: each names its parent, so eviction takes a
prompt's leaves before its prefix.

The keys carry the block hashes vLLM computes only when vLLM runs with
``--prefix-caching-hash-algo sha256_cbor`` (its default, ``sha256``, and
the ``xxhash`` ones hash other bytes: pickles, or another digest) and with
PYTHONHASHSEED set to the seed given here: vLLM derives its root hash from
PYTHONHASHSEED, and picks a random one when it is unset. Otherwise the keys
are still consistent among the processes that use this class with the same
seed; they just are not vLLM's own block hashes.

Storage failures (the agent restarting, say) are never raised to vLLM's
scheduler: they are logged (logger ``tidepool.vllm``) and answered as
misses, and load and save report what succeeded.
"""

import logging

from . import errors
from .client import nbytes
from .hashing import VLLM_SHA256_CBOR, Hasher, Namespace

logger = logging.getLogger(__name__)


class KVConnector:
    """Matches, loads and saves a request's KV blocks in the pool.

    ``client`` is a :class:`tidepool.Client`; ``model`` names everything
    that changes a block's bytes (model, dtype, TP rank, layout);
    ``block_size`` and ``seed`` are vLLM's block size and PYTHONHASHSEED
    (None: $PYTHONHASHSEED); the keys are vLLM's block hashes only for a
    vLLM run with ``--prefix-caching-hash-algo sha256_cbor`` and that
    seed. ``extra`` arguments below are each block's
    extra keys as vLLM builds them (LoRA name, multimodal hashes, cache
    salt), None for none.
    """

    def __init__(self, client, model, block_size=16, seed=None, tenant="", scheme=VLLM_SHA256_CBOR):
        self.client = client
        self.hasher = Hasher(scheme, block_size, seed)
        self.namespace = Namespace(scheme, model, tenant)
        self.namespace.validate()

    @property
    def block_size(self):
        return self.hasher.block_size

    def block_keys(self, token_ids, extra=None):
        """The object keys of the request's full blocks, in order."""
        return self.namespace.keys(self.hasher, token_ids, extra=extra)

    def get_num_matched_tokens(self, token_ids, extra=None):
        """The number of leading tokens whose blocks are cached: full
        blocks matched times the block size (0 when the lookup fails). The
        matched blocks are leased for the load that follows."""
        keys = self.block_keys(token_ids, extra)
        if not keys:
            return 0
        try:
            return self.client.lookup(keys).matched * self.block_size
        except errors.Error as e:
            logger.warning("tidepool: lookup of %d blocks failed; answering none cached: %r", len(keys), e)
            return 0

    def get_num_new_matched_tokens(self, token_ids, num_computed_tokens, extra=None):
        """vLLM's question: (tokens beyond num_computed_tokens that can be
        loaded, whether the load is asynchronous). As vLLM's own prefix
        cache does, a prompt that is cached whole still recomputes its
        last token, so at most len(token_ids) - 1 tokens count."""
        limit = max(len(token_ids) - 1, 0) // self.block_size * self.block_size
        matched = min(self.get_num_matched_tokens(token_ids[:limit], extra), limit)
        return max(matched - num_computed_tokens, 0), False

    def load(self, token_ids, buffers, extra=None):
        """Reads the request's leading blocks into buffers (buffers[i] is
        block i's, and must be exactly its size) and returns how many
        leading blocks were loaded (0 when the load fails as a whole): the
        loaded tokens are that times the block size."""
        keys = self.block_keys(token_ids, extra)[:len(buffers)]
        if not keys:
            return 0
        try:
            m = self.client.lookup(keys)
            if not m.matched:
                return 0
            got = self.client.batch_get_into(keys[:m.matched], buffers[:m.matched])
        except errors.Error as e:
            logger.warning("tidepool: load of %d blocks failed; none loaded: %r", len(keys), e)
            return 0
        n = 0
        for r, b in zip(got, buffers):
            if isinstance(r, errors.Error) or r != nbytes(b):
                break
            n += 1
        return n

    def save(self, token_ids, buffers, extra=None, skip_cached=True):
        """Stores the request's leading blocks from buffers (buffers[i] is
        block i's bytes) as a chain, and returns how many leading blocks
        are now stored (up to the first that failed). With skip_cached,
        blocks already in the pool are not sent again."""
        keys = self.block_keys(token_ids, extra)[:len(buffers)]
        if not keys:
            return 0
        start = 0
        if skip_cached:
            try:
                start = self.client.batch_exists(keys)
            except errors.Error as e:
                logger.warning("tidepool: counting the cached blocks failed; saving them all: %r", e)
        if start == len(keys):
            return start
        parent = keys[start - 1] if start else None
        try:
            res = self.client.batch_set(keys[start:], buffers[start:len(keys)], chain=True, parent=parent)
        except errors.Error as e:
            logger.warning("tidepool: save of %d blocks failed: %r", len(keys) - start, e)
            return start
        n = start
        for r in res:
            if r is not True:
                break
            n += 1
        return n
