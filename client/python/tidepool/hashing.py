"""Block hashing as inference engines do it, and Tidepool's key namespace.

The Python twin of the Go package client/kvhash: the same three schemes,
byte for byte, and the same key format. An engine cuts a prompt's token ids
into blocks of a fixed size and hashes them into a chain, each block's hash
covering its parent's; only full blocks are hashed.

- ``vllm-sha256-cbor``: vLLM's sha256_cbor prefix caching. Block hash =
  SHA-256 of ``cbor2.dumps((parent, tuple(tokens), extra_keys),
  canonical=True)``; the first block's parent is the root hash, SHA-256 of
  the canonical CBOR of the seed string (vLLM's PYTHONHASHSEED). Extra keys
  are None or a tuple (a LoRA name, (multimodal hash, offset) pairs, a cache
  salt). Block size 16.
- ``sglang-sha256``: SGLang HiCache's page hash: SHA-256 over the parent's
  32-byte digest (nothing for the first page) and each token as 4 bytes
  little-endian. Page size 64.
- ``xxh3-64``: Dynamo's chain: a block's content hash is XXH3-64 (seed 1337)
  of its tokens as 4-byte little-endian words; the first block's chain hash
  is its content hash, every later block's XXH3-64 of the parent's chain
  hash and the content hash, each as 8 bytes little-endian. A hash is the
  chain hash as 8 bytes big-endian, so its hex form is ``%016x``.

A :class:`Namespace` turns hashes into object keys,
``kv/SCHEME/MODEL/TENANT/HEX`` (model and tenant escaped as Go's
url.PathEscape does), so that blocks of different schemes, models and
tenants never share a key.

Example::

    h = Hasher(SGLANG_SHA256, block_size=64)
    ns = Namespace(SGLANG_SHA256, "meta-llama/Llama-3.1-8B", tenant="acme")
    blocks = ns.blocks(h, token_ids)    # [Block(hash, key, parent), ...]

Errors are :class:`HashError` (a ValueError) subclasses.
"""

import collections
import hashlib
import operator
import os
import struct
import urllib.parse

import cbor2
import xxhash

VLLM_SHA256_CBOR = "vllm-sha256-cbor"
SGLANG_SHA256 = "sglang-sha256"
XXH3 = "xxh3-64"

#: Every scheme, in a stable order.
SCHEMES = (VLLM_SHA256_CBOR, SGLANG_SHA256, XXH3)

#: Dynamo's XXH3 seed.
DEFAULT_XXH3_SEED = 1337

#: The longest object key Tidepool accepts.
MAX_KEY_LEN = 4096

_MAX_TOKEN = 2**32 - 1
_MAX_U64 = 2**64 - 1


class HashError(ValueError):
    """A hashing or namespace error."""


class SchemeError(HashError):
    """The scheme is not one of SCHEMES."""


class BlockSizeError(HashError):
    """The block size is not positive."""


class SeedError(HashError):
    """The seed does not suit the scheme."""


class TokenError(HashError):
    """A token id is outside 0..2**32-1."""


class ExtraKeysError(HashError):
    """Extra keys given to a scheme without them, or a value with no
    encoding."""


class ParentError(HashError):
    """A parent hash of the wrong length for the scheme."""


class NamespaceError(HashError):
    """A namespace without a model, of another scheme than its hasher, or
    too long for an object key."""


def default_block_size(scheme):
    """The block size the scheme's engine uses: 16 tokens for vLLM, 64 for
    the others."""
    return 16 if scheme == VLLM_SHA256_CBOR else 64


def hash_size(scheme):
    """The length in bytes of the scheme's hashes: 32, or 8 for xxh3-64; 0
    for an unknown scheme."""
    if scheme in (VLLM_SHA256_CBOR, SGLANG_SHA256):
        return 32
    if scheme == XXH3:
        return 8
    return 0


def parse_hash(s):
    """Parses the hex form of a hash."""
    try:
        return bytes.fromhex(s)
    except ValueError as e:
        raise ParentError("bad hash %r: %s" % (s, e)) from None


def _parse_u64(seed):
    """Parses an xxh3 seed as Go's strconv.ParseUint(s, 0, 64) does:
    decimal, 0x/0o/0b prefixed, or a leading 0 for octal."""
    if isinstance(seed, bool):
        raise SeedError("xxh3-64 seed %r: want an unsigned 64-bit integer" % (seed,))
    if isinstance(seed, int):
        v = seed
    else:
        s = str(seed)
        if not s or s != s.strip() or s[0] in "+-":
            raise SeedError("xxh3-64 seed %r: want an unsigned 64-bit integer" % (seed,))
        try:
            if len(s) > 1 and s[0] == "0" and s[1] in "01234567_":
                v = int(s[1:], 8)
            else:
                v = int(s, 0)
        except ValueError:
            raise SeedError("xxh3-64 seed %r: want an unsigned 64-bit integer" % (seed,)) from None
    if not 0 <= v <= _MAX_U64:
        raise SeedError("xxh3-64 seed %r: want an unsigned 64-bit integer" % (seed,))
    return v


def _tokens(ids):
    """Token ids as a list of ints, each checked to fit in 32 bits."""
    out = []
    for i, t in enumerate(ids):
        try:
            v = operator.index(t)
        except TypeError:
            raise TokenError("token %d is %r, not an integer" % (i, t)) from None
        if isinstance(t, bool) or not 0 <= v <= _MAX_TOKEN:
            raise TokenError("token %d is %r" % (i, t))
        out.append(v)
    return out


def _extra_value(v, where):
    """v as cbor2 encodes it like kvhash: None, bool, int (-2**63 ..
    2**64-1), str, bytes, and lists or tuples of these (as tuples)."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, int):
        if not -2**63 <= v <= _MAX_U64:
            raise ExtraKeysError("%s: integer %d is outside -2**63 .. 2**64-1" % (where, v))
        return v
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise ExtraKeysError("%s: text %r is not valid UTF-8" % (where, v)) from None
        return v
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    if isinstance(v, (list, tuple)):
        return tuple(_extra_value(e, where) for e in v)
    try:
        return operator.index(v)  # numpy integers and the like
    except TypeError:
        pass
    raise ExtraKeysError("%s: %s has no CBOR encoding here (want None, bool, int, str, bytes "
                         "or a list/tuple of these)" % (where, type(v).__name__))


def _sha256_cbor(x):
    return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()


class Hasher:
    """Hashes token lists into chains of block hashes for one scheme.

    ``block_size`` 0 picks the scheme's default. ``seed`` is, for
    vllm-sha256-cbor, vLLM's PYTHONHASHSEED as a string, used verbatim (""
    is the empty string; None reads $PYTHONHASHSEED and fails without it,
    since vLLM hashes a random root then and can't be matched); for xxh3-64
    an unsigned 64-bit integer or its decimal / 0x-hex string, None meaning
    DEFAULT_XXH3_SEED; sglang-sha256 takes none.

    Immutable, so safe to share between threads.
    """

    def __init__(self, scheme, block_size=0, seed=None):
        if scheme not in SCHEMES:
            raise SchemeError("unknown scheme %r (want %s, %s or %s)" % ((scheme,) + SCHEMES))
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise BlockSizeError("block size %r is not an integer" % (block_size,))
        if block_size < 0:
            raise BlockSizeError("block size must be positive, got %d" % block_size)
        self._scheme = scheme
        self._block_size = block_size or default_block_size(scheme)
        self._root = None
        self._seed = None
        if scheme == VLLM_SHA256_CBOR:
            if seed is None:
                seed = os.environ.get("PYTHONHASHSEED")
                if seed is None:
                    raise SeedError("vllm-sha256-cbor needs a seed: vLLM's PYTHONHASHSEED "
                                    "(pass seed=..., or set $PYTHONHASHSEED)")
            if isinstance(seed, int) and not isinstance(seed, bool):
                seed = str(seed)
            if not isinstance(seed, str):
                raise SeedError("vllm-sha256-cbor seed %r: want a string" % (seed,))
            try:
                seed.encode("utf-8")
            except UnicodeEncodeError:
                raise SeedError("vllm-sha256-cbor seed is not valid UTF-8") from None
            self._root = _sha256_cbor(seed)
        elif scheme == SGLANG_SHA256:
            if seed not in (None, ""):
                raise SeedError("sglang-sha256 takes no seed")
        else:
            self._seed = DEFAULT_XXH3_SEED if seed in (None, "") else _parse_u64(seed)

    @property
    def scheme(self):
        return self._scheme

    @property
    def block_size(self):
        """Tokens per block."""
        return self._block_size

    @property
    def root(self):
        """vllm-sha256-cbor's root hash, the parent of a prompt's first
        block (vLLM's NONE_HASH); None for the other schemes."""
        return self._root

    def hash(self, tokens, parent=None, extra=None):
        """Returns the chain hashes (bytes) of the full blocks of tokens, one
        per block; a trailing partial block is ignored.

        ``parent`` is the hash (bytes, or its hex) of the block just before
        tokens[0], to extend a chain; None starts a prompt. ``extra[i]`` is
        block i's extra keys, for vllm-sha256-cbor only: None (and every
        block past the end of extra) hashes as null, anything else as a
        tuple of its values.
        """
        size = hash_size(self._scheme)
        if isinstance(parent, str):
            parent = parse_hash(parent)
        parent = bytes(parent) if parent else b""
        if parent and len(parent) != size:
            raise ParentError("parent hash of %d bytes, want %d for %s" % (len(parent), size, self._scheme))
        extra = list(extra) if extra is not None else []
        if self._scheme != VLLM_SHA256_CBOR:
            for i, e in enumerate(extra):
                if e is not None:
                    raise ExtraKeysError("block %d: %s takes no extra keys" % (i, self._scheme))
        tokens = _tokens(tokens)
        bs = self._block_size
        n = len(tokens) // bs
        blocks = [tokens[i * bs:(i + 1) * bs] for i in range(n)]
        if self._scheme == VLLM_SHA256_CBOR:
            return self._vllm(blocks, parent, extra)
        if self._scheme == SGLANG_SHA256:
            return self._sglang(blocks, parent)
        return self._xxh3(blocks, parent)

    def _vllm(self, blocks, parent, extra):
        parent = parent or self._root
        out = []
        for i, block in enumerate(blocks):
            keys = None
            if i < len(extra) and extra[i] is not None:
                if not isinstance(extra[i], (list, tuple)):
                    raise ExtraKeysError("block %d: extra keys %r are not a list or tuple" % (i, extra[i]))
                keys = _extra_value(extra[i], "block %d" % i)
            try:
                parent = _sha256_cbor((parent, tuple(block), keys))
            except (cbor2.CBOREncodeError, UnicodeEncodeError) as e:
                raise ExtraKeysError("block %d: %s" % (i, e)) from None
            out.append(parent)
        return out

    @staticmethod
    def _sglang(blocks, parent):
        out = []
        for block in blocks:
            d = hashlib.sha256(parent)
            d.update(struct.pack("<%dI" % len(block), *block))
            parent = d.digest()
            out.append(parent)
        return out

    def _xxh3(self, blocks, parent):
        seq = int.from_bytes(parent, "big") if parent else None
        out = []
        for block in blocks:
            h = xxhash.xxh3_64_intdigest(struct.pack("<%dI" % len(block), *block), seed=self._seed)
            if seq is None:
                seq = h
            else:
                seq = xxhash.xxh3_64_intdigest(struct.pack("<QQ", seq, h), seed=self._seed)
            out.append(seq.to_bytes(8, "big"))
        return out

    def __repr__(self):
        return "Hasher(%r, block_size=%d)" % (self._scheme, self._block_size)


# Go's url.PathEscape leaves these unescaped besides letters, digits and
# "-_.~" (which urllib.parse.quote always keeps).
_PATH_SEGMENT_SAFE = "$&+:=@"


def path_escape(s):
    """Escapes s as Go's url.PathEscape does: "/" becomes %2F, so a key
    splits unambiguously on "/"."""
    return urllib.parse.quote(s, safe=_PATH_SEGMENT_SAFE)


#: One full block of a prompt: its hash (bytes), its object key, and its
#: parent block's key ("" for a prompt's first block).
Block = collections.namedtuple("Block", "hash key parent")


class Namespace:
    """Places a scheme's block hashes under object keys of their own:
    ``kv/SCHEME/MODEL/TENANT/HEX``.

    ``model`` must name everything that changes a block's bytes (the model
    and, where they differ, its dtype, parallel rank and layout); ``tenant``
    may be empty.
    """

    def __init__(self, scheme, model, tenant=""):
        self.scheme = scheme
        self.model = model
        self.tenant = tenant

    @property
    def prefix(self):
        """The part of every key before the hash, ending in "/"."""
        return "kv/%s/%s/%s/" % (self.scheme, path_escape(self.model), path_escape(self.tenant))

    def key(self, h):
        """The object key of block hash h (bytes, or its hex form)."""
        if not isinstance(h, str):
            h = bytes(h).hex()
        return self.prefix + h

    def validate(self):
        """Raises unless the namespace makes valid keys: a known scheme, a
        model, and keys no longer than MAX_KEY_LEN."""
        if hash_size(self.scheme) == 0:
            raise SchemeError("unknown scheme %r" % (self.scheme,))
        if not self.model:
            raise NamespaceError("no model")
        n = len(self.prefix) + 2 * hash_size(self.scheme)
        if n > MAX_KEY_LEN:
            raise NamespaceError("keys would be %d bytes, more than %d" % (n, MAX_KEY_LEN))

    def blocks(self, hasher, tokens, parent=None, extra=None):
        """Hashes tokens with hasher, as Hasher.hash does, and returns the
        full blocks as Blocks. Block i's parent is block i-1; the first
        block's parent is parent's key, or "" when parent is None."""
        self.validate()
        if self.scheme != hasher.scheme:
            raise NamespaceError("namespace of %s, hasher of %s" % (self.scheme, hasher.scheme))
        if isinstance(parent, str):
            parent = parse_hash(parent)
        hashes = hasher.hash(tokens, parent, extra)
        prev = self.key(parent) if parent else ""
        out = []
        for h in hashes:
            key = self.key(h)
            out.append(Block(h, key, prev))
            prev = key
        return out

    def keys(self, hasher, tokens, parent=None, extra=None):
        """The object keys of tokens' full blocks."""
        return [b.key for b in self.blocks(hasher, tokens, parent, extra)]

    def __eq__(self, other):
        return isinstance(other, Namespace) and (self.scheme, self.model, self.tenant) == (
            other.scheme, other.model, other.tenant)

    def __repr__(self):
        return "Namespace(%r, %r, %r)" % (self.scheme, self.model, self.tenant)
