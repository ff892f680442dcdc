"""MooncakeDistributedStore on a Tidepool agent."""

import ctypes
import enum
import functools
import logging
import os
import threading

from .. import errors
from ..client import MAX_KEY_LEN, Attachment, Client
from . import codes, launch, memory

logger = logging.getLogger("tidepool.mooncake")

# The session's region when setup's local_buffer_size is smaller: staging
# for values whose memory the agent cannot map (registered host and GPU
# memory), which Mooncake moves without its local buffer. Pages are
# committed as they are used.
_MIN_LOCAL_BUFFER = 64 << 20
_MAX_LOCAL_BUFFER = 4 << 30

# A request's bound: long enough for a master failover, short enough that
# an engine gives up on a pool that is gone and recomputes (-901).
_TIMEOUT = 20.0
# health_check's bound on each of its two probes.
_HEALTH_TIMEOUT = 2.0

_warned = set()
_warned_lock = threading.Lock()


def _note_once(what, msg, *args):
    """Logs an accepted-and-ignored Mooncake option once per process."""
    with _warned_lock:
        if what in _warned:
            return
        _warned.add(what)
    logger.info(msg, *args)


class ReplicateConfig:
    """Mooncake's per-put placement options. Tidepool honours replica_num
    (copies on distinct store nodes, best effort); the others are accepted
    and ignored (logged once): Tidepool's master places and pins by its own
    policy."""

    #: A class attribute, so that hasattr(ReplicateConfig, "group_ids")
    #: finds it as it finds Mooncake's.
    group_ids = None

    def __init__(self):
        self.replica_num = 1
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments = []
        self.prefer_alloc_in_same_node = False
        self.nof_replica_num = 0
        self.preferred_nof_segments = []
        self.group_ids = None

    def __str__(self):
        return ("ReplicateConfig: { replica_num: %d, with_soft_pin: %s, with_hard_pin: %s, "
                "preferred_segments: [%s], prefer_alloc_in_same_node: %s }"
                % (self.replica_num, str(bool(self.with_soft_pin)).lower(), str(bool(self.with_hard_pin)).lower(),
                   ", ".join(self.preferred_segments or ([self.preferred_segment] if self.preferred_segment else [])),
                   str(bool(self.prefer_alloc_in_same_node)).lower()))

    __repr__ = __str__


def _replicas(config):
    if config is None:
        return 0
    for name in ("with_soft_pin", "with_hard_pin", "preferred_segment", "preferred_segments",
                 "prefer_alloc_in_same_node", "group_ids"):
        if getattr(config, name, None):
            _note_once("rc." + name, "ReplicateConfig.%s is accepted and ignored: Tidepool's master "
                       "places and pins objects by its own policy", name)
    try:
        return max(int(getattr(config, "replica_num", 1) or 1), 1)
    except (TypeError, ValueError):
        return 1


class ReplicaStatus(enum.IntEnum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class Descriptor:
    """A memory replica's buffer: size, buffer_address (the offset in its
    store's segment: an address in no process of this host) and
    transport_endpoint (the store's engine address)."""

    def __init__(self, size=0, buffer_address=0, transport_endpoint=""):
        self.size = size
        self.buffer_address = buffer_address
        self.transport_endpoint = transport_endpoint

    def __repr__(self):
        return "<Descriptor size=%d buffer_address=%d transport_endpoint=%s>" % (
            self.size, self.buffer_address, self.transport_endpoint)


class MemoryDescriptor:
    def __init__(self, buffer_descriptor):
        self.buffer_descriptor = buffer_descriptor


class DiskDescriptor:
    """An SSD replica: file_path names its store's segment
    (tidepool://NODE/SEGMENT@OFFSET), object_size its size."""

    def __init__(self, file_path, object_size):
        self.file_path = file_path
        self.object_size = object_size


class ReplicaDescriptor:
    """One complete replica of an object, as Mooncake describes it; tier and
    node are Tidepool's own additions."""

    def __init__(self, size, replica):
        self.status = ReplicaStatus.COMPLETE
        self.tier = replica.tier
        self.node = replica.node
        self._size = size
        self._replica = replica

    def is_memory_replica(self):
        return self.tier in ("hbm", "dram")

    def is_disk_replica(self):
        return self.tier == "ssd"

    def get_memory_descriptor(self):
        if not self.is_memory_replica():
            raise RuntimeError("Expected MemoryDescriptor")
        r = self._replica
        return MemoryDescriptor(Descriptor(self._size, r.offset, r.endpoint))

    def get_disk_descriptor(self):
        if not self.is_disk_replica():
            raise RuntimeError("Expected DiskDescriptor")
        r = self._replica
        return DiskDescriptor("tidepool://%s/%s@%d" % (r.node, r.segment, r.offset), self._size)

    def __repr__(self):
        return "ReplicaDescriptor(%s on %s)" % (self.tier, self.node)


class BufferHandle(bytearray):
    """An object's bytes from get_buffer: the buffer protocol (a writable
    1-D byte buffer), len(), and Mooncake's ptr() and size() methods."""

    def ptr(self):
        return ctypes.addressof(ctypes.c_char.from_buffer(self)) if len(self) else 0

    def size(self):
        return len(self)


def _guard(bad, internal=None):
    """Wraps a store method so that a Python error inside is answered, never
    raised into the engine's thread: a value that does not convert
    (ValueError, OverflowError: a pointer or size that is no integer) as
    bad(args) (-600), anything else, a bug, as internal(args) (-1), logged
    with its traceback. A TypeError (the wrong arity or keywords) is
    Python's own contract, as pybind11's is, and raised."""
    internal = internal or bad

    def wrap(fn):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except TypeError:
                raise
            except (ValueError, OverflowError) as e:
                logger.error("MooncakeDistributedStore.%s: %s", fn.__name__, e)
                return bad(*args)
            except Exception as e:  # noqa: BLE001
                logger.error("MooncakeDistributedStore.%s failed", fn.__name__, exc_info=e)
                return internal(*args)
        return call
    return wrap


def _nones(keys=None, *_):
    return [None] * len(_seq(keys) or [])


def _key(k):
    """k as a str key, or None when Mooncake would refuse it (-600)."""
    if isinstance(k, bytes):
        try:
            k = k.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if not isinstance(k, str) or not k:
        return None
    if len(k) * 4 <= MAX_KEY_LEN:  # no encoding is longer: skip encoding it
        return k
    try:
        if len(k.encode("utf-8")) > MAX_KEY_LEN:
            return None
    except UnicodeEncodeError:
        return None
    return k


def _seq(v):
    """v as a list, or None for a bare str, bytes or non-sequence."""
    if isinstance(v, (str, bytes, bytearray, memoryview)):
        return None
    try:
        return list(v)
    except TypeError:
        return None


def _ints(v):
    out = _seq(v)
    if out is None:
        return None
    try:
        return [int(x) for x in out]
    except (TypeError, ValueError):
        return None


def _fill(out, idx, call, put=False):
    """Answers the items idx of out from call(), one result per item: a
    size, True for a put, or the item's error, as Mooncake's codes; a whole
    failure answers its code for every item."""
    if not idx:
        return out
    try:
        res = call()
    except errors.Error as e:
        for i in idx:
            out[i] = codes.of(e, put=put)
        return out
    for i, r in zip(idx, res):
        if isinstance(r, errors.Error):
            out[i] = codes.of(r, item=True, put=put)
        else:
            out[i] = codes.OK if put else r
    return out


def _bad(*_):
    return codes.INVALID_PARAMS


def _internal(*_):
    return codes.INTERNAL_ERROR


def _each(code):
    """A list answer of code, one per key."""
    def answer(keys=None, *_):
        keys = _seq(keys)
        return [code] * (len(keys) if keys else 1)
    return answer


_bad_list, _internal_list = _each(codes.INVALID_PARAMS), _each(codes.INTERNAL_ERROR)


class MooncakeDistributedStore:
    """Mooncake's ``MooncakeDistributedStore`` on a Tidepool agent: the
    names, arguments, defaults and return codes of Mooncake's Python
    bindings (see docs/engines.md), over :class:`tidepool.Client`.

    Every method answers Mooncake's codes (0, or a negative code; sizes,
    bytes, handles where Mooncake answers those) and raises nothing but
    TypeError for a call with the wrong arguments, as Mooncake's bindings
    do. Safe for concurrent use by threads; the GIL is released while bytes
    move (gRPC waits and memmove copies release it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._client = None  # guarded by _lock for setup and close
        self._agent = None
        self._hostname = ""
        self._pool = None  # setup_dummy's memory pool: (allocation, allocator)
        self._registry = memory.Registry()
        memory.HOST.users.add(self)

    # Lifecycle.

    def setup(self, local_hostname, metadata_server=None, global_segment_size=None, local_buffer_size=None,
              protocol=None, rdma_devices=None, master_server_addr=None, engine=None, enable_ssd_offload=False,
              ssd_offload_path="", tenant_id="default", enable_client_http_server=False, client_http_port=9300,
              *, device_name=None, master_server_address=None):
        """Connects to the pool: setup(local_hostname, metadata_server,
        global_segment_size, local_buffer_size, protocol, rdma_devices,
        master_server_addr, engine=None, ...), or setup(config) with a dict
        of those names; the config files' master_server_address and
        device_name are accepted for master_server_addr and rdma_devices,
        as keywords and as dict keys. master_server_addr names Tidepool masters. Returns 0, or
        -600 for bad arguments, -1 when no agent could be reached or
        started (or its segment not registered), -900 when no master
        leader answers the agent."""
        if isinstance(local_hostname, dict) and metadata_server is None:
            return self._setup_dict(local_hostname)
        # The config files' spellings, as keywords.
        rdma_devices = rdma_devices if rdma_devices is not None else device_name
        master_server_addr = master_server_addr if master_server_addr is not None else master_server_address
        positional = (metadata_server, global_segment_size, local_buffer_size, protocol, rdma_devices,
                      master_server_addr)
        if any(a is None for a in positional):
            missing = [n for n, a in zip(("metadata_server", "global_segment_size", "local_buffer_size",
                                          "protocol", "rdma_devices", "master_server_addr"), positional) if a is None]
            raise TypeError("setup() missing required arguments: %s" % ", ".join(missing))
        return self._setup(local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol,
                           rdma_devices, master_server_addr, engine=engine, enable_ssd_offload=enable_ssd_offload,
                           tenant_id=tenant_id, enable_client_http_server=enable_client_http_server)

    def _setup_dict(self, config):
        c = {str(k): str(v) for k, v in config.items()}
        if not c.get("local_hostname") or "metadata_server" not in c:
            logger.error("setup(config): local_hostname and metadata_server are required")
            return codes.INVALID_PARAMS
        return self._setup(c["local_hostname"], c["metadata_server"], c.get("global_segment_size", 16 << 20),
                           c.get("local_buffer_size", 16 << 20), c.get("protocol", "tcp"),
                           c.get("rdma_devices", c.get("device_name", "")),
                           c.get("master_server_addr", c.get("master_server_address", "127.0.0.1:50051")),
                           enable_ssd_offload=c.get("enable_ssd_offload", "false").lower() in ("1", "true", "yes", "on"),
                           tenant_id=c.get("tenant_id", "default"),
                           enable_client_http_server=c.get("enable_client_http_server", "false").lower() in ("1", "true"))

    def _setup(self, local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol,
               rdma_devices, master_server_addr, engine=None, enable_ssd_offload=False, tenant_id="default",
               enable_client_http_server=False):
        try:
            segment = launch.parse_size(global_segment_size)
            local = launch.parse_size(local_buffer_size)
            masters = launch.parse_masters(master_server_addr)
        except ValueError as e:
            logger.error("setup: %s", e)
            return codes.INVALID_PARAMS
        if not masters:
            logger.error("setup: master_server_addr is empty: name the Tidepool masters (host:port)")
            return codes.INVALID_PARAMS
        if not str(local_hostname or ""):
            logger.error("setup: local_hostname is empty")
            return codes.INVALID_PARAMS
        for what, v, default in (("metadata_server", metadata_server, None), ("protocol", protocol, None),
                                 ("rdma_devices", rdma_devices, ""), ("engine", engine, None),
                                 ("enable_ssd_offload", enable_ssd_offload, False),
                                 ("tenant_id", tenant_id, "default"),
                                 ("enable_client_http_server", enable_client_http_server, False)):
            if v not in (None, "", default):
                _note_once("setup." + what, "setup: %s=%r is accepted and ignored: Tidepool's agent moves the "
                           "bytes over shared memory or TCP and keeps no metadata server", what, v)
        shm = min(max(local, _MIN_LOCAL_BUFFER), _MAX_LOCAL_BUFFER)
        if segment > 0 and launch.loopback_only(str(local_hostname), masters):
            logger.warning("setup: local_hostname %r is a loopback address but the masters %s are not: the "
                           "segment this process contributes is reachable from this host only", local_hostname,
                           masters)
        with self._lock:
            self._close_locked()
            cfg = launch.file_config()
            sock = launch.agent_socket(cfg)
            agent = None
            try:
                if not launch.answers(sock):
                    agent = launch.Agent(launch.binary(cfg), masters, segment, str(local_hostname), shm)
                    sock = agent.socket
                elif segment > 0:
                    _note_once("setup.segment", "setup: global_segment_size=%d is not contributed by this process: "
                               "it uses the running agent at %s, whose own --segment applies", segment, sock)
                client = Client(sock, shm_bytes=shm, client_name="mooncake-%d" % os.getpid(),
                                timeout=launch.timeout(cfg, _TIMEOUT))
            except (RuntimeError, OSError, errors.Error) as e:
                logger.error("setup: %s", e)
                if agent is not None:
                    agent.stop()
                return codes.INTERNAL_ERROR
            rc = self._check(client, agent, masters, segment)
            if rc != codes.OK:
                client.close()
                if agent is not None:
                    agent.stop()
                return rc
            self._client, self._agent, self._hostname = client, agent, str(local_hostname)
        logger.info("mooncake store set up on tidepool agent %s (masters %s)", sock, masters)
        return codes.OK

    @staticmethod
    def _check(client, agent, masters, segment):
        """setup's last look: a master leader answers the agent (-900 if
        none does within the request timeout), the agent's masters are the
        ones setup names (a warning if not), and a segment the agent runs
        is registered (-1 if it is not in time)."""
        try:
            client.present(["tidepool-mooncake-setup-probe"])
        except errors.Error as e:
            logger.error("setup: no Tidepool master leader answers the agent (masters %s): %s", masters, e)
            return codes.RPC_FAIL
        theirs = set(client.masters)
        if theirs and theirs != set(masters.split(",")):
            logger.warning("setup: master_server_addr names %s, but the running agent uses %s: the agent's "
                           "masters apply", masters, ",".join(sorted(theirs)))
        if agent is not None and segment > 0 and not agent.wait_registered(launch.START_TIMEOUT):
            logger.error("setup: the agent's segment of %d bytes did not register with a master:\n%s",
                         segment, agent.output()[-2000:])
            return codes.INTERNAL_ERROR
        return codes.OK

    def setup_dummy(self, mem_pool_size, local_buffer_size, server_address):
        """Mooncake's standalone mode: use the running agent (server_address,
        when it is a socket path, else $TIDEPOOL_AGENT_SOCKET, the config
        file's tidepool_agent_socket or /tmp/tidepool-agent.sock) and give
        alloc_from_mem_pool a pool of mem_pool_size shared bytes."""
        try:
            pool_size = launch.parse_size(mem_pool_size)
            local = launch.parse_size(local_buffer_size)
        except ValueError as e:
            logger.error("setup_dummy: %s", e)
            return codes.INVALID_PARAMS
        addr = str(server_address or "")
        sock = addr if "/" in addr else launch.agent_socket(launch.file_config())
        shm = min(max(local, _MIN_LOCAL_BUFFER), _MAX_LOCAL_BUFFER)
        with self._lock:
            self._close_locked()
            try:
                client = Client(sock, shm_bytes=shm, client_name="mooncake-dummy-%d" % os.getpid(),
                                timeout=launch.timeout(launch.file_config(), _TIMEOUT))
            except errors.Error as e:
                logger.error("setup_dummy: no tidepool agent at %s: %s", sock, e)
                return codes.INTERNAL_ERROR
            if pool_size > 0:
                from .._alloc import SpanAllocator  # noqa: PLC0415 - only dummy mode pools
                a = memory.HOST.alloc(pool_size)
                self._pool = (a, SpanAllocator(a.size))
            self._client, self._hostname = client, addr
        return codes.OK

    def close(self):
        """Ends the session (and stops the agent setup started); 0. Safe to
        call more than once."""
        with self._lock:
            self._close_locked()
        return codes.OK

    def _close_locked(self):
        client, agent, pool = self._client, self._agent, self._pool
        self._client, self._agent, self._pool, self._hostname = None, None, None, ""
        if client is not None:
            try:
                client.close()
            except Exception as e:  # noqa: BLE001 - closing goes on
                logger.warning("close: %s", e)
        if agent is not None:
            agent.stop()
        if pool is not None:
            memory.HOST.free(pool[0].addr)
        self._registry.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit anything may be gone
            pass

    def _c(self):
        """The client, or None before setup and after close."""
        return self._client

    def _forget(self, att):
        """An allocation is being freed: no session keeps it mapped."""
        c = self._client
        if c is not None:
            c.detach(att)

    @_guard(lambda *a: codes.MASTER_UNREACHABLE)
    def health_check(self):
        """0 healthy, 1 not set up or closed, 2 the agent or the master
        does not answer."""
        c = self._c()
        if c is None:
            return codes.NOT_INITIALIZED
        try:
            c.ping(timeout=_HEALTH_TIMEOUT)
            c.present(["tidepool-mooncake-health-probe"], timeout=_HEALTH_TIMEOUT)
        except errors.Error:
            return codes.MASTER_UNREACHABLE
        return codes.HEALTHY

    def get_hostname(self):
        """The local_hostname given to setup (server_address for
        setup_dummy); "" before."""
        return self._hostname

    # Memory.

    @_guard(_bad, _internal)
    def register_buffer(self, buffer_ptr, size):
        """Registers [buffer_ptr, buffer_ptr+size) for the *_from and *_into
        calls: 0, or -600 when it overlaps a registered range or is neither
        mapped host memory of this process nor CUDA device memory."""
        if self._c() is None:
            return codes.INVALID_PARAMS
        addr, n = int(buffer_ptr), int(size)
        if addr <= 0 or n <= 0:
            return codes.INVALID_PARAMS
        if memory.HOST.find(addr, n) is not None or memory.mapped(addr, n, writable=True):
            kind = memory.HOST_KIND
        elif memory.mapped(addr, n, writable=False):
            kind = memory.READ_ONLY_KIND  # puts from it; a get into it is -600
        elif memory.cuda().is_device(addr):
            kind = memory.CUDA_KIND
        else:
            cu = memory.cuda()
            logger.error("register_buffer(%#x, %d): not mapped host memory of this process%s", addr, n,
                         "" if cu.lib is not None else ", and not GPU memory: " + cu.why)
            return codes.INVALID_PARAMS
        if not self._registry.add(addr, n, kind):
            logger.error("register_buffer(%#x, %d): overlaps a registered buffer", addr, n)
            return codes.INVALID_PARAMS
        return codes.OK

    @_guard(_bad, _internal)
    def unregister_buffer(self, buffer_ptr, size=None):
        """0, or -600 for an address register_buffer did not take."""
        if self._c() is None:
            return codes.INVALID_PARAMS
        return codes.OK if self._registry.remove(int(buffer_ptr)) else codes.INVALID_PARAMS

    def alloc_from_mem_pool(self, size):
        """An address of size bytes from setup_dummy's pool (shared with the
        agent: no copy on this side), or 0."""
        with self._lock:  # not while close frees the pool
            pool = self._pool
            try:
                if pool is None or int(size) <= 0:
                    return 0
                return pool[0].addr + pool[1].alloc(int(size), timeout=0)
            except (errors.Error, TypeError, ValueError):
                return 0

    def _where(self, addr, n, write=False):
        """How to move n bytes at addr (into it, when write): (Attachment,
        offset, n) for shared memory, or [(addr, n, move)] for other
        registered memory; None when the range is not registered (or is
        read-only and would be written)."""
        if n < 0 or addr <= 0:
            return None
        a = memory.HOST.find(addr, n)
        if a is not None:
            return (a.att, addr - a.addr, n)
        kind = self._registry.kind(addr, n)
        if kind == memory.HOST_KIND or kind == memory.READ_ONLY_KIND and not write:
            return [(addr, n, ctypes.memmove)]
        if kind == memory.CUDA_KIND:
            return [(addr, n, memory.cuda().copy)]
        return None

    def _where_parts(self, ptrs, sizes, write):
        """One object's buffers: a single span when they are one contiguous
        range, else their parts in order."""
        if all(ptrs[i] + sizes[i] == ptrs[i + 1] for i in range(len(ptrs) - 1)):
            whole = self._where(ptrs[0], sum(sizes), write)
            if whole is not None:
                return whole
            # else contiguous across two registrations: part by part
        parts = []
        for p, n in zip(ptrs, sizes):
            w = self._where(p, n, write)
            if w is None:
                return None
            if isinstance(w, tuple):  # shared memory: the agent could not scatter it, so copy
                w = [(p, n, ctypes.memmove)]
            parts.extend(w)
        return parts

    # Existence and sizes.

    @_guard(_bad, _internal)
    def is_exist(self, key, /):
        """1 present, 0 absent, or a negative code."""
        c, k = self._c(), _key(key)
        if c is None:
            return codes.INVALID_PARAMS
        if k is None:
            return 0
        try:
            return 1 if c.present([k])[0] else 0
        except errors.Error as e:
            return codes.of(e)

    @_guard(_bad_list, _internal_list)
    def batch_is_exist(self, keys):
        """Per key 1, 0 or a negative code; [] for no keys."""
        c, ks = self._c(), _seq(keys)
        if ks is None:
            return [codes.INVALID_PARAMS]
        if c is None:
            return [codes.INVALID_PARAMS] * len(ks)
        if not ks:
            return []
        try:
            # The engines' case, without a Python call per key: the client
            # takes str keys and answers a key the pool refuses as absent.
            return list(map(int, c.present(ks)))
        except errors.InvalidArgument:
            pass  # not all str: bytes keys, or keys Mooncake would refuse
        except errors.Error as e:
            return [codes.of(e)] * len(ks)
        norm = [_key(k) for k in ks]
        query = [k for k in norm if k is not None]
        try:
            got = iter(c.present(query) if query else [])
        except errors.Error as e:
            return [codes.of(e)] * len(ks)
        return [0 if k is None else (1 if next(got) else 0) for k in norm]

    @_guard(_bad, _internal)
    def get_size(self, key, /):
        """The object's size, or a negative code (-704 absent)."""
        c, k = self._c(), _key(key)
        if c is None or k is None:
            return codes.INVALID_PARAMS
        try:
            r = c.describe([k])[0]
        except errors.Error as e:
            return codes.of(e)
        return codes.of(r, item=True) if isinstance(r, errors.Error) else r.size

    @_guard(lambda *a: [])
    def get_replica_desc(self, key):
        """The object's replicas as ReplicaDescriptors; [] when absent."""
        got = self.batch_get_replica_desc([key])
        return got.get(_key(key), [])

    @_guard(lambda *a: {})
    def batch_get_replica_desc(self, keys):
        """{key: [ReplicaDescriptor, ...]} for the keys present."""
        c, ks = self._c(), _seq(keys)
        if c is None or not ks:
            return {}
        norm = [k for k in (_key(k) for k in ks) if k is not None]
        if not norm:
            return {}
        try:
            got = c.describe(norm)
        except errors.Error:
            return {}
        return {b.key: [ReplicaDescriptor(b.size, r) for r in b.replicas]
                for b in got if not isinstance(b, errors.Error)}

    # Byte puts and gets (staged through the session's region).

    def _put_values(self, keys, values, config):
        """Per key 0 or a code, for bytes-like values."""
        c = self._c()
        if c is None:
            return [codes.INVALID_PARAMS] * len(keys)
        out = [codes.INVALID_PARAMS] * len(keys)
        idx, ks, vs = [], [], []
        for i, (k, v) in enumerate(zip(keys, values)):
            k = _key(k)
            try:
                mv = memoryview(v).cast("B")
            except TypeError:
                continue
            if k is None or mv.nbytes == 0:
                continue
            idx.append(i)
            ks.append(k)
            vs.append(mv)
        return _fill(out, idx, lambda: c.batch_set(ks, vs, replicas=_replicas(config)), put=True)

    @_guard(_bad, _internal)
    def put(self, key, value, config=None):
        """Stores value (bytes-like); 0 (also when the key exists: it is left
        as it is) or a negative code."""
        return self._put_values([key], [value], config)[0]

    @_guard(_bad, _internal)
    def put_parts(self, key, *parts, config=None):
        """Stores the concatenation of parts (1-D bytes-like each) as one
        value; 0 with nothing stored when they are empty."""
        views = []
        for p in parts:
            try:
                mv = memoryview(p)
            except TypeError:
                return codes.INVALID_PARAMS
            if mv.ndim != 1 or mv.itemsize != 1:
                return codes.INVALID_PARAMS
            views.append(mv.cast("B") if mv.format != "B" else mv)
        total = sum(v.nbytes for v in views)
        if total == 0:
            return codes.OK
        value = bytearray(total)
        off = 0
        base = ctypes.addressof(ctypes.c_char.from_buffer(value))
        for v in views:
            n = v.nbytes
            src = None
            try:
                src = ctypes.addressof(ctypes.c_char.from_buffer(v)) if n else None
            except TypeError:
                pass
            if src is not None:
                ctypes.memmove(base + off, src, n)  # releases the GIL
            elif n:
                value[off:off + n] = v
            off += n
        return self._put_values([key], [value], config)[0]

    @_guard(_bad, _internal)
    def put_batch(self, keys, values, config=None):
        """Stores values under keys: 0 when all were stored, else the first
        failing key's code."""
        ks, vs = _seq(keys), _seq(values)
        if ks is None or vs is None or len(ks) != len(vs):
            return codes.INVALID_PARAMS
        if not ks:
            return codes.OK
        for r in self._put_values(ks, vs, config):
            if r != codes.OK:
                return r
        return codes.OK

    def _get_bytes(self, keys):
        """Per key its value as bytes, or None."""
        c = self._c()
        if c is None:
            return [None] * len(keys)
        norm = [_key(k) for k in keys]
        query = [k for k in norm if k is not None]
        try:
            got = iter(c.batch_get(query)) if query else iter(())
        except errors.Error as e:
            logger.debug("get: %s", e)
            return [None] * len(keys)
        out = []
        for k in norm:
            v = None if k is None else next(got)
            out.append(None if isinstance(v, errors.Error) else v)
        return out

    @_guard(lambda *a: b"")
    def get(self, key, /):
        """The value as bytes; b"" when absent or on any failure."""
        v = self._get_bytes([key])[0]
        return b"" if v is None else v

    @_guard(lambda *a: [b""])
    def get_batch(self, keys, /):
        """Per key the value as bytes, b"" when absent or failed. As
        Mooncake's, it answers [b""] for no keys or before setup."""
        ks = _seq(keys)
        if not ks or self._c() is None:
            return [b""]
        return [b"" if v is None else v for v in self._get_bytes(ks)]

    @_guard(lambda *a: None)
    def get_buffer(self, key, /):
        """A BufferHandle of the value, or None."""
        return self.batch_get_buffer([key])[0]

    @_guard(_nones)
    def batch_get_buffer(self, keys, /):
        """Per key a BufferHandle of the value, or None."""
        ks = _seq(keys)
        if ks is None:
            return []
        return [None if v is None else BufferHandle(v) for v in self._get_bytes(ks)]

    # Zero-copy: registered memory.

    def _read_into(self, keys, wheres):
        """Per key the bytes read into its where, or a negative code."""
        c = self._c()
        out = [codes.INVALID_PARAMS] * len(keys)
        if c is None:
            return out
        idx, ks, ds = [], [], []
        for i, (k, w) in enumerate(zip(keys, wheres)):
            k = _key(k)
            if k is None or w is None:
                continue
            idx.append(i)
            ks.append(k)
            ds.append(w)
        return _fill(out, idx, lambda: c.batch_get_regions(ks, ds))

    def _write_from(self, keys, wheres, config):
        c = self._c()
        out = [codes.INVALID_PARAMS] * len(keys)
        if c is None:
            return out
        idx, ks, ss = [], [], []
        for i, (k, w) in enumerate(zip(keys, wheres)):
            k = _key(k)
            if w == "empty":  # Mooncake stores nothing for a zero-byte put_from and answers 0
                out[i] = codes.OK
                continue
            if k is None or w is None:
                continue
            idx.append(i)
            ks.append(k)
            ss.append(w)
        return _fill(out, idx, lambda: c.batch_set_regions(ks, ss, replicas=_replicas(config)), put=True)

    @_guard(_bad, _internal)
    def get_into(self, key, buffer_ptr, size):
        """Reads the value into registered memory at buffer_ptr of size
        bytes (its capacity): the value's length, or a negative code (-600:
        the buffer is too small or not registered; -704 absent)."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    @_guard(_bad_list, _internal_list)
    def batch_get_into(self, keys, buffer_ptrs, sizes):
        """Per key the bytes read into its registered buffer, or a negative
        code; all -600 when the lists differ in length."""
        ks, ps, ns = _seq(keys), _ints(buffer_ptrs), _ints(sizes)
        if ks is None:
            return [codes.INVALID_PARAMS]
        if ps is None or ns is None or not len(ks) == len(ps) == len(ns):
            return [codes.INVALID_PARAMS] * len(ks)
        return self._read_into(ks, [self._where(p, n, write=True) for p, n in zip(ps, ns)])

    @_guard(_bad_list, _internal_list)
    def batch_get_into_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, prefer_alloc_in_same_node=False):
        """Per key its value scattered over its buffers in order: the
        value's length, or a negative code (-600 when it is longer than the
        buffers together)."""
        ks, wheres = self._multi(keys, all_buffer_ptrs, all_sizes, write=True)
        return wheres if ks is None else self._read_into(ks, wheres)

    def _multi(self, keys, all_buffer_ptrs, all_sizes, write):
        """The keys and where each one's buffers are, for the multi-buffer
        calls; or (None, the answer) for arguments Mooncake refuses (every
        key -600)."""
        ks, pss, nss = _seq(keys), _seq(all_buffer_ptrs), _seq(all_sizes)
        if ks is None:
            return None, [codes.INVALID_PARAMS]
        refused = None, [codes.INVALID_PARAMS] * len(ks)
        if pss is None or nss is None or not len(ks) == len(pss) == len(nss):
            return refused
        wheres = []
        for ps, ns in zip(pss, nss):
            ps, ns = _ints(ps), _ints(ns)
            if ps is None or ns is None or len(ps) != len(ns) or not ps:
                return refused
            wheres.append("empty" if not write and sum(ns) == 0 else self._where_parts(ps, ns, write))
        return ks, wheres

    @_guard(_bad, _internal)
    def put_from(self, key, buffer_ptr, size, config=None):
        """Stores size bytes of registered memory at buffer_ptr: 0 (and
        nothing stored for size 0) or a negative code."""
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    @_guard(_bad_list, _internal_list)
    def batch_put_from(self, keys, buffer_ptrs, sizes, config=None):
        """Per key 0 or a negative code (-200: no room, nothing evictable);
        all -600 when the lists differ in length."""
        ks, ps, ns = _seq(keys), _ints(buffer_ptrs), _ints(sizes)
        if ks is None:
            return [codes.INVALID_PARAMS]
        if ps is None or ns is None or not len(ks) == len(ps) == len(ns):
            return [codes.INVALID_PARAMS] * len(ks)
        wheres = ["empty" if n == 0 else self._where(p, n) for p, n in zip(ps, ns)]
        return self._write_from(ks, wheres, config)

    @_guard(_bad_list, _internal_list)
    def batch_put_from_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, config=None):
        """Per key the concatenation of its buffers stored as one value: 0
        or a negative code; all -600 when any list's length differs."""
        ks, wheres = self._multi(keys, all_buffer_ptrs, all_sizes, write=False)
        return wheres if ks is None else self._write_from(ks, wheres, config)

    # Removal.

    def _remove(self, keys):
        c = self._c()
        if c is None:
            return [codes.INVALID_PARAMS] * len(keys)
        norm = [_key(k) for k in keys]
        query = [k for k in norm if k is not None]
        try:
            got = iter(c.remove(query)) if query else iter(())
        except errors.Error as e:
            return [codes.of(e)] * len(keys)
        out = []
        for k in norm:
            if k is None:
                out.append(codes.INVALID_PARAMS)
                continue
            r = next(got)
            out.append(codes.OK if r is True else codes.of(r, item=True))
        return out

    @_guard(_bad, _internal)
    def remove(self, key, force=False):
        """0, or -704 when absent. A key under a read lease is removed too
        (force or not): readers holding the lease finish first."""
        return self._remove([key])[0]

    @_guard(_bad_list, _internal_list)
    def batch_remove(self, keys, force=False):
        """Per key 0 or a negative code."""
        ks = _seq(keys)
        if ks is None:
            return [codes.INVALID_PARAMS]
        return self._remove(ks) if ks else []

    def _clear(self, regex):
        c = self._c()
        if c is None:
            return codes.INVALID_PARAMS
        try:
            return c.clear_all(regex=regex)
        except errors.Error as e:
            return codes.of(e)

    @_guard(_bad, _internal)
    def remove_by_regex(self, regex_pattern, force=False):
        """Removes every object whose key the pattern (RE2 syntax) matches
        somewhere: how many, or a negative code (-600: a bad pattern)."""
        if not isinstance(regex_pattern, str) or not regex_pattern:
            return codes.INVALID_PARAMS
        return self._clear(regex_pattern)

    @_guard(_bad, _internal)
    def remove_all(self, force=False):
        """Removes every object of the pool: how many, or a negative code."""
        return self._clear(None)
