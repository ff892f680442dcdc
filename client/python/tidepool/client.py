"""The client of `tidepool agent`: a gRPC unix socket for requests, a
shared-memory region for the values."""

import collections
import ctypes
import errno
import mmap
import os
import socket
import stat
import struct
import threading
import time
import weakref

import grpc

from . import errors
from ._alloc import ALIGN, SessionRetired, SpanAllocator, align
from ._proto import agent_pb2, agent_pb2_grpc, tidepool_pb2, tidepool_pb2_grpc

DEFAULT_SOCKET = "/tmp/tidepool-agent.sock"
DEFAULT_SHM_BYTES = 256 << 20

#: The most keys one request to the agent may name; longer batches are
#: split.
MAX_BATCH_KEYS = 16384

#: The longest key the pool accepts, in bytes.
MAX_KEY_LEN = 4096

# Bounds a gRPC message: the agent's limit.
_MAX_MESSAGE = 64 << 20

# The trailer in which a master that is not the leader names it.
_LEADER_TRAILER = "tidepool-leader"

# Bounds a Close, which the agent answers once the session's requests in
# flight are done.
_CLOSE_TIMEOUT = 5.0

# The codes a get or put can end with while the agent's handler may still
# be running: the client stopped waiting (a deadline, a cancellation) or
# lost the connection. The agent itself fails a whole BatchGet or BatchPut
# only with INVALID_ARGUMENT or NOT_FOUND (items fail one by one), so none
# of these is its answer.
_UNANSWERED = frozenset((grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                         grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN))

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
    """A session and its mapped shared-memory region.

    ``users`` (the calls using it), ``retired`` (no new call takes it: the
    session was abandoned mid-request or the agent forgot it), ``ending``
    and ``ended`` (the agent answered Close, or does not know the session)
    are guarded by the owning Client's lock.
    """

    def __init__(self, resp, want):
        self.session = resp.session
        self.size = resp.shm_bytes
        self.idle_timeout_ms = resp.idle_timeout_ms
        if self.size < want:
            raise errors.Internal("the agent made a region of %d bytes for a request of %d" % (self.size, want))
        self._mm = _map_memfd(resp.shm_path, self.size)
        self.view = memoryview(self._mm)
        # For memmove; valid while mapped (unmap waits for the calls).
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self.attached = {}  # Attachment -> its region id in this session
        self.alloc = SpanAllocator(self.size)
        self.users = 0
        self.retired = False
        self.ending = False
        self.ended = False
        self.unmapped = False

    def unmap(self, close_alloc=True):
        """Unmaps the region (this process's view only: the agent's mapping
        of the memfd is its own)."""
        if self.unmapped:
            return
        self.unmapped = True
        if close_alloc:
            self.alloc.close()
        try:
            self.view.release()
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a slice; the mapping goes with it


def _refuse(path, why):
    return errors.PermissionDenied(
        "refusing to map the session's region %s: %s; only a region that `tidepool agent` running as "
        "this user (uid %d) created is trusted with values" % (path, why, os.getuid()))


def _map_memfd(path, size):
    """Maps path, which must be a memfd owned by this user and size bytes
    long, read-write and shared. Raises PermissionDenied for anything else,
    Unavailable when it cannot be opened at all."""
    try:
        link = os.readlink(path)
    except OSError as e:
        if e.errno == errno.EINVAL:  # not a link, so not /proc/PID/fd/N
            raise _refuse(path, "it is not an agent's /proc/PID/fd/N") from None
        raise errors.Unavailable("map the session's region %s: %s (the agent must run as this user, "
                                 "in this pid namespace)" % (path, e)) from None
    if not link.startswith("/memfd:"):
        raise _refuse(path, "it names %r, not a memfd" % link)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        raise errors.Unavailable("map the session's region %s: %s (the agent must run as this user, "
                                 "in this pid namespace)" % (path, e)) from None
    try:
        # What was opened, not what the path named a moment before.
        link = os.readlink("/proc/self/fd/%d" % fd)
        st = os.fstat(fd)
        if not link.startswith("/memfd:") or not stat.S_ISREG(st.st_mode):
            raise _refuse(path, "it opened %r, not a memfd" % link)
        if st.st_uid != os.getuid():
            raise _refuse(path, "it is owned by uid %d" % st.st_uid)
        if st.st_size != size:
            raise _refuse(path, "it is %d bytes, not the %d the agent announced" % (st.st_size, size))
        try:
            return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise errors.Unavailable("map the session's region %s: %s" % (path, e)) from None
    finally:
        os.close(fd)


def _socket_path(target):
    """The filesystem path of a gRPC unix target."""
    for prefix in ("unix://", "unix:"):
        if target.startswith(prefix):
            return target[len(prefix):]
    return target


def _check_peer(path, wait):
    """Returns once the process listening on the unix socket path runs as
    this user (its SO_PEERCRED uid). Raises PermissionDenied when it does
    not, and Unavailable when nothing listens there within wait seconds."""
    deadline = time.monotonic() + max(wait, 0.0)
    delay = 0.01
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.settimeout(5.0)
            s.connect(path)
            creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            break
        except OSError as e:
            err = e
        finally:
            s.close()
        left = deadline - time.monotonic()
        # EPIPE: seen, rarely, from a listening agent just after a forked
        # child of this process exited; the next connect succeeds.
        if left <= 0 or err.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN, errno.EPIPE):
            raise errors.Unavailable("open a session with the agent at %s: %s" % (path, err)) from None
        time.sleep(min(delay, left))
        delay = min(2 * delay, 0.2)
    pid, uid, _ = struct.unpack("3i", creds)
    if uid != os.getuid():
        raise errors.PermissionDenied(
            "the process listening on %s (pid %d) runs as uid %d, not as this user (uid %d): not trusted "
            "with values; run `tidepool agent` as this user, on a socket in a directory only it can write"
            % (path, pid, uid, os.getuid()))


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


def _list(items, what):
    """items as a list; a bare str, bytes or buffer is refused rather than
    taken apart item by item."""
    if isinstance(items, (str, bytes, bytearray, memoryview)):
        raise errors.InvalidArgument("%s: want a list, not a bare %s" % (what, type(items).__name__))
    try:
        return list(items)
    except TypeError:
        raise errors.InvalidArgument("%s: want a list, not %s" % (what, type(items).__name__)) from None


def _keys(keys):
    keys = _list(keys, "keys")
    if set(map(type, keys)) - {str}:
        for i, k in enumerate(keys):
            if not isinstance(k, str):
                raise errors.InvalidArgument("key %d is %s, not a str" % (i, type(k).__name__))
    return keys


class Attachment:
    """Memory of this process that the agent maps too: a memfd (created with
    MFD_ALLOW_SEALING) of size bytes. Spans of it are read and written by
    the agent directly (Client.attach)."""

    def __init__(self, fd, size):
        self.fd = fd
        self.size = size
        self.closed = False  # set by its owner before it closes fd

    @property
    def path(self):
        """Where the agent opens it: this process's fd (in a forked child,
        the child's own copy of it)."""
        return "/proc/%d/fd/%d" % (os.getpid(), self.fd)

    def __repr__(self):
        return "Attachment(%s, %d bytes)" % (self.path, self.size)


#: Where one value of a get goes: att (an Attachment) and off, where the
#: agent writes it; or else parts, [(address, length, move)], that it is
#: scattered to from the session's region by move(dst, src, n) (memmove,
#: which releases the GIL; or a CUDA copy), or a writable view; length is
#: its capacity.
_Dest = collections.namedtuple("_Dest", "att off length parts view")

#: Where one value of a put comes from, as for _Dest (parts are gathered).
_Src = collections.namedtuple("_Src", "att off length parts view")


def _address(mv):
    """The address of a flat memoryview's first byte, or None where ctypes
    cannot see it (a read-only view of something other than bytes)."""
    if mv.nbytes == 0:
        return None
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    except TypeError:
        obj = mv.obj
        if isinstance(obj, bytes) and mv.nbytes == len(obj):
            return ctypes.cast(ctypes.c_char_p(obj), ctypes.c_void_p).value
        return None


def _parts(mv):
    addr = _address(mv)
    return None if addr is None else [(addr, mv.nbytes, ctypes.memmove)]


def _dest(mv, cap=None):
    n = mv.nbytes if cap is None else min(mv.nbytes, cap)
    return _Dest(None, 0, n, _parts(mv), mv)


def _src(mv):
    return _Src(None, 0, mv.nbytes, _parts(mv), mv)


def _copy_out(d, region, off, n):
    """Scatters n bytes at off of region to d."""
    if d.parts is None:
        d.view[:n] = region.view[off:off + n]
        return
    src = region.base + off
    for addr, length, move in d.parts:
        k = min(length, n)
        if k <= 0:
            break
        move(addr, src, k)
        src += k
        n -= k


def _copy_in(sc, region, off):
    """Gathers sc into the region at off."""
    if sc.parts is None:
        region.view[off:off + sc.length] = sc.view
        return
    dst = region.base + off
    for addr, length, move in sc.parts:
        if length:
            move(dst, addr, length)
            dst += length


def _region_item(item, kind, i):
    """A _Dest or _Src from (Attachment, offset, length), or from [(address,
    length, move), ...] parts of this process's memory (move(dst, src, n)
    copies; ctypes.memmove for host memory)."""
    if isinstance(item, tuple) and len(item) == 3 and isinstance(item[0], Attachment):
        att, off, n = item
        if off < 0 or n < 0 or off + n > att.size:
            raise errors.InvalidArgument("item %d: [%d, %d) is outside the %d attached bytes" % (i, off, off + n, att.size))
        return kind(att, off, n, None, None)
    parts = list(item)
    total = 0
    for addr, n, _ in parts:
        if not addr or n < 0:
            raise errors.InvalidArgument("item %d: address %r, %d bytes" % (i, addr, n))
        total += n
    return kind(None, 0, total, parts, None)


def _chunks(n):
    limit = MAX_BATCH_KEYS
    for i in range(0, n, limit):
        yield i, min(i + limit, n)


def _key_error(k):
    """The agent's verdict on a key it would refuse, or None."""
    if not k:
        return errors.InvalidArgument("empty key")
    if len(k) * 4 <= MAX_KEY_LEN:  # no encoding is longer: skip encoding it
        return None
    n = len(k.encode("utf-8", "surrogatepass"))
    if n > MAX_KEY_LEN:
        return errors.InvalidArgument("key of %d bytes exceeds the %d-byte limit" % (n, MAX_KEY_LEN))
    return None


def _item(st):
    """None for success, else the item's Error."""
    if st.code == 0:
        return None
    return errors.from_code(st.code, st.message)


class _Bearer(grpc.UnaryUnaryClientInterceptor):
    """Adds the agent's token to every call (an agent of a secure pool
    refuses calls without it)."""

    def __init__(self, token):
        self._md = (("authorization", "Bearer " + token),)

    def intercept_unary_unary(self, continuation, details, request):
        md = tuple(details.metadata or ()) + self._md
        return continuation(_CallDetails(details.method, details.timeout, md, details.credentials,
                                         details.wait_for_ready, details.compression), request)


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


def _read_token(token_file):
    """The token in token_file's first line, or None without a file."""
    if not token_file:
        return None
    try:
        with open(token_file) as f:
            token = f.readline().strip()
    except OSError as e:
        raise errors.InvalidArgument("token_file %s: %s" % (token_file, e))
    if not token:
        raise errors.InvalidArgument("token_file %s is empty" % token_file)
    return token


class _Resources:
    """What a Client gives back when it ends: its channel to the agent and
    the regions it has mapped. Client.close() shuts them down or, for a
    Client dropped without close(), a weakref.finalize does; never in a
    forked child, whose parent still uses them."""

    def __init__(self, target, token=None):
        self.pid = os.getpid()
        self.channel = grpc.insecure_channel(target, options=[
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            # The agent is local: after it restarts, reconnect within a
            # second rather than gRPC's default backoff of up to 2 minutes.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ])
        calls = self.channel
        if token:
            calls = grpc.intercept_channel(self.channel, _Bearer(token))
        self.stub = agent_pb2_grpc.AgentStub(calls)
        # Every region mapped and not yet unmapped: the current one, and
        # retired ones until the agent has ended their sessions. Guarded
        # by the Client's lock while the Client lives.
        self.regions = set()
        self.masters = _Masters()

    def end_session(self, session, timeout=_CLOSE_TIMEOUT):
        """Asks the agent to end session, which it does once the session's
        requests in flight are done; True when it answered (NOT_FOUND
        included: it no longer knows the session)."""
        try:
            self.stub.Close(agent_pb2.SessionRef(session=session), timeout=timeout)
            return True
        except grpc.RpcError as e:
            return e.code() == grpc.StatusCode.NOT_FOUND

    def shutdown(self):
        """Ends every session, unmaps every region and closes the channel.
        Once only (a weakref.finalize calls it); a no-op in a forked
        child."""
        if os.getpid() != self.pid:
            return
        for region in list(self.regions):
            try:
                if not region.ended:
                    region.ended = self.end_session(region.session, timeout=2.0)
            except Exception:  # noqa: BLE001 - best effort: ending the rest matters more
                pass
            if region.users:
                # A call still copies into or out of it (a daemon thread, at
                # interpreter exit): the mapping goes with the process.
                continue
            region.unmap()
        self.regions.clear()
        self.masters.close()
        self.channel.close()


class _Masters:
    """A direct line to the master leader for what moves no bytes (Exists):
    one hop instead of two through the agent. It is used only once a probe
    (an Exists in the background) has found the master answering, so an
    unreachable master never delays a call. A probe that finds a follower
    goes on to the leader it names; one that finds no master goes on to
    the next address, waiting a while once all were tried. Anything that
    goes wrong on a call falls back to the agent, and the line is probed
    again."""

    # How long the direct path stays off once every master failed a probe.
    _BACKOFF = 30.0
    # A direct call that takes longer than this falls back to the agent.
    _TIMEOUT = 2.0

    def __init__(self):
        # Reentrant: a probe that is over at once runs its callback in the
        # thread that made it, under the lock.
        self._lock = threading.RLock()
        self._addrs = []  # guarded by _lock, as are the fields below
        self._addr = None  # the master asked, a leader as far as known
        self._channel = None
        self._stub = None
        self._ready = False  # a probe of this channel was answered
        self._probing = False
        self._next = None  # the address to probe next, and not before:
        self._not_before = 0.0
        self._failed = 0  # probes failed in a row

    @property
    def addrs(self):
        with self._lock:
            return list(self._addrs)

    def set(self, addrs):
        """The masters the agent announced."""
        addrs = [a for a in addrs if a]
        with self._lock:
            if addrs == self._addrs:
                return
            self._addrs, self._failed = addrs, 0
            old = self._switch(addrs[0] if addrs else None)
        if old is not None:
            old.close()

    def _switch(self, addr):
        """Dials addr and probes it. Called with the lock held; returns the
        old channel, for the caller to close once it has let go of the lock
        (closing cancels a probe, whose callback takes the lock)."""
        old = self._channel
        self._addr, self._channel, self._stub, self._ready, self._next = addr, None, None, False, None
        if addr:
            self._channel = grpc.insecure_channel(addr, options=[
                ("grpc.max_send_message_length", _MAX_MESSAGE),
                ("grpc.max_receive_message_length", _MAX_MESSAGE)])
            self._stub = tidepool_pb2_grpc.MasterStub(self._channel)
            self._probing = True
            stub = self._stub
            f = stub.Exists.future(tidepool_pb2.KeysRequest(keys=["tidepool-probe"]), timeout=self._TIMEOUT)
            f.add_done_callback(lambda f: self._probed(stub, f))
        return old

    def _probed(self, stub, f):
        """The probe's answer (on a gRPC thread, or at once in _switch)."""
        with self._lock:
            if stub is not self._stub:
                return  # switched meanwhile
            self._probing = False
            err = True if f.cancelled() else f.exception()
            if err is None:
                self._ready, self._failed = True, 0
                return
            self._failed_over(err)

    def _failed_over(self, err):
        """The current master did not answer: next, the leader it named, or
        the next address (after a backoff once all were tried). Called with
        the lock held."""
        self._ready = False
        leader = _leader_of(err)
        if leader and leader != self._addr:
            self._next, self._not_before = leader, 0.0
            return
        self._failed += 1
        addrs = self._addrs or [self._addr]
        i = addrs.index(self._addr) if self._addr in addrs else -1
        self._next = addrs[(i + 1) % len(addrs)]
        wait = self._BACKOFF if self._failed >= len(addrs) else 0.0
        if wait:
            self._failed = 0
        self._not_before = time.monotonic() + wait

    def exists(self, keys):
        """resp.exists for keys from the leader, or None: ask the agent."""
        old = None
        with self._lock:
            stub, addr = self._stub, self._addr
            if stub is None or not self._ready:
                if self._next and not self._probing and time.monotonic() >= self._not_before:
                    old = self._switch(self._next)
                stub = None
        if old is not None:
            old.close()
        if stub is None:
            return None
        try:
            return stub.Exists(tidepool_pb2.KeysRequest(keys=keys), timeout=self._TIMEOUT).exists
        except ValueError:
            return None  # another thread switched masters and closed this channel
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.INVALID_ARGUMENT:  # a bad key: the agent answers it absent
                with self._lock:
                    if self._addr == addr:
                        self._failed_over(e)
            return None

    def close(self):
        with self._lock:
            old = self._switch(None)
            self._addrs = []
        if old is not None:
            old.close()


def _leader_of(err):
    """The leader a follower's UNAVAILABLE names, if any."""
    if isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAVAILABLE:
        return dict(err.trailing_metadata() or ()).get(_LEADER_TRAILER)
    return None


def _keep_forever(res):
    """Keeps a forked child's inherited _Resources (the parent's channels)
    alive past interpreter shutdown: without gRPC's fork support, a
    channel's destructor in the child waits forever on gRPC threads only
    the parent has. An extra reference that is never dropped is the one
    way to keep its refcount, module teardown included, above zero."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(res))


# Clients of this process, for the fork handler.
_clients = weakref.WeakSet()


def _after_fork_in_child():
    for c in list(_clients):
        c._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Client:
    """A session with the local `tidepool agent`.

    ``socket`` is the agent's unix socket; ``shm_bytes`` the size of the
    shared-memory region the agent creates for this session, through which
    every value moves (a value, or a get's buffer, must fit in it; bigger
    batches are split). ``timeout`` bounds each request in seconds (None:
    no bound), and separately each wait for room in the region. ``wait``
    is how long the constructor waits for the agent to come up (0: fail at
    once with Unavailable). ``token_file`` (default $TIDEPOOL_TOKEN_FILE)
    holds the token an agent of a secure pool asks its callers for: the
    one it was started with (--token-file).

    The agent must run as this user: the client checks the uid of the
    process on the socket (SO_PEERCRED) before opening a session, and that
    the region it names is a memfd of this user and of the announced size
    before mapping it (PermissionDenied otherwise).

    Safe for concurrent use by threads. Use it as a context manager, or
    call close(); a Client dropped without close() ends its session when
    it is garbage-collected. A session the agent forgot (it ended idle, or
    the agent restarted) is reopened transparently by the next request that
    needs it. A get or put abandoned mid-request (its deadline passed, it
    was cancelled or interrupted, the connection broke) may still be
    running in the agent, writing or reading its span: the client then
    retires the whole session (it asks the agent to end it, which waits for
    such requests, and never reuses its region) and the next request opens
    a new one. In a forked child the client opens a session of its own
    (gRPC itself needs GRPC_ENABLE_FORK_SUPPORT=1 for a child to use it).

    Whole-request failures raise tidepool.Error subclasses; batch calls
    return one result per key, in order, where a failed item is the Error
    instance (not raised).
    """

    def __init__(self, socket=DEFAULT_SOCKET, shm_bytes=DEFAULT_SHM_BYTES, client_name=None,
                 timeout=60.0, wait=0.0, token_file=None):
        if shm_bytes <= 0:
            raise errors.InvalidArgument("shm_bytes %d: want a positive size" % shm_bytes)
        self._token = _read_token(token_file or os.environ.get("TIDEPOOL_TOKEN_FILE"))
        self.socket = socket
        self.client_name = client_name or "python-%d" % os.getpid()
        self._shm_bytes = shm_bytes
        self._timeout = timeout
        self._target = socket if socket.startswith("unix:") else "unix:" + os.path.abspath(socket)
        self._path = _socket_path(self._target)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # Guarded by _lock:
        self._closed = False  # close() called: calls raise ClientClosed
        self._shut = False  # close() done
        self._inflight = 0  # calls between _enter and _exit
        self._opening = False  # a call is opening a session
        self._region = None  # the current session; None: the next call that needs one opens it
        self._opened = 0  # sessions opened by this process
        self.reopened = 0  # sessions opened after the first (the agent forgot one, or one was retired)
        self._res = _Resources(self._target, self._token)
        self._finalizer = weakref.finalize(self, self._res.shutdown)
        try:
            region = self._open(self._res, wait)
        except BaseException:
            self._finalizer()
            raise
        self._res.regions.add(region)
        self._region = region
        self._opened = 1
        _clients.add(self)

    # Sessions.

    def _open(self, res, wait=0.0):
        """Opens a session and maps its region, once the agent proved to
        run as this user and the region to be its memfd. Called without
        the lock."""
        deadline = time.monotonic() + wait
        _check_peer(self._path, wait)
        req = agent_pb2.OpenRequest(client=self.client_name, shm_bytes=self._shm_bytes)
        while True:
            try:
                if wait > 0:
                    resp = res.stub.Open(req, timeout=max(deadline - time.monotonic(), 0.5), wait_for_ready=True)
                else:
                    resp = res.stub.Open(req, timeout=self._timeout)
                break
            except grpc.RpcError as e:
                # Within wait, UNAVAILABLE is tried again: gRPC fails a
                # call fast, "Broken pipe", now and then just after a
                # forked child of this process exited, wait_for_ready or
                # not, and the next call goes through.
                if wait > 0 and e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline - 0.05:
                    time.sleep(0.05)
                    continue
                raise errors.from_rpc(e, "open a session with the agent at %s" % self.socket) from None
        res.masters.set(list(resp.masters))
        try:
            return _Region(resp, self._shm_bytes)
        except BaseException:
            res.end_session(resp.session)
            raise

    def _forked(self):
        """In a forked child (from os.register_at_fork): forget the parent's
        sessions, regions and channel, which the parent goes on using; the
        child's next call opens a session of its own."""
        self._lock = threading.Lock()  # the parent's may have been held by another thread
        self._cond = threading.Condition(self._lock)
        if self._finalizer is not None:
            self._finalizer.detach()
        old = self._res
        if old is not None:
            _keep_forever(old)
            for region in old.regions:
                region.unmap(close_alloc=False)  # the child's copy of the mapping only
        self._res = None
        self._finalizer = None
        self._region = None
        self._inflight = 0
        self._opening = False
        self._opened = 0
        self.reopened = 0

    def _enter(self, need_region):
        """Starts a call: returns (resources, region), where region is the
        current session's (opened now if there is none) or None when
        need_region is false. Raises ClientClosed once closed. Every
        _enter that returns is paired with an _exit."""
        with self._cond:
            while True:
                if self._closed:
                    raise errors.ClientClosed("client closed")
                if self._res is None:  # a forked child's first call
                    self._res = _Resources(self._target, self._token)
                    self._finalizer = weakref.finalize(self, self._res.shutdown)
                if not need_region or self._region is not None or not self._opening:
                    break
                self._cond.wait()  # for the call opening a session
            self._inflight += 1
            res = self._res
            if not need_region:
                return res, None
            region = self._region
            if region is not None:
                region.users += 1
                return res, region
            self._opening = True
        # Open without the lock: calls that need no session go on meanwhile.
        try:
            region = self._open(res)
        except BaseException:
            with self._cond:
                self._opening = False
                self._inflight -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            self._opening = False
            self._cond.notify_all()
            res.regions.add(region)  # close() ends it, whatever happens next
            if self._opened:
                self.reopened += 1
            self._opened += 1
            if self._closed:
                self._inflight -= 1
                raise errors.ClientClosed("client closed")
            self._region = region
            region.users += 1
            stale = [r for r in res.regions if r.retired and not r.ended and not r.ending]
            for r in stale:
                r.ending = True
        # Sessions retired while the agent was unreachable: end them now.
        for r in stale:
            self._end(res, r)
        return res, region

    def _exit(self, res, region):
        """Ends a call that _enter started. The call that retired a session
        asks the agent to end it first."""
        try:
            if region is not None:
                with self._cond:
                    claim = region.retired and not region.ended and not region.ending
                    if claim:
                        region.ending = True
                if claim:
                    self._end(res, region)
        finally:
            with self._cond:
                self._inflight -= 1
                if region is not None:
                    region.users -= 1
                    self._reap(res, region)
                self._cond.notify_all()

    def _end(self, res, region):
        """Ends a retired region's session at the agent, then unmaps the
        region once no call uses it. Called without the lock."""
        ended = False
        try:
            ended = res.end_session(region.session)
        finally:
            with self._cond:
                region.ending = False
                region.ended = region.ended or ended
                self._reap(res, region)

    def _reap(self, res, region):
        """Unmaps a retired region once its session ended and no call uses
        it. Called with the lock held."""
        if region.retired and region.ended and region.users == 0 and region in res.regions:
            res.regions.discard(region)
            region.unmap()

    def _retire(self, region, forgotten=False):
        """Takes region out of use: no call starts on it again and calls
        waiting for room in it start over on the next session. forgotten:
        the agent no longer knows the session (nothing to end)."""
        with self._cond:
            region.retired = True
            if forgotten:
                region.ended = True
            if self._region is region:
                self._region = None
        region.alloc.close(SessionRetired)

    def _session_call(self, what, fn):
        """Runs fn(resources, region) on the current session. When the
        agent no longer knows the session (NOT_FOUND for the whole
        request), it is retired and fn runs once more on a new one; so it
        does when the session was retired while fn waited for room."""
        forgotten = False
        for _ in range(4):
            res, region = self._enter(True)
            try:
                return fn(res, region)
            except SessionRetired:
                continue
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND and not forgotten:
                    forgotten = True
                    self._retire(region, forgotten=True)
                    continue
                raise errors.from_rpc(e, what) from None
            finally:
                self._exit(res, region)
        raise errors.Unavailable("%s: the session was retired under every attempt" % what)

    def _transfer(self, res, region, total, method, build, finish):
        """Holds an extent of total bytes of region for one request:
        build(base) stages it and returns the request, finish(resp, base)
        reads the answer. The extent goes back to the allocator only once
        the agent answered (or was never asked). A request abandoned while
        the agent may still be working on it (a deadline, a cancellation, a
        lost connection, KeyboardInterrupt) keeps its extent and retires
        the session, so that the agent's late writes (a get) or reads (a
        put) never meet another call's bytes."""
        base = region.alloc.alloc(total, self._timeout)
        try:
            req = build(base)
        except BaseException:
            region.alloc.free(base, total)
            raise
        try:
            resp = getattr(res.stub, method)(req, timeout=self._timeout)
        except grpc.RpcError as e:
            if e.code() in _UNANSWERED:
                self._retire(region)
            else:
                region.alloc.free(base, total)
            raise
        except BaseException:
            self._retire(region)
            raise
        try:
            return finish(resp, base)
        finally:
            region.alloc.free(base, total)

    def _call(self, method, req, what, timeout=None):
        """A request that uses no session, bounded by timeout (default the
        Client's)."""
        res, _ = self._enter(False)
        try:
            return getattr(res.stub, method)(req, timeout=self._timeout if timeout is None else timeout)
        except grpc.RpcError as e:
            raise errors.from_rpc(e, what) from None
        finally:
            self._exit(res, None)

    def _size(self):
        """The region size that batches are split for."""
        with self._cond:
            if self._closed:
                raise errors.ClientClosed("client closed")
        return self._shm_bytes

    @property
    def shm_bytes(self):
        """The size of the session's shared-memory region."""
        with self._cond:
            if self._closed:
                raise errors.ClientClosed("client closed")
            return self._region.size if self._region is not None else self._shm_bytes

    @property
    def session(self):
        """The agent's id of the current session (opened now if the last
        one was retired)."""
        res, region = self._enter(True)
        try:
            return region.session
        finally:
            self._exit(res, region)

    def close(self):
        """Waits for the calls in flight (calls waiting for room in the
        region give up with ClientClosed), then ends the session and unmaps
        its region; later calls raise ClientClosed. Safe to call more than
        once."""
        with self._cond:
            if self._closed:
                while not self._shut:
                    self._cond.wait()
                return
            self._closed = True
            if self._res is not None:
                for region in self._res.regions:
                    region.alloc.close()
            self._cond.notify_all()
            while self._inflight:
                self._cond.wait()
            self._region = None
            finalizer = self._finalizer
        try:
            if finalizer is not None:
                finalizer()
        finally:
            with self._cond:
                self._shut = True
                self._cond.notify_all()
            _clients.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # Attached memory.

    def attach(self, fd, size):
        """Returns an Attachment of the memfd fd (size bytes, created with
        MFD_ALLOW_SEALING, mapped by the caller): the agent maps it too, on
        first use in each session, and seals it against resizing. The fd
        must stay open until detach(). See batch_get_regions and
        batch_set_regions."""
        if size <= 0:
            raise errors.InvalidArgument("attach %d bytes" % size)
        return Attachment(fd, size)

    def detach(self, att):
        """Ends every session's mapping of att; later uses of it fail."""
        att.closed = True
        with self._cond:
            res = self._res
            regions = list(res.regions) if res is not None else []
        for region in regions:
            rid = region.attached.pop(att, None)
            if rid is None or region.ended:
                continue
            try:
                res.stub.Detach(agent_pb2.DetachRequest(session=region.session, region=rid), timeout=_CLOSE_TIMEOUT)
            except grpc.RpcError:
                pass  # the session is gone, or will be: its mapping with it

    def batch_get_regions(self, keys, dests):
        """Reads each key's value into its dest: (Attachment, offset,
        capacity), where the agent writes it (no copy on this side); or a
        list of parts [(address, length, move)] of this process's memory,
        filled in order from the session's region by move(dst, src, n)
        (ctypes.memmove, which releases the GIL, for host memory). Returns
        per key the size read or the item's Error (NotFound where absent,
        OutOfRange where longer than its capacity)."""
        keys = _keys(keys)
        dests = [_region_item(d, _Dest, i) for i, d in enumerate(_list(dests, "dests"))]
        if len(keys) != len(dests):
            raise errors.InvalidArgument("%d keys and %d dests" % (len(keys), len(dests)))
        got = self._read(keys, dests, range(len(keys)))
        return [got[i] for i in range(len(keys))]

    def batch_set_regions(self, keys, srcs, chain=False, parent=None, replicas=0):
        """Stores each key's value from its src, (Attachment, offset,
        length) or parts [(address, length, move)] gathered in order, as
        batch_set does (chain and parent too), except that a staged value
        larger than the session's region is that item's ValueTooLarge;
        replicas overrides the agent's --replicas when positive."""
        keys = _keys(keys)
        srcs = [_region_item(sc, _Src, i) for i, sc in enumerate(_list(srcs, "srcs"))]
        if len(keys) != len(srcs):
            raise errors.InvalidArgument("%d keys and %d srcs" % (len(keys), len(srcs)))
        if parent and not chain:
            raise errors.InvalidArgument("a parent without chain=True")
        return self._write(keys, srcs, chain=chain, parent=parent, replicas=replicas, per_item=True)

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
            resp = self._call("Lookup", tidepool_pb2.LookupRequest(keys=keys[lo:hi]), "lookup")
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
            resp = self._call("BatchExists", tidepool_pb2.KeysRequest(keys=keys[lo:hi]), "batch exists")
            count += resp.count
            if resp.count < hi - lo:
                break
        return count

    def exists(self, key):
        """Whether key is present."""
        return self.batch_exists([key]) == 1

    def present(self, keys, timeout=None):
        """Per key, whether it is present (a key the pool would refuse is
        not)."""
        keys = _keys(keys)
        out = []
        for lo, hi in _chunks(len(keys)):
            part = keys if hi - lo == len(keys) else keys[lo:hi]
            got = self._direct_exists(part)
            if got is None:
                got = self._call("Exists", tidepool_pb2.KeysRequest(keys=part), "exists", timeout).exists
            if len(got) != hi - lo:
                raise errors.Internal("exists: %d answers for %d keys" % (len(got), hi - lo))
            out.extend(got)
        return out

    def _direct_exists(self, keys):
        """The master's answer, asked directly, or None. (The master refuses
        a whole request holding a key it would refuse; the agent answers
        such a key absent.)"""
        res, _ = self._enter(False)
        try:
            return res.masters.exists(keys)
        finally:
            self._exit(res, None)

    def describe(self, keys):
        """Per key, its BlockInfo (size, CRC-32C, replicas fastest tier
        first) or the item's Error (NotFound where absent). The master
        leases what it describes."""
        keys = _keys(keys)
        out = []
        for lo, hi in _chunks(len(keys)):
            resp = self._call("Describe", tidepool_pb2.KeysRequest(keys=keys[lo:hi]), "describe")
            if len(resp.results) != hi - lo:
                raise errors.Internal("describe: %d answers for %d keys" % (len(resp.results), hi - lo))
            for k, r in zip(keys[lo:hi], resp.results):
                err = _item(r.status)
                if err is not None:
                    out.append(err)
                    continue
                reps = tuple(Replica(x.node, _TIERS.get(x.tier, ""), x.segment, x.endpoint, x.offset)
                             for x in r.replicas)
                out.append(BlockInfo(k, r.size, r.checksum, reps))
        return out

    # Gets.

    def _groups(self, idx, lengths, size, staged=None):
        """Splits the items idx into runs whose aligned staged lengths add up
        to at most half a region of size bytes (a longer value is a run of
        its own), at most MAX_BATCH_KEYS each: a batch never waits for the
        whole region, so two calls can always share it. staged(i) says
        whether item i goes through the region (default: all do)."""
        cap = max(size // 2, ALIGN)
        group, total = [], 0
        for i in idx:
            n = align(lengths[i]) if staged is None or staged(i) else 0
            if group and (total + n > cap or len(group) >= MAX_BATCH_KEYS):
                yield group
                group, total = [], 0
            group.append(i)
            total += n
        if group:
            yield group

    def _attached(self, res, region, att):
        """The region id of att in session region, attaching it now if this
        session has not yet."""
        rid = region.attached.get(att)
        if rid is None:
            if att.closed:
                raise errors.InvalidArgument("the attached memory was freed")
            resp = res.stub.Attach(agent_pb2.AttachRequest(session=region.session, path=att.path, size=att.size),
                                   timeout=self._timeout)
            rid = region.attached[att] = resp.region
        return rid

    def _read(self, keys, dests, idx):
        """Reads keys[i] for i in idx into dests[i] and returns {i: size or
        Error}. A dest is a _Dest: an attached region (the agent writes the
        value there) or an address or view the value is copied to from the
        session's region, with the GIL released."""
        size = self._size()
        out = {}
        # A staged span is at most the region (a longer value can't be read
        # through it anyway, and the agent says so: OutOfRange).
        dests = {i: dests[i] if dests[i].att is not None or dests[i].length <= size
                 else dests[i]._replace(length=size) for i in idx}
        staged = lambda i: dests[i].att is None  # noqa: E731
        lengths = {i: dests[i].length for i in idx}
        for group in self._groups(idx, lengths, size, staged):
            out.update(self._read_group(keys, group, dests))
        return out

    def _read_group(self, keys, group, dests):
        total = sum(align(dests[i].length) for i in group if dests[i].att is None)

        def attempt(res, region):
            spans = []

            def build(base):
                off = base
                for i in group:
                    d = dests[i]
                    if d.att is not None:
                        spans.append(agent_pb2.Span(offset=d.off, length=d.length,
                                                    region=self._attached(res, region, d.att)))
                    else:
                        spans.append(agent_pb2.Span(offset=off, length=d.length))
                        off += align(d.length)
                return agent_pb2.AgentGetRequest(session=region.session, keys=[keys[i] for i in group],
                                                 spans=spans)

            def finish(resp, base):
                if len(resp.results) != len(group) or len(resp.sizes) != len(group):
                    raise errors.Internal("batch get: %d results and %d sizes for %d keys"
                                          % (len(resp.results), len(resp.sizes), len(group)))
                out = {}
                for i, sp, st, n in zip(group, spans, resp.results, resp.sizes):
                    err = _item(st)
                    if err is None and n > sp.length:
                        err = errors.Internal("batch get: %d bytes read into a span of %d" % (n, sp.length))
                    if err is not None:
                        out[i] = err
                        continue
                    d = dests[i]
                    if d.att is None:
                        _copy_out(d, region, sp.offset, n)
                    out[i] = n
                return out

            return self._transfer(res, region, total, "BatchGet", build, finish)

        return self._session_call("batch get", attempt)

    def _write(self, keys, srcs, chain=False, parent=None, replicas=0, per_item=False):
        """Stores srcs[i] (each a _Src: an attached region's span, or an
        address or view copied into the session's region with the GIL
        released) under keys[i]; per key True or the item's Error (see
        batch_set for how a failing group is reported). A staged value
        larger than the region raises ValueTooLarge, storing nothing, or
        with per_item is that item's error alone."""
        size = self._size()
        out = [True] * len(keys)
        idx = []
        for i, sc in enumerate(srcs):
            if sc.att is None and sc.length > size:
                err = errors.ValueTooLarge(
                    "value %d (%r) is %d bytes, more than the session's shared-memory region of "
                    "%d bytes; open the Client with a larger shm_bytes" % (i, keys[i], sc.length, size))
                if not per_item:
                    raise err
                out[i] = err
            else:
                idx.append(i)
        prev = parent or ""
        staged = lambda i: srcs[i].att is None  # noqa: E731
        groups = list(self._groups(idx, [sc.length for sc in srcs], size, staged))
        for g, group in enumerate(groups):
            total = sum(align(srcs[i].length) for i in group if srcs[i].att is None)

            def attempt(res, region, group=group, total=total, prev=prev):
                def build(base):
                    spans, off = [], base
                    for i in group:
                        sc = srcs[i]
                        if sc.att is not None:
                            spans.append(agent_pb2.Span(offset=sc.off, length=sc.length,
                                                        region=self._attached(res, region, sc.att)))
                            continue
                        _copy_in(sc, region, off)
                        spans.append(agent_pb2.Span(offset=off, length=sc.length))
                        off += align(sc.length)
                    return agent_pb2.AgentPutRequest(
                        session=region.session, keys=[keys[i] for i in group], spans=spans,
                        chain=chain, parent=prev if chain else "", replicas=replicas)

                return self._transfer(res, region, total, "BatchPut", build, lambda resp, base: resp)

            try:
                resp = self._session_call("batch set", attempt)
                if len(resp.results) != len(group):
                    raise errors.Internal("batch set: %d results for %d keys" % (len(resp.results), len(group)))
            except errors.Error as e:
                if g == 0:
                    raise
                # The groups before were stored: say so, and fail the rest
                # item by item (a chain cannot go on past the gap).
                for rest in groups[g:]:
                    for i in rest:
                        out[i] = e
                return out
            for i, st in zip(group, resp.results):
                err = _item(st)
                if err is not None:
                    out[i] = err
            prev = keys[group[-1]]
        return out

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
        bufs = {}
        size = self._size()
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
                    bufs[i + k] = bytearray(b.size)
            # Key i+matched, if any, is absent (or not complete yet): None.
            i += m.matched + (1 if m.matched < j - i else 0)
        dests = {j: _dest(memoryview(b)) for j, b in bufs.items()}
        for j, r in self._read(keys, dests, sorted(bufs)).items():
            if isinstance(r, errors.Error):
                out[j] = None if isinstance(r, errors.NotFound) else r
            else:
                out[j] = bytes(bufs[j]) if r == len(bufs[j]) else bytes(memoryview(bufs[j])[:r])
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
        buffers = _list(buffers, "buffers")
        if len(keys) != len(buffers):
            raise errors.InvalidArgument("%d keys and %d buffers" % (len(keys), len(buffers)))
        size = self._size()
        # A span longer than the region can't be; a value that long can't
        # be read either, and the agent says so (OutOfRange).
        dests = [_dest(_target(b, i), size) for i, b in enumerate(buffers)]
        out = [0] * len(keys)
        for j, r in self._read(keys, dests, range(len(keys))).items():
            out[j] = 0 if isinstance(r, errors.NotFound) else r
        return out

    # Puts.

    def batch_set(self, keys, values, chain=False, parent=None, replicas=0):
        """Stores values (anything with the buffer protocol: bytes,
        bytearray, memoryview, numpy arrays; or CPU tensors with
        data_ptr()) under keys and returns, per
        key, True or the item's Error. A key that exists is left as it is
        and succeeds.

        With chain, the keys form a chain of blocks: keys[0] continues
        parent (None: a chain's first block) and keys[i] continues
        keys[i-1], so eviction takes a chain's leaves before their parents.

        Raises ValueTooLarge, storing nothing, when a value does not fit
        the session's region. A batch larger than half the region is sent
        in groups: when a group fails as a whole after others were stored,
        batch_set returns the results so far and that failure in the place
        of every item not yet stored (a failure of the first group is
        raised). replicas, when positive, overrides the agent's
        --replicas for these values.
        """
        keys = _keys(keys)
        values = _list(values, "values")
        if len(keys) != len(values):
            raise errors.InvalidArgument("%d keys and %d values" % (len(keys), len(values)))
        if parent is not None and not isinstance(parent, str):
            raise errors.InvalidArgument("parent is %s, not a str" % type(parent).__name__)
        if parent and not chain:
            raise errors.InvalidArgument("a parent without chain=True")
        srcs = [_src(_source(v, i)) for i, v in enumerate(values)]
        return self._write(keys, srcs, chain=chain, parent=parent, replicas=replicas)

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
            resp = self._call("Remove", tidepool_pb2.KeysRequest(keys=keys[lo:hi]), "remove")
            if len(resp.results) != hi - lo:
                raise errors.Internal("remove: %d results for %d keys" % (len(resp.results), hi - lo))
            for st in resp.results:
                err = _item(st)
                out.append(True if err is None else err)
        return out

    def clear(self, prefix, regex=None):
        """Removes every object whose key starts with prefix (which must not
        be empty) and, given a regex (RE2 syntax), matches it somewhere;
        returns how many."""
        if not isinstance(prefix, str) or not prefix:
            raise errors.InvalidArgument("clear needs a non-empty prefix")
        return self._clear(prefix, regex, False)

    def clear_all(self, regex=None):
        """Removes every object of the pool (of every client and tenant)
        or, given a regex (RE2 syntax), every one whose key it matches
        somewhere; returns how many."""
        return self._clear("", regex, True)

    def _clear(self, prefix, regex, everything):
        if regex is not None and not isinstance(regex, str):
            raise errors.InvalidArgument("regex is %s, not a str" % type(regex).__name__)
        req = agent_pb2.ClearRequest(prefix=prefix, regex=regex or "", all=everything)
        return self._call("Clear", req, "clear").removed

    def stats(self):
        """The agent's counters, as a dict (lookups, blocks_probed,
        blocks_matched, gets, get_bytes, puts, put_bytes, errors,
        sessions), plus this client's session and reopened count. Also
        keeps the session from ending idle."""

        def attempt(res, region):
            return res.stub.Stats(agent_pb2.SessionRef(session=region.session), timeout=self._timeout), region.session

        resp, session = self._session_call("stats", attempt)
        out = {f.name: getattr(resp, f.name) for f in resp.DESCRIPTOR.fields}
        out["session"] = session
        out["reopened"] = self.reopened
        return out

    @property
    def masters(self):
        """The master addresses the agent announced (it uses them)."""
        res = self._res
        return list(res.masters.addrs) if res is not None else []

    def ping(self, timeout=None):
        """Returns once the agent answers (raises Unavailable when it does
        not)."""
        self._call("Stats", agent_pb2.SessionRef(), "ping", timeout)

    def __repr__(self):
        return "Client(socket=%r, shm_bytes=%d)" % (self.socket, self._shm_bytes)
