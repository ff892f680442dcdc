"""The client of `tidepool agent`: a gRPC unix socket for requests, a
shared-memory region for the values."""

import collections
import ctypes
import mmap
import os
import threading
import time

import grpc

from . import errors
from ._alloc import SpanAllocator, align
from ._proto import agent_pb2, agent_pb2_grpc, tidepool_pb2

DEFAULT_SOCKET = "/tmp/tidepool-agent.sock"
DEFAULT_SHM_BYTES = 256 << 20

#: The most keys one request to the agent may name; longer batches are
#: split.
MAX_BATCH_KEYS = 16384

#: The longest key the pool accepts, in bytes.
MAX_KEY_LEN = 4096

# Bounds a gRPC message: the agent's limit.
_MAX_MESSAGE = 64 << 20

_TIERS = {
    tidepool_pb2.TIER_HBM: "hbm",
    tidepool_pb2.TIER_DRAM: "dram",
    tidepool_pb2.TIER_SSD: "ssd",
}

#: One copy of a block: the store node holding it, its tier ("hbm", "dram"
#: or "ssd"), segment and offset, and the store's transfer engine address.
Replica = collections.namedtuple("Replica", "node tier segment endpoint offset")


class BlockInfo(collections.namedtuple("BlockInfo", "key size checksum replicas")):
    """A matched block: its key, size, CRC-32C and replicas, fastest tier
    first."""

    __slots__ = ()

    @property
    def tier(self):
        """The tier of the fastest replica."""
        return self.replicas[0].tier if self.replicas else ""

    @property
    def node(self):
        """The node of the fastest replica."""
        return self.replicas[0].node if self.replicas else ""


class Match:
    """The answer to lookup: the first ``matched`` keys are cached, and
    leased until ``lease_deadline`` (time.monotonic()); ``blocks[i]`` says
    where block i lives."""

    def __init__(self, matched, blocks, lease_ttl_ms, lease_deadline):
        self.matched = matched
        self.blocks = blocks
        self.lease_ttl_ms = lease_ttl_ms
        self.lease_deadline = lease_deadline

    def __len__(self):
        return self.matched

    @property
    def keys(self):
        return [b.key for b in self.blocks]

    @property
    def tiers(self):
        """Per matched block, the tier of its fastest replica."""
        return [b.tier for b in self.blocks]

    @property
    def nodes(self):
        """Per matched block, the node of its fastest replica."""
        return [b.node for b in self.blocks]

    def __repr__(self):
        return "Match(matched=%d, tiers=%r)" % (self.matched, self.tiers)


class _Region:
    """A session and its mapped shared-memory region."""

    def __init__(self, resp):
        self.session = resp.session
        self.size = resp.shm_bytes
        self.idle_timeout_ms = resp.idle_timeout_ms
        fd = os.open(resp.shm_path, os.O_RDWR | os.O_CLOEXEC)
        try:
            self._mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.view = memoryview(self._mm)
        self.alloc = SpanAllocator(self.size)

    def close(self):
        self.alloc.close()
        try:
            self.view.release()
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a slice; the mapping goes with it


def _tensor_view(obj, what):
    """A flat byte view of a CPU tensor (an object with data_ptr(), such as
    a torch.Tensor, which has no buffer protocol), or None for other
    objects. The caller keeps obj alive while the view is used."""
    if not callable(getattr(obj, "data_ptr", None)):
        return None
    if getattr(obj, "is_cuda", False) or str(getattr(obj, "device", "cpu")) != "cpu":
        raise errors.InvalidArgument("%s is on %s: give a host (CPU) tensor" % (what, obj.device))
    if not obj.is_contiguous():
        raise errors.InvalidArgument("%s is not contiguous" % what)
    n = obj.numel() * obj.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(obj.data_ptr())).cast("B")


def _source(value, i):
    """value's bytes as a flat memoryview (a copy only when it is not
    C-contiguous or has an exotic format)."""
    try:
        mv = memoryview(value)
    except TypeError:
        t = _tensor_view(value, "value %d" % i)
        if t is not None:
            return t
        raise errors.InvalidArgument(
            "value %d: %s does not support the buffer protocol" % (i, type(value).__name__)) from None
    try:
        return mv.cast("B")
    except TypeError:
        return memoryview(mv.tobytes())


def _target(buf, i):
    """buf as a flat writable memoryview, sharing its memory."""
    try:
        mv = memoryview(buf)
    except TypeError:
        t = _tensor_view(buf, "buffer %d" % i)
        if t is not None:
            return t
        raise errors.InvalidArgument(
            "buffer %d: %s does not support the buffer protocol" % (i, type(buf).__name__)) from None
    if mv.readonly:
        raise errors.InvalidArgument("buffer %d is read-only" % i)
    if not mv.c_contiguous:
        raise errors.InvalidArgument("buffer %d is not C-contiguous" % i)
    try:
        return mv.cast("B")
    except TypeError:  # an exotic format: view the same memory as bytes
        return memoryview((ctypes.c_ubyte * mv.nbytes).from_buffer(buf)).cast("B")


def nbytes(buf):
    """The size in bytes of a buffer or CPU tensor."""
    try:
        return memoryview(buf).nbytes
    except TypeError:
        if callable(getattr(buf, "data_ptr", None)):
            return buf.numel() * buf.element_size()
        raise errors.InvalidArgument("%s does not support the buffer protocol" % type(buf).__name__) from None


def _keys(keys):
    keys = list(keys)
    for i, k in enumerate(keys):
        if not isinstance(k, str):
            raise errors.InvalidArgument("key %d is %s, not a str" % (i, type(k).__name__))
    return keys


def _chunks(n):
    limit = MAX_BATCH_KEYS
    for i in range(0, n, limit):
        yield i, min(i + limit, n)


def _key_error(k):
    """The agent's verdict on a key it would refuse, or None."""
    if not k:
        return errors.InvalidArgument("empty key")
    n = len(k.encode("utf-8", "surrogatepass"))
    if n > MAX_KEY_LEN:
        return errors.InvalidArgument("key of %d bytes exceeds the %d-byte limit" % (n, MAX_KEY_LEN))
    return None


def _item(st):
    """None for success, else the item's Error."""
    if st.code == 0:
        return None
    return errors.from_code(st.code, st.message)


class Client:
    """A session with the local `tidepool agent`.

    ``socket`` is the agent's unix socket; ``shm_bytes`` the size of the
    shared-memory region the agent creates for this session, through which
    every value moves (a value, or a get's buffer, must fit in it; bigger
    batches are split). ``timeout`` bounds each request in seconds (None:
    no bound). ``wait`` is how long the constructor waits for the agent to
    come up (0: fail at once with Unavailable).

    Safe for concurrent use by threads. Use it as a context manager, or
    call close(). A session the agent forgot (it ended idle, or the agent
    restarted) is reopened transparently by the next request that needs it.

    Whole-request failures raise tidepool.Error subclasses; batch calls
    return one result per key, in order, where a failed item is the Error
    instance (not raised).
    """

    def __init__(self, socket=DEFAULT_SOCKET, shm_bytes=DEFAULT_SHM_BYTES, client_name=None,
                 timeout=60.0, wait=0.0):
        if shm_bytes <= 0:
            raise errors.InvalidArgument("shm_bytes %d: want a positive size" % shm_bytes)
        self.socket = socket
        self.client_name = client_name or "python-%d" % os.getpid()
        self._shm_bytes = shm_bytes
        self._timeout = timeout
        self._lock = threading.Lock()
        self._closed = False  # guarded by _lock
        self._region = None  # guarded by _lock
        self.reopened = 0  # sessions reopened after the agent forgot one
        target = socket if socket.startswith("unix:") else "unix:" + os.path.abspath(socket)
        self._channel = grpc.insecure_channel(target, options=[
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            # The agent is local: after it restarts, reconnect within a
            # second rather than gRPC's default backoff of up to 2 minutes.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ])
        self._stub = agent_pb2_grpc.AgentStub(self._channel)
        try:
            self._region = self._open(wait)
        except BaseException:
            self._channel.close()
            raise

    # Sessions.

    def _open(self, wait=0.0):
        """Opens a session and maps its region."""
        req = agent_pb2.OpenRequest(client=self.client_name, shm_bytes=self._shm_bytes)
        try:
            if wait > 0:
                resp = self._stub.Open(req, timeout=wait, wait_for_ready=True)
            else:
                resp = self._stub.Open(req, timeout=self._timeout)
        except grpc.RpcError as e:
            raise errors.from_rpc(e, "open a session with the agent at %s" % self.socket) from None
        try:
            return _Region(resp)
        except OSError as e:
            try:
                self._stub.Close(agent_pb2.SessionRef(session=resp.session), timeout=5)
            except grpc.RpcError:
                pass
            raise errors.Unavailable("map the session's region %s: %s (the agent must run as this user, "
                                     "in this pid namespace)" % (resp.shm_path, e)) from None

    def _current(self):
        with self._lock:
            if self._closed:
                raise errors.ClientClosed("client closed")
            return self._region

    def _reopen(self, failed):
        """Opens a new session unless another thread already replaced the
        failed one."""
        with self._lock:
            if self._closed:
                raise errors.ClientClosed("client closed")
            if self._region is not failed:
                return
            region = self._open()
            # The old region is unmapped once no request uses it.
            self._region = region
            self.reopened += 1

    def _session_call(self, what, fn):
        """Runs fn(region), reopening the session once if the agent no
        longer knows it (NOT_FOUND for the whole request)."""
        for attempt in range(2):
            region = self._current()
            try:
                return fn(region)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND and attempt == 0:
                    self._reopen(region)
                    continue
                raise errors.from_rpc(e, what) from None
        raise AssertionError("unreachable")

    def _call(self, method, req, what):
        self._current()
        try:
            return method(req, timeout=self._timeout)
        except grpc.RpcError as e:
            raise errors.from_rpc(e, what) from None

    @property
    def shm_bytes(self):
        """The size of the session's shared-memory region."""
        return self._current().size

    @property
    def session(self):
        """The agent's id of the current session."""
        return self._current().session

    def close(self):
        """Ends the session and unmaps its region; later calls raise
        ClientClosed. Safe to call more than once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            region, self._region = self._region, None
        try:
            self._stub.Close(agent_pb2.SessionRef(session=region.session), timeout=min(self._timeout or 5.0, 5.0))
        except grpc.RpcError:
            pass  # ended idle, or the agent is gone: nothing to end
        self._channel.close()
        region.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # Lookups.

    def lookup(self, keys):
        """Returns the Match of a chain of block keys: how many leading keys
        are cached, where each lives, and a read lease on them that the
        agent keeps for the gets that follow."""
        keys = _keys(keys)
        blocks = []
        lease_ttl_ms, deadline = 0, None
        for lo, hi in _chunks(len(keys)):
            asked = time.monotonic()
            resp = self._call(self._stub.Lookup, tidepool_pb2.LookupRequest(keys=keys[lo:hi]), "lookup")
            n = resp.matched
            if (n > hi - lo or len(resp.sizes) != n or len(resp.checksums) != n
                    or len(resp.replica_counts) != n
                    or len(resp.replica_segments) != len(resp.replica_offsets)
                    or sum(resp.replica_counts) != len(resp.replica_segments)):
                raise errors.Internal("lookup: malformed answer for %d keys" % (hi - lo))
            segs = resp.segments
            at = 0
            for i in range(n):
                c = resp.replica_counts[i]
                reps = []
                for j in range(at, at + c):
                    s = segs[resp.replica_segments[j]]
                    reps.append(Replica(s.node, _TIERS.get(s.tier, ""), s.segment, s.endpoint,
                                        resp.replica_offsets[j]))
                at += c
                blocks.append(BlockInfo(keys[lo + i], resp.sizes[i], resp.checksums[i], tuple(reps)))
            lease_ttl_ms = resp.lease_ttl_ms
            if n:
                end = asked + resp.lease_ttl_ms / 1000.0
                deadline = end if deadline is None else min(deadline, end)
            if n < hi - lo:
                break
        return Match(len(blocks), blocks, lease_ttl_ms, deadline)

    def batch_exists(self, keys):
        """Returns how many leading keys are present (SGLang's contract)."""
        keys = _keys(keys)
        count = 0
        for lo, hi in _chunks(len(keys)):
            resp = self._call(self._stub.BatchExists, tidepool_pb2.KeysRequest(keys=keys[lo:hi]), "batch exists")
            count += resp.count
            if resp.count < hi - lo:
                break
        return count

    def exists(self, key):
        """Whether key is present."""
        return self.batch_exists([key]) == 1

    # Gets.

    def _groups(self, idx, lengths, size):
        """Splits the items idx into runs whose aligned lengths fit a
        region of size bytes, at most MAX_BATCH_KEYS each."""
        group, total = [], 0
        for i in idx:
            n = align(lengths[i])
            if group and (total + n > size or len(group) >= MAX_BATCH_KEYS):
                yield group
                group, total = [], 0
            group.append(i)
            total += n
        if group:
            yield group

    def _get_group(self, keys, group, lengths, deliver):
        """Reads keys[group] into spans of lengths[group] bytes and calls
        deliver(i, view of the value) for each one read; returns
        {i: Error} for the rest."""
        total = sum(align(lengths[i]) for i in group)

        def attempt(region):
            base = region.alloc.alloc(total, self._timeout)
            try:
                spans, off = [], base
                for i in group:
                    spans.append(agent_pb2.Span(offset=off, length=lengths[i]))
                    off += align(lengths[i])
                resp = self._stub.BatchGet(agent_pb2.AgentGetRequest(
                    session=region.session, keys=[keys[i] for i in group], spans=spans),
                    timeout=self._timeout)
                if len(resp.results) != len(group) or len(resp.sizes) != len(group):
                    raise errors.Internal("batch get: %d results and %d sizes for %d keys"
                                          % (len(resp.results), len(resp.sizes), len(group)))
                failed = {}
                for i, sp, st, n in zip(group, spans, resp.results, resp.sizes):
                    err = _item(st)
                    if err is None and n > sp.length:
                        err = errors.Internal("batch get: %d bytes read into a span of %d" % (n, sp.length))
                    if err is not None:
                        failed[i] = err
                        continue
                    deliver(i, region.view[sp.offset:sp.offset + n])
                return failed
            finally:
                region.alloc.free(base, total)

        return self._session_call("batch get", attempt)

    def batch_get(self, keys):
        """Returns each key's value as bytes; None where the key is absent,
        and the item's Error where reading it failed otherwise (a
        ValueTooLarge where it does not fit the region).

        A lookup learns the values' sizes (and leases them): for keys that
        form a chain that is one request; each absent key costs another.
        """
        keys = _keys(keys)
        n = len(keys)
        out = [_key_error(k) for k in keys]  # a lookup would refuse the whole batch
        sizes = {}
        size = self._current().size
        i = 0
        while i < n:
            if out[i] is not None:
                i += 1
                continue
            j = i
            while j < n and out[j] is None and j - i < MAX_BATCH_KEYS:
                j += 1
            m = self.lookup(keys[i:j])
            for k, b in enumerate(m.blocks):
                if b.size > size:
                    out[i + k] = errors.ValueTooLarge(
                        "%r is %d bytes, more than the session's shared-memory region of %d bytes; "
                        "open the Client with a larger shm_bytes" % (b.key, b.size, size))
                else:
                    sizes[i + k] = b.size
            # Key i+matched, if any, is absent (or not complete yet): None.
            i += m.matched + (1 if m.matched < j - i else 0)

        def deliver(j, view):
            out[j] = bytes(view)

        for group in self._groups(sorted(sizes), sizes, size):
            for j, err in self._get_group(keys, group, sizes, deliver).items():
                out[j] = None if isinstance(err, errors.NotFound) else err
        return out

    def get(self, key):
        """key's value as bytes, or None if absent; raises on other
        failures."""
        v = self.batch_get([key])[0]
        if isinstance(v, errors.Error):
            raise v
        return v

    def batch_get_into(self, keys, buffers):
        """Reads each key's value into the start of its buffer (anything
        writable and C-contiguous with the buffer protocol: bytearray,
        memoryview, array.array, a numpy array; or a contiguous CPU tensor
        with data_ptr(), such as a torch.Tensor) and returns, per key, the
        number of bytes written; 0 where the key is absent, and the item's
        Error where reading it failed otherwise (OutOfRange: the value is
        longer than its buffer)."""
        keys = _keys(keys)
        buffers = list(buffers)
        if len(keys) != len(buffers):
            raise errors.InvalidArgument("%d keys and %d buffers" % (len(keys), len(buffers)))
        targets = [_target(b, i) for i, b in enumerate(buffers)]
        out = [0] * len(keys)
        size = self._current().size
        # A span longer than the region can't be; a value that long can't
        # be read either, and the agent says so (OutOfRange).
        lengths = [min(t.nbytes, size) for t in targets]

        def deliver(j, view):
            n = view.nbytes
            targets[j][:n] = view
            out[j] = n

        for group in self._groups(range(len(keys)), lengths, size):
            for j, err in self._get_group(keys, group, lengths, deliver).items():
                out[j] = 0 if isinstance(err, errors.NotFound) else err
        return out

    # Puts.

    def batch_set(self, keys, values, chain=False, parent=None):
        """Stores values (anything with the buffer protocol: bytes,
        bytearray, memoryview, numpy arrays; or CPU tensors with
        data_ptr()) under keys and returns, per
        key, True or the item's Error. A key that exists is left as it is
        and succeeds.

        With chain, the keys form a chain of blocks: keys[0] continues
        parent (None: a chain's first block) and keys[i] continues
        keys[i-1], so eviction takes a chain's leaves before their parents.

        Raises ValueTooLarge, storing nothing, when a value does not fit
        the session's region.
        """
        keys = _keys(keys)
        values = list(values)
        if len(keys) != len(values):
            raise errors.InvalidArgument("%d keys and %d values" % (len(keys), len(values)))
        if parent is not None and not isinstance(parent, str):
            raise errors.InvalidArgument("parent is %s, not a str" % type(parent).__name__)
        if parent and not chain:
            raise errors.InvalidArgument("a parent without chain=True")
        sources = [_source(v, i) for i, v in enumerate(values)]
        lengths = [s.nbytes for s in sources]
        size = self._current().size
        for i, n in enumerate(lengths):
            if n > size:
                raise errors.ValueTooLarge(
                    "value %d (%r) is %d bytes, more than the session's shared-memory region of "
                    "%d bytes; open the Client with a larger shm_bytes" % (i, keys[i], n, size))
        out = [True] * len(keys)
        prev = parent or ""
        for group in self._groups(range(len(keys)), lengths, size):
            total = sum(align(lengths[i]) for i in group)

            def attempt(region, group=group, total=total, prev=prev):
                base = region.alloc.alloc(total, self._timeout)
                try:
                    spans, off = [], base
                    for i in group:
                        n = lengths[i]
                        region.view[off:off + n] = sources[i]
                        spans.append(agent_pb2.Span(offset=off, length=n))
                        off += align(n)
                    return self._stub.BatchPut(agent_pb2.AgentPutRequest(
                        session=region.session, keys=[keys[i] for i in group], spans=spans,
                        chain=chain, parent=prev if chain else ""), timeout=self._timeout)
                finally:
                    region.alloc.free(base, total)

            resp = self._session_call("batch set", attempt)
            if len(resp.results) != len(group):
                raise errors.Internal("batch set: %d results for %d keys" % (len(resp.results), len(group)))
            for i, st in zip(group, resp.results):
                err = _item(st)
                if err is not None:
                    out[i] = err
            prev = keys[group[-1]]
        return out

    def set(self, key, value):
        """Stores value under key; raises on failure."""
        r = self.batch_set([key], [value])[0]
        if isinstance(r, errors.Error):
            raise r

    # Removal and stats.

    def remove(self, keys):
        """Removes keys; per key, True or the item's Error (NotFound: no
        such key)."""
        keys = _keys(keys)
        out = []
        for lo, hi in _chunks(len(keys)):
            resp = self._call(self._stub.Remove, tidepool_pb2.KeysRequest(keys=keys[lo:hi]), "remove")
            if len(resp.results) != hi - lo:
                raise errors.Internal("remove: %d results for %d keys" % (len(resp.results), hi - lo))
            for st in resp.results:
                err = _item(st)
                out.append(True if err is None else err)
        return out

    def clear(self, prefix):
        """Removes every object whose key starts with prefix (which must not
        be empty) and returns how many."""
        if not isinstance(prefix, str) or not prefix:
            raise errors.InvalidArgument("clear needs a non-empty prefix")
        resp = self._call(self._stub.Clear, agent_pb2.ClearRequest(prefix=prefix), "clear")
        return resp.removed

    def stats(self):
        """The agent's counters, as a dict (lookups, blocks_probed,
        blocks_matched, gets, get_bytes, puts, put_bytes, errors,
        sessions), plus this client's session and reopened count. Also
        keeps the session from ending idle."""

        def attempt(region):
            return self._stub.Stats(agent_pb2.SessionRef(session=region.session), timeout=self._timeout)

        resp = self._session_call("stats", attempt)
        out = {f.name: getattr(resp, f.name) for f in resp.DESCRIPTOR.fields}
        out["session"] = self.session
        out["reopened"] = self.reopened
        return out

    def __repr__(self):
        return "Client(socket=%r, shm_bytes=%d)" % (self.socket, self._shm_bytes)
