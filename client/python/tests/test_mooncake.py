"""tidepool.mooncake (Mooncake's MooncakeDistributedStore on Tidepool) and
the compat/mooncake shim, against a real `tidepool up` and `tidepool agent`:
the call sequences of SGLang's mooncake_store backend, LMCache's
mooncakestore connector and vLLM's MooncakeStoreConnector replayed as they
make them, and Mooncake's return codes row by row. Every byte a put or a
get moves is compared, and the bytes around it are checked untouched.

Run: TIDEPOOL_BIN=/tmp/tp python3 -m unittest client/python/tests/test_mooncake.py -v
"""

import asyncio
import concurrent.futures
import ctypes
import hashlib
import logging
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import unittest
import uuid

# Run from the repository root (python3 -m unittest client/python/tests/test_mooncake.py)
# as well as by discovery in this directory.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import tidepool  # noqa: E402
from tidepool import mooncake  # noqa: E402
from tidepool.mooncake import MooncakeDistributedStore, MooncakeHostMemAllocator, ReplicateConfig  # noqa: E402

try:
    import torch
except ImportError:  # Debian's python3-torch
    torch = None

# The layer logs every refused call (overlapping registrations, bad
# pointers, ...), which these tests make on purpose.
logging.getLogger("tidepool.mooncake").addHandler(logging.NullHandler())
logging.getLogger("tidepool.mooncake").propagate = False

KiB, MiB = 1 << 10, 1 << 20
COMPAT = os.path.join(harness.PYTHON_DIR, "compat")

# Mooncake's codes.
OK, NO_AVAILABLE_HANDLE, INVALID_PARAMS, OBJECT_NOT_FOUND = 0, -200, -600, -704


def rbytes(seed, n):
    """n pseudo-random bytes, different per seed."""
    return random.Random(repr(seed)).randbytes(n)


def fill(ptr, data):
    ctypes.memmove(ptr, data, len(data))


def read(ptr, n):
    return ctypes.string_at(ptr, n)


def page_hashes(tokens, page_size, prior=None):
    """SGLang's chained page hashes: sha256(prior digest + uint32-LE tokens)."""
    out = []
    for i in range(0, len(tokens) - len(tokens) % page_size, page_size):
        h = hashlib.sha256()
        if prior is not None:
            h.update(bytes.fromhex(prior))
        for t in tokens[i:i + page_size]:
            h.update(t.to_bytes(4, "little", signed=False))
        prior = h.hexdigest()
        out.append(prior)
    return out


class _Env:
    """Sets (value) or unsets (None) environment variables; restore() puts
    them back as they were."""

    def __init__(self, changes):
        self.saved = {k: os.environ.get(k) for k in changes}
        for k, v in changes.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def restore(self):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@unittest.skipUnless(harness.have_go(), "needs go (or $TIDEPOOL_BIN) to build tidepool")
class _Cluster(unittest.TestCase):
    """One `tidepool up` and one agent per class; setup finds the agent
    through TIDEPOOL_AGENT_SOCKET. Keys are per test."""

    UP_EXTRA = ()
    AGENT = True

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="tidepool-mooncake-test-")
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)
        cls.up = harness.Up(cls.dir, extra=list(cls.UP_EXTRA))
        cls.addClassCleanup(cls.up.stop)
        env = {"MOONCAKE_CONFIG_PATH": None, "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": None}
        if cls.AGENT:
            cls.agent = harness.Agent(cls.dir, cls.up.grpc)
            cls.addClassCleanup(cls.agent.stop)
            env["TIDEPOOL_AGENT_SOCKET"] = cls.agent.socket
        else:  # setup starts a private agent from the binary
            env["TIDEPOOL_AGENT_SOCKET"] = os.path.join(cls.dir, "no-agent-here.sock")
            env["TIDEPOOL_BIN"] = harness.binary()
        cls.env = _Env(env)
        cls.addClassCleanup(cls.env.restore)

    def setUp(self):
        self.prefix = "mc/%s/%s/" % (self.id().rsplit(".", 1)[-1], uuid.uuid4().hex[:8])

    def keys(self, n, tag=""):
        return ["%s%sk%d" % (self.prefix, tag, i) for i in range(n)]

    def new_store(self, *args, local_buffer_size=16 * MiB, **kw):
        """A store set up as LMCache and vLLM do (7 positional arguments)."""
        s = MooncakeDistributedStore()
        self.addCleanup(s.close)
        if not args:
            args = ("localhost", "P2PHANDSHAKE", 0, local_buffer_size, "tcp", "", self.up.grpc)
        self.assertEqual(s.setup(*args, **kw), OK)
        return s

    def host_alloc(self, size):
        """size bytes from MooncakeHostMemAllocator, freed after the test."""
        a = MooncakeHostMemAllocator()
        ptr = a.alloc(size)
        self.assertNotEqual(ptr, 0)
        self.addCleanup(a.free, ptr)
        return ptr

    def plain(self, size):
        """size bytes of ordinary host memory (not the allocator's): its
        address and the ctypes array keeping it alive."""
        buf = (ctypes.c_char * size)()
        self.addCleanup(lambda b=buf: None)  # alive until the test's stores are closed
        return ctypes.addressof(buf), buf


# ---------------------------------------------------------------------------
# 1. SGLang's mooncake_store backend (sglang.md §1 and §5).


def sglang_host_tensor(alloc, dims, dtype):
    """MooncakeHostTensorAllocator.allocate, as SGLang writes it."""
    size = 1
    for d in dims:
        size *= d
    size *= torch.tensor([], dtype=dtype).element_size()
    ptr = alloc.alloc(size)
    t = torch.frombuffer((ctypes.c_byte * size).from_address(ptr), dtype=torch.uint8, count=size)
    return ptr, size, t.view(dtype).view(dims)


def mha_page_first_meta(kv, indices, page_size):
    """MHATokenToKVPoolHost.get_page_buffer_meta for page_first:
    [k, v] per page, each one contiguous page of K (V)."""
    _, size, layers, heads, dim = kv.shape
    isz = kv.element_size()
    base = kv.data_ptr()
    v_offset = layers * size * heads * dim * isz
    ptrs, sizes = [], []
    for idx in indices[::page_size]:
        k = base + idx * layers * heads * dim * isz
        ptrs += [k, k + v_offset]
        sizes += [layers * isz * page_size * heads * dim] * 2
    return ptrs, sizes


def mla_layer_first_meta(kv, indices, page_size):
    """MLATokenToKVPoolHost.get_page_buffer_meta for layer_first, packed
    per page as MooncakeStore._pack_multi_buffer_meta does."""
    layers, size, _, dim = kv.shape
    isz = kv.element_size()
    base = kv.data_ptr()
    ptrs, sizes = [], []
    for idx in indices[::page_size]:
        ptrs.append([base + idx * dim * isz + layer * size * dim * isz for layer in range(layers)])
        sizes.append([isz * page_size * dim] * layers)
    return ptrs, sizes


@unittest.skipUnless(torch is not None, "needs torch (python3-torch)")
class SGLangTest(_Cluster):
    def sglang_store(self, **kw):
        """MooncakeStore.__init__'s setup: 8 positional arguments (the 8th
        the transfer engine, None), then warmup()."""
        s = MooncakeDistributedStore()
        self.addCleanup(s.close)
        rc = s.setup("localhost", "P2PHANDSHAKE", (4 << 30) // 1, 16 * MiB, "rdma", "", self.up.grpc, None, **kw)
        self.assertEqual(rc, OK)
        key = "sglang_mooncake_store_warmup_key" + uuid.uuid4().hex
        value = bytes(4 * 1024)
        self.assertEqual(s.put(key, value), OK)
        self.assertEqual(s.is_exist(key), 1)
        self.assertEqual(s.get(key), value)
        return s

    def test_setup_forms(self):
        s = self.sglang_store()
        self.assertEqual(s.get_hostname(), "localhost")
        self.assertEqual(s.health_check(), 0)
        # The metrics kwargs SGLang adds with enable_storage_metrics.
        s2 = self.sglang_store(enable_client_http_server=True, client_http_port=9300 + 7)
        self.assertEqual(s2.health_check(), 0)
        # SGLang drops a kwarg setup refuses by finding its name in the TypeError.
        with self.assertRaises(TypeError) as cm:
            MooncakeDistributedStore().setup("localhost", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "", self.up.grpc, None,
                                              no_such_option=True)
        self.assertIn("no_such_option", str(cm.exception))
        # Fewer than the 7 required arguments is a TypeError too, as pybind11's.
        with self.assertRaises(TypeError):
            MooncakeDistributedStore().setup("localhost", "P2PHANDSHAKE", 0)

    def test_mha_page_first(self):
        s = self.sglang_store()
        layers, heads, dim, page = 4, 2, 64, 4
        page_num = 16
        size = page_num * page
        alloc = MooncakeHostMemAllocator()
        ptr, nbytes, kv = sglang_host_tensor(alloc, (2, size, layers, heads, dim), torch.bfloat16)
        self.assertNotEqual(ptr, 0)
        self.addCleanup(alloc.free, ptr)
        self.assertEqual(kv.data_ptr(), ptr)
        # register_mem_pool_host: [k_buffer, v_buffer], one call each.
        for half in (kv[0], kv[1]):
            self.assertEqual(s.register_buffer(half.data_ptr(), half.numel() * half.element_size()), OK)
        fill(ptr, rbytes(1, nbytes))
        page_bytes = layers * page * heads * dim * 2

        tokens = list(range(1000, 1000 + 5 * page))
        hashes = page_hashes(tokens, page)
        stored, absent = hashes[:4], hashes[4]
        keys = [k for h in stored for k in ("%s_0_k" % h, "%s_0_v" % h)]
        src = list(range(0, 4 * page))  # host indices of pages 0-3
        ptrs, sizes = mha_page_first_meta(kv, src, page)
        self.assertEqual(sizes, [page_bytes] * 8)

        # An earlier backup stored page 0 (with group semantics: a 4th
        # positional ReplicateConfig carrying group_ids).
        self.assertEqual(s.batch_is_exist(keys), [0] * 8)
        grouped = ReplicateConfig()
        grouped.group_ids = ["sglang-hicache:%s" % stored[0]] * 2
        self.assertEqual(s.batch_put_from(keys[:2], ptrs[:2], sizes[:2], grouped), [OK, OK])
        # batch_set_v1: only the missing objects are written.
        exist = s.batch_is_exist(keys)
        self.assertEqual(exist, [1, 1] + [0] * 6)
        missing = [i for i, e in enumerate(exist) if e != 1]
        got = s.batch_put_from([keys[i] for i in missing], [ptrs[i] for i in missing], [sizes[i] for i in missing])
        self.assertEqual(got, [OK] * 6)
        self.assertEqual(s.batch_is_exist(keys), [1] * 8)
        for k in keys:
            self.assertEqual(s.get_size(k), page_bytes)

        # batch_get_v1 into other host indices (pages 8-11), plus a page
        # never stored, whose two objects fail (<= 0) alone.
        before = read(ptr, nbytes)
        dst = list(range(8 * page, 13 * page))
        dptrs, dsizes = mha_page_first_meta(kv, dst, page)
        gkeys = keys + ["%s_0_k" % absent, "%s_0_v" % absent]
        res = s.batch_get_into(gkeys, dptrs, dsizes)
        self.assertEqual(res[:8], [page_bytes] * 8)
        self.assertTrue(all(r > 0 for r in res[:8]))
        self.assertEqual(res[8:], [OBJECT_NOT_FOUND] * 2)
        # Every byte: K and V of pages 8-11 are those of pages 0-3, the rest as it was.
        want = bytearray(before)
        for sp, dp, n in zip(ptrs, dptrs, sizes):
            want[dp - ptr:dp - ptr + n] = before[sp - ptr:sp - ptr + n]
        self.assertEqual(read(ptr, nbytes), bytes(want))
        self.assertTrue(torch.equal(kv[:, 0:4 * page].view(torch.int16), kv[:, 8 * page:12 * page].view(torch.int16)))

    def test_mla_layer_first_multi_buffers(self):
        s = self.sglang_store()
        layers, page, dim = 3, 4, 576
        size = 16 * page
        page_bytes = layers * page * dim * 2
        for where in ("allocator", "torch"):
            with self.subTest(memory=where):
                if where == "allocator":
                    alloc = MooncakeHostMemAllocator()
                    ptr, nbytes, kv = sglang_host_tensor(alloc, (layers, size, 1, dim), torch.bfloat16)
                    self.addCleanup(alloc.free, ptr)
                else:  # the default HostTensorAllocator: memory the agent cannot map
                    kv = torch.empty((layers, size, 1, dim), dtype=torch.bfloat16)
                    ptr, nbytes = kv.data_ptr(), kv.numel() * kv.element_size()
                # MLA: one register_buffer of the whole kv_buffer.
                self.assertEqual(s.register_buffer(ptr, nbytes), OK)
                fill(ptr, rbytes(where, nbytes))
                hashes = page_hashes(list(range(7, 7 + 3 * page)), page, prior=hashlib.sha256(where.encode()).hexdigest())
                keys = ["%s__k" % h for h in hashes]  # mla_suffix "" without PP
                ptrs, sizes = mla_layer_first_meta(kv, list(range(0, 3 * page)), page)
                self.assertEqual(s.batch_is_exist(keys), [0, 0, 0])
                self.assertEqual(s.batch_put_from_multi_buffers(keys, ptrs, sizes, ReplicateConfig()), [OK] * 3)
                self.assertEqual(s.batch_is_exist(keys), [1, 1, 1])
                before = read(ptr, nbytes)
                # One object is its layers' slices in order.
                self.assertEqual(s.get_size(keys[1]), page_bytes)
                self.assertEqual(s.get(keys[1]), b"".join(read(p, n) for p, n in zip(ptrs[1], sizes[1])))
                dptrs, dsizes = mla_layer_first_meta(kv, list(range(10 * page, 13 * page)), page)
                self.assertEqual(s.batch_get_into_multi_buffers(keys, dptrs, dsizes), [page_bytes] * 3)
                want = bytearray(before)
                for sps, dps, ns in zip(ptrs, dptrs, sizes):
                    for sp, dp, n in zip(sps, dps, ns):
                        want[dp - ptr:dp - ptr + n] = before[sp - ptr:sp - ptr + n]
                self.assertEqual(read(ptr, nbytes), bytes(want))
                self.assertEqual(s.unregister_buffer(ptr), OK)

    def test_remove_all(self):
        s = self.sglang_store()
        keys = self.keys(5)
        for i, k in enumerate(keys):
            self.assertEqual(s.put(k, rbytes(i, 1000 + i)), OK)
        self.assertEqual(s.batch_is_exist(keys), [1] * 5)
        n = s.remove_all()  # MooncakeStore.clear(): no arguments
        self.assertIsInstance(n, int)
        self.assertGreaterEqual(n, 5)  # the warm-up key too
        self.assertEqual(s.batch_is_exist(keys), [0] * 5)
        self.assertEqual(s.remove_all(), 0)


class PrivateAgentTest(_Cluster):
    """No agent answers at TIDEPOOL_AGENT_SOCKET: setup starts one for the
    process (with global_segment_size as its --segment) and close stops it."""

    AGENT = False

    def test_setup_starts_and_close_stops_an_agent(self):
        s = MooncakeDistributedStore()
        self.addCleanup(s.close)
        rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 32 * MiB, 16 * MiB, "tcp", "", self.up.grpc, None,
                     enable_client_http_server=True, client_http_port=harness.free_addr().rsplit(":", 1)[1])
        self.assertEqual(rc, OK)
        sock, proc = s._agent.socket, s._agent.proc
        self.assertTrue(os.path.exists(sock))
        self.assertNotEqual(sock, os.environ["TIDEPOOL_AGENT_SOCKET"])
        key = "sglang_mooncake_store_warmup_key" + uuid.uuid4().hex
        self.assertEqual(s.put(key, bytes(4096)), OK)
        self.assertEqual(s.is_exist(key), 1)
        self.assertEqual(s.get(key), bytes(4096))
        ptr = self.host_alloc(64 * KiB)
        fill(ptr, rbytes(3, 64 * KiB))
        self.assertEqual(s.register_buffer(ptr, 64 * KiB), OK)
        self.assertEqual(s.put_from(self.prefix + "a", ptr, 30000), OK)
        self.assertEqual(s.get_into(self.prefix + "a", ptr + 32 * KiB, 32 * KiB), 30000)
        self.assertEqual(read(ptr + 32 * KiB, 30000), read(ptr, 30000))
        self.assertEqual(s.close(), OK)
        harness.poll(lambda: proc.poll() is not None and not os.path.exists(sock), what="the private agent gone")
        self.assertEqual(s.put(key, b"x"), INVALID_PARAMS)
        self.assertEqual(s.close(), OK)


# ---------------------------------------------------------------------------
# 2. LMCache's mooncakestore connector (vllm_lmcache.md §2).


@unittest.skipUnless(torch is not None, "needs torch (python3-torch)")
class LMCacheTest(_Cluster):
    CHUNK = 64 * KiB
    META_LEN = 28

    def test_connector_sequence(self):
        s = MooncakeDistributedStore()
        # setup(7 positional); LMCache ignores the answer, but it is 0.
        self.assertEqual(s.setup("localhost", "P2PHANDSHAKE", 3355443200, 1073741824, "tcp", "", self.up.grpc), OK)
        rc = ReplicateConfig()
        rc.replica_num = 1
        # The pinned CPU buffer of the local CPU backend (plain host memory here).
        buf = torch.empty(2 * MiB, dtype=torch.uint8)
        base = buf.data_ptr()
        self.assertEqual(s.register_buffer(base, buf.numel()), OK)
        n = 8
        lens = [self.CHUNK] * (n - 1) + [self.CHUNK - 1000]  # the last chunk is shorter
        data = [rbytes(("lm", i), lens[i]) for i in range(n)]
        for i in range(n):
            fill(base + i * self.CHUNK, data[i])
        keys = ["model/name@1@0@%x@bfloat16" % (0xabc000 + i) + self.prefix for i in range(n)]

        async def puts():
            # put_from for chunks 0-3, batch_put_from for 4-5 and 6-7, all at once.
            calls = [asyncio.to_thread(s.put_from, keys[i], base + i * self.CHUNK, lens[i], rc) for i in range(4)]
            for lo in (4, 6):
                calls.append(asyncio.to_thread(s.batch_put_from, keys[lo:lo + 2],
                                               [base + i * self.CHUNK for i in (lo, lo + 1)], lens[lo:lo + 2], rc))
            return await asyncio.gather(*calls)

        self.assertEqual(asyncio.run(puts()), [OK] * 4 + [[OK, OK], [OK, OK]])
        for k in keys:
            self.assertIs(s.is_exist(k), 1)
        self.assertIs(s.is_exist(self.prefix + "absent"), 0)

        # batched_get: each destination sized to the full chunk; the answer
        # is the real length. Several threads at once.
        dst = base + MiB
        ctypes.memset(dst, 0x5A, MiB)

        def get(i):
            return s.batch_get_into([keys[i]], [dst + i * self.CHUNK], [self.CHUNK])[0]

        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            got = list(ex.map(get, range(n)))
        self.assertEqual(got, lens)
        for i in range(n):
            self.assertEqual(read(dst + i * self.CHUNK, lens[i]), data[i])
        self.assertEqual(read(dst + (n - 1) * self.CHUNK + lens[-1], 1000), b"\x5a" * 1000)  # past the short chunk
        # One batch, with a miss in it.
        self.assertEqual(s.batch_get_into(keys[-2:] + [self.prefix + "absent"],
                                          [dst, dst + self.CHUNK, dst + 2 * self.CHUNK], [self.CHUNK] * 3),
                         lens[-2:] + [OBJECT_NOT_FOUND])

        # save_chunk_meta: put_parts(key, metadata bytes, memoryview of a
        # ctypes array over the pinned buffer), then batch_get_buffer.
        pkeys = [k + "/meta" for k in keys[:4]]
        metas = [struct.pack("<7i", lens[i], 2, 16, 64, 0, 0, i) for i in range(4)]
        self.assertEqual(len(metas[0]), self.META_LEN)
        views = [memoryview((ctypes.c_ubyte * lens[i]).from_address(base + i * self.CHUNK)) for i in range(4)]

        async def parts():
            return await asyncio.gather(*[asyncio.to_thread(s.put_parts, pkeys[i], metas[i], views[i])
                                          for i in range(4)])

        self.assertEqual(asyncio.run(parts()), [OK] * 4)

        def get_buffers(i):
            return s.batch_get_buffer([pkeys[i], self.prefix + "absent/meta"])

        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            handles = list(ex.map(get_buffers, range(4)))
        for i, (h, miss) in enumerate(handles):
            self.assertIsNone(miss)
            self.assertIsNotNone(h)
            view = memoryview(h)
            self.assertEqual(bytes(view[:self.META_LEN]), metas[i])
            self.assertEqual(len(view), lens[i] + self.META_LEN)
            self.assertEqual(len(h), lens[i] + self.META_LEN)
            self.assertEqual(h.size(), len(h))
            self.assertNotEqual(h.ptr(), 0)
            t = torch.frombuffer(h, dtype=torch.uint8, offset=self.META_LEN, count=lens[i])
            self.assertEqual(bytes(t.numpy()), data[i])
            self.assertEqual(bytes(view[self.META_LEN:]), data[i])

        # close(): unregister_buffer(ptr) with one argument, then close.
        self.assertEqual(s.unregister_buffer(base), OK)
        self.assertEqual(s.put_from(self.prefix + "late", base, 100, rc), INVALID_PARAMS)  # no longer registered
        self.assertEqual(s.is_exist(self.prefix + "late"), 0)
        self.assertEqual(s.close(), OK)
        self.assertEqual(s.is_exist(keys[0]), INVALID_PARAMS)


# ---------------------------------------------------------------------------
# 3. vLLM's MooncakeStoreConnector (vllm_lmcache.md §1).


def storage_of(t):
    st = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    return st.data_ptr(), st.nbytes()


@unittest.skipUnless(torch is not None, "needs torch (python3-torch)")
class VLLMTest(_Cluster):
    LAYERS, BLOCKS, BLOCK, HEADS, DIM = 3, 16, 4, 2, 32

    def test_worker_sequence(self):
        s = MooncakeDistributedStore()
        self.assertEqual(s.setup("127.0.0.1", "http://metadata/endpoint", 0, 64 * MiB, "rdma", "mlx5_0",
                                 self.up.grpc), OK)
        self.assertEqual(s.get_hostname(), "127.0.0.1")
        rc = ReplicateConfig()
        caches = [torch.zeros((2, self.BLOCKS, self.BLOCK, self.HEADS, self.DIM), dtype=torch.float16)
                  for _ in range(self.LAYERS)]
        segments, block_len, regions = [], None, []
        for i, t in enumerate(caches):
            base, region_len = storage_of(t)
            self.assertEqual(s.register_buffer(base, region_len), OK)
            regions.append((base, region_len))
            fill(base, rbytes(("vllm", i), region_len))
            seg_stride = t.stride(0) * t.element_size()
            block_len = seg_stride // self.BLOCKS
            segments += [base, base + seg_stride]

        def meta(block_ids):
            addrs = [[seg + b * block_len for seg in segments] for b in block_ids]
            sizes = [[block_len] * len(segments) for _ in block_ids]
            return addrs, sizes

        n = 6
        hashes = [hashlib.sha256(("blk%d" % i + self.prefix).encode()).digest() for i in range(n)]
        keys = ["%sLlama-3-8B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@%s" % (self.prefix, h.hex()) for h in hashes]
        addrs, sizes = meta(range(n))
        obj_bytes = block_len * len(segments)

        # An earlier save stored the first two chunks (the 4-argument form).
        self.assertEqual(s.batch_put_from_multi_buffers(keys[:2], addrs[:2], sizes[:2], rc), [OK, OK])
        exists = s.batch_is_exist(keys)
        self.assertEqual(exists, [1, 1, 0, 0, 0, 0])
        missing = [i for i, e in enumerate(exists) if e != 1]
        res = s.batch_put_from_multi_buffers([keys[i] for i in missing], [addrs[i] for i in missing],
                                             [sizes[i] for i in missing], rc)
        self.assertEqual(res, [OK] * 4)
        # The lookup server may run in another process: another session sees them.
        other = self.new_store()
        self.assertEqual(other.batch_is_exist(keys), [1] * n)
        self.assertEqual([other.get_size(k) for k in keys], [obj_bytes] * n)

        # Loads into other blocks (8-13) from several receive threads, each
        # a rotated slice of the keys; no ReplicateConfig.
        before = [read(b, n_) for b, n_ in regions]
        daddrs, dsizes = meta(range(8, 8 + n))
        jobs = [[0, 1], [3, 2], [5, 4]]

        def load(job):
            return s.batch_get_into_multi_buffers([keys[i] for i in job], [daddrs[i] for i in job],
                                                  [dsizes[i] for i in job])

        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            got = list(ex.map(load, jobs))
        self.assertEqual(got, [[obj_bytes] * 2] * 3)
        for (base, region_len), old in zip(regions, before):
            want = bytearray(old)
            for sa, da, ns in zip(addrs, daddrs, sizes):
                for p, q, m in zip(sa, da, ns):
                    if base <= p < base + region_len:
                        want[q - base:q - base + m] = old[p - base:p - base + m]
            self.assertEqual(read(base, region_len), bytes(want))
        for t in caches:
            self.assertTrue(torch.equal(t[:, 0:n].view(torch.int16), t[:, 8:8 + n].view(torch.int16)))

        # reset_cache, then shutdown (close once per worker; twice is fine).
        removed = s.remove_all(force=True)
        self.assertGreaterEqual(removed, n)
        self.assertEqual(s.batch_is_exist(keys), [0] * n)
        self.assertEqual(s.close(), OK)
        self.assertEqual(s.close(), OK)
        self.assertEqual(s.batch_is_exist(keys), [INVALID_PARAMS] * n)


@unittest.skipUnless(torch is not None, "needs torch (python3-torch)")
class BackPressureTest(_Cluster):
    """A pool of 4 MiB of DRAM, no SSD, and a lease TTL longer than the
    test: the master evicts nothing for one lease TTL after it starts, so
    once the pool is full nothing is evictable and puts find no room."""

    UP_EXTRA = ("--dram", "4MiB", "--ssd", "0", "--lease-ttl", "10m")

    def test_no_room_answers_200(self):
        s = self.new_store()
        ptr = self.host_alloc(16 * MiB)
        fill(ptr, rbytes("bp", 16 * MiB))
        self.assertEqual(s.register_buffer(ptr, 16 * MiB), OK)
        staged = torch.empty(9 * MiB, dtype=torch.uint8)  # not the allocator's: through the session's region
        sp = staged.data_ptr()
        fill(sp, rbytes("bp-staged", 9 * MiB))
        self.assertEqual(s.register_buffer(sp, 9 * MiB), OK)
        big = self.keys(3, "big")
        # Larger than any segment (8 MiB > 4 MiB): no handle, from either kind of memory.
        self.assertEqual(s.put_from(big[0], ptr, 8 * MiB, ReplicateConfig()), NO_AVAILABLE_HANDLE)
        self.assertEqual(s.put_from(big[1], sp, 8 * MiB), NO_AVAILABLE_HANDLE)
        self.assertEqual(s.batch_put_from_multi_buffers(big[2:], [[ptr, sp]], [[4 * MiB, 4 * MiB]], ReplicateConfig()),
                         [NO_AVAILABLE_HANDLE])
        self.assertEqual(s.batch_is_exist(big), [0, 0, 0])

        # Fill it as vLLM's send thread does: 1 MiB objects of two 512 KiB parts.
        keys = self.keys(8)
        half = 512 * KiB
        addrs = [[ptr + i * MiB, ptr + i * MiB + half] for i in range(8)]
        sizes = [[half, half]] * 8
        res = s.batch_put_from_multi_buffers(keys, addrs, sizes, ReplicateConfig())
        self.assertLessEqual(set(res), {OK, NO_AVAILABLE_HANDLE}, res)
        self.assertIn(OK, res)
        self.assertIn(NO_AVAILABLE_HANDLE, res)  # vLLM's pressure skip
        stored = [k for k, r in zip(keys, res) if r == OK]
        refused = [k for k, r in zip(keys, res) if r != OK]
        self.assertEqual(s.batch_is_exist(refused), [0] * len(refused))
        # Nothing is evictable: every new put answers -200, whatever its path.
        more = self.keys(4, "more")
        self.assertEqual(s.put_from(more[0], ptr, 64 * KiB), NO_AVAILABLE_HANDLE)
        self.assertEqual(s.put_from(more[1], sp, 64 * KiB), NO_AVAILABLE_HANDLE)
        self.assertEqual(s.put(more[2], b"x" * 4096), NO_AVAILABLE_HANDLE)
        self.assertEqual(s.batch_put_from(more[3:], [ptr], [4096]), [NO_AVAILABLE_HANDLE])
        self.assertEqual(s.batch_is_exist(more), [0] * 4)
        # A put of a key that exists still answers 0, and changes nothing.
        self.assertEqual(s.put_from(stored[0], sp, MiB), OK)
        # What was stored reads back, every byte.
        i0 = keys.index(stored[0])
        dst = ptr + 10 * MiB
        got = s.batch_get_into_multi_buffers(stored, [[dst + j * MiB, dst + j * MiB + half] for j in range(len(stored))],
                                             [[half, half]] * len(stored))
        self.assertEqual(got, [MiB] * len(stored))
        for j, k in enumerate(stored):
            i = keys.index(k)
            self.assertEqual(read(dst + j * MiB, MiB), read(ptr + i * MiB, MiB))
        self.assertEqual(s.get(stored[0]), read(ptr + i0 * MiB, MiB))
        self.assertGreaterEqual(s.remove_all(force=True), len(stored))


# ---------------------------------------------------------------------------
# 4. Error codes, row by row.


class ErrorCodeTest(_Cluster):
    def test_empty_key(self):
        s = self.new_store()
        p, _buf = self.plain(4096)
        self.assertEqual(s.register_buffer(p, 4096), OK)
        good = self.keys(1)[0]
        self.assertEqual(s.put("", b"x"), INVALID_PARAMS)
        self.assertEqual(s.put_from("", p, 10), INVALID_PARAMS)
        self.assertEqual(s.put_parts("", b"ab", b"cd"), INVALID_PARAMS)
        self.assertEqual(s.put_batch(["", good], [b"1", b"2"]), INVALID_PARAMS)
        self.assertEqual(s.batch_put_from(["", good], [p, p], [10, 10]), [INVALID_PARAMS, OK])
        self.assertEqual(s.is_exist(""), 0)
        self.assertEqual(s.batch_is_exist(["", good]), [0, 1])
        self.assertEqual(s.get(""), b"")
        self.assertIsNone(s.get_buffer(""))
        self.assertLess(s.get_into("", p, 4096), 0)  # Mooncake: -704 (the master finds no ""); here -600
        self.assertLess(s.get_size(""), 0)
        self.assertLess(s.remove(""), 0)

    def test_key_over_4096_bytes(self):
        s = self.new_store()
        p, _buf = self.plain(4096)
        fill(p, rbytes(4, 4096))
        self.assertEqual(s.register_buffer(p, 4096), OK)
        longest = (self.prefix + "x" * 4096)[:4096]
        too_long = longest + "x"
        wide = "\u00e9" * 2049  # 2049 characters, 4098 bytes of UTF-8
        for k in (too_long, wide):
            with self.subTest(key_bytes=len(k.encode())):
                self.assertEqual(s.put(k, b"v"), INVALID_PARAMS)
                self.assertEqual(s.put_from(k, p, 100), INVALID_PARAMS)
                self.assertEqual(s.batch_put_from([k], [p], [100]), [INVALID_PARAMS])
                self.assertEqual(s.batch_put_from_multi_buffers([k], [[p]], [[100]]), [INVALID_PARAMS])
                self.assertEqual(s.is_exist(k), 0)
                self.assertEqual(s.get(k), b"")
        # 4096 bytes is a key.
        self.assertEqual(s.put_from(longest, p, 100), OK)
        self.assertEqual(s.is_exist(longest), 1)
        self.assertEqual(s.get(longest), read(p, 100))

    def test_get_into_buffer_too_small(self):
        s = self.new_store()
        key = self.keys(1)[0]
        val = rbytes(5, 1000)
        self.assertEqual(s.put(key, val), OK)
        plain, _buf = self.plain(8192)
        self.assertEqual(s.register_buffer(plain, 8192), OK)
        for what, p in (("plain", plain), ("allocator", self.host_alloc(8192))):
            with self.subTest(memory=what):
                ctypes.memset(p, 0xAA, 8192)
                self.assertEqual(s.get_into(key, p, 999), INVALID_PARAMS)
                self.assertEqual(read(p, 8192), b"\xaa" * 8192)  # nothing written
                self.assertEqual(s.get_into(key, p, 1000), 1000)
                self.assertEqual(read(p, 1000), val)
                ctypes.memset(p, 0xAA, 8192)
                self.assertEqual(s.get_into(key, p, 4096), 1000)  # size is the capacity
                self.assertEqual(read(p, 1000), val)
                self.assertEqual(read(p + 1000, 7192), b"\xaa" * 7192)
                self.assertEqual(s.batch_get_into([key, key], [p, p + 4096], [10, 4096]), [INVALID_PARAMS, 1000])
                self.assertEqual(read(p + 4096, 1000), val)
                # Multi buffers: too small together, then just enough, split.
                self.assertEqual(s.batch_get_into_multi_buffers([key], [[p, p + 2048]], [[500, 499]]), [INVALID_PARAMS])
                ctypes.memset(p, 0xAA, 8192)
                self.assertEqual(s.batch_get_into_multi_buffers([key], [[p, p + 2048]], [[500, 600]]), [1000])
                self.assertEqual(read(p, 500) + read(p + 2048, 500), val)
                self.assertEqual(read(p + 500, 1548), b"\xaa" * 1548)
                self.assertEqual(read(p + 2548, 8192 - 2548), b"\xaa" * (8192 - 2548))

    def test_pointer_never_registered(self):
        s = self.new_store()
        key = self.keys(2)
        self.assertEqual(s.put(key[0], b"v" * 100), OK)
        p, _buf = self.plain(4096)
        fill(p, b"\x11" * 4096)
        self.assertEqual(s.put_from(key[1], p, 100), INVALID_PARAMS)
        self.assertEqual(s.batch_put_from([key[1]], [p], [100]), [INVALID_PARAMS])
        self.assertEqual(s.batch_put_from_multi_buffers([key[1]], [[p]], [[100]]), [INVALID_PARAMS])
        self.assertEqual(s.is_exist(key[1]), 0)
        self.assertEqual(s.get_into(key[0], p, 4096), INVALID_PARAMS)
        self.assertEqual(s.batch_get_into([key[0]], [p], [4096]), [INVALID_PARAMS])
        self.assertEqual(s.batch_get_into_multi_buffers([key[0]], [[p]], [[4096]]), [INVALID_PARAMS])
        self.assertEqual(read(p, 4096), b"\x11" * 4096)
        # Null, and never mapped: registration refused, no crash.
        self.assertEqual(s.put_from(key[1], 0, 100), INVALID_PARAMS)
        self.assertEqual(s.get_into(key[0], 0, 100), INVALID_PARAMS)
        self.assertEqual(s.register_buffer(0, 4096), INVALID_PARAMS)
        self.assertEqual(s.register_buffer(4096, 4096), INVALID_PARAMS)
        self.assertEqual(s.register_buffer(p, 0), INVALID_PARAMS)
        self.assertEqual(s.unregister_buffer(p), INVALID_PARAMS)

    def test_overlapping_registration(self):
        s = self.new_store()
        p, _buf = self.plain(16384)
        self.assertEqual(s.register_buffer(p + 4096, 4096), OK)
        self.assertEqual(s.register_buffer(p + 4096, 4096), INVALID_PARAMS)  # the same range again
        self.assertEqual(s.register_buffer(p + 6144, 4096), INVALID_PARAMS)  # its tail
        self.assertEqual(s.register_buffer(p + 2048, 4096), INVALID_PARAMS)  # its head
        self.assertEqual(s.register_buffer(p, 16384), INVALID_PARAMS)  # around it
        self.assertEqual(s.register_buffer(p + 5000, 10), INVALID_PARAMS)  # inside it
        self.assertEqual(s.register_buffer(p, 4096), OK)  # adjacent below
        self.assertEqual(s.register_buffer(p + 8192, 4096), OK)  # adjacent above
        self.assertEqual(s.unregister_buffer(p + 4096), OK)
        self.assertEqual(s.register_buffer(p + 2048 + 4096, 2048), OK)  # in the hole left

    def test_put_from_beyond_registered_range(self):
        s = self.new_store()
        key = self.keys(3)
        p, _buf = self.plain(8192)
        fill(p, rbytes(6, 8192))
        self.assertEqual(s.register_buffer(p, 4096), OK)
        self.assertEqual(s.put_from(key[0], p, 4097), INVALID_PARAMS)
        self.assertEqual(s.put_from(key[0], p + 4000, 100), INVALID_PARAMS)
        self.assertEqual(s.put_from(key[0], p + 4096, 10), INVALID_PARAMS)
        self.assertEqual(s.batch_put_from_multi_buffers([key[0]], [[p, p + 4090]], [[10, 10]]), [INVALID_PARAMS])
        self.assertEqual(s.is_exist(key[0]), 0)
        self.assertEqual(s.put_from(key[0], p + 4000, 96), OK)  # up to the end exactly
        self.assertEqual(s.get(key[0]), read(p + 4000, 96))
        self.assertEqual(s.get_into(key[0], p + 4050, 96), INVALID_PARAMS)  # a get beyond it too
        # An allocation's end bounds it the same way.
        a = self.host_alloc(8192)
        self.assertEqual(s.register_buffer(a, 8192), OK)
        self.assertEqual(s.put_from(key[1], a + 8000, 193), INVALID_PARAMS)
        self.assertEqual(s.put_from(key[1], a + 8000, 192), OK)
        self.assertEqual(s.get(key[1]), read(a + 8000, 192))
        # Negative sizes.
        self.assertEqual(s.put_from(key[2], p, -1), INVALID_PARAMS)
        self.assertEqual(s.get_into(key[0], p, -1), INVALID_PARAMS)

    def test_length_mismatched_lists(self):
        s = self.new_store()
        keys = self.keys(3)
        p, _buf = self.plain(4096)
        fill(p, rbytes(7, 4096))
        self.assertEqual(s.register_buffer(p, 4096), OK)
        self.assertEqual(s.batch_put_from(keys, [p, p], [10, 10, 10]), [INVALID_PARAMS] * 3)
        self.assertEqual(s.batch_put_from(keys, [p] * 3, [10]), [INVALID_PARAMS] * 3)
        self.assertEqual(s.batch_put_from_multi_buffers(keys, [[p]] * 2, [[10]] * 3), [INVALID_PARAMS] * 3)
        # One key's inner lists differ: all -600.
        self.assertEqual(s.batch_put_from_multi_buffers(keys, [[p], [p, p + 10], [p]], [[10], [10], [10]]),
                         [INVALID_PARAMS] * 3)
        self.assertEqual(s.put_batch(keys, [b"1", b"2"]), INVALID_PARAMS)
        self.assertEqual(s.batch_is_exist(keys), [0] * 3)
        self.assertEqual(s.batch_put_from(keys, [p] * 3, [10, 20, 30]), [OK] * 3)
        self.assertEqual(s.batch_get_into(keys, [p], [4096] * 3), [INVALID_PARAMS] * 3)
        self.assertEqual(s.batch_get_into(keys, [p] * 3, [4096]), [INVALID_PARAMS] * 3)
        self.assertEqual(s.batch_get_into_multi_buffers(keys, [[p]] * 3, [[4096]] * 2), [INVALID_PARAMS] * 3)
        self.assertEqual(s.batch_get_into_multi_buffers(keys, [[p]] * 3, [[4096], [4096, 1], [4096]]),
                         [INVALID_PARAMS] * 3)
        self.assertEqual([s.get(k) for k in keys], [read(p, 10), read(p, 20), read(p, 30)])
        self.assertEqual(s.batch_put_from([], [], []), [])
        self.assertEqual(s.batch_get_into([], [], []), [])
        self.assertEqual(s.batch_is_exist([]), [])

    def _assert_unusable(self, s, p):
        """Every method of a store not set up (or closed) answers its
        failure value and raises nothing."""
        k = self.prefix + "k"
        self.assertEqual(s.health_check(), 1)
        self.assertEqual(s.register_buffer(p, 4096), INVALID_PARAMS)
        self.assertEqual(s.unregister_buffer(p), INVALID_PARAMS)
        self.assertEqual(s.put(k, b"v"), INVALID_PARAMS)
        self.assertEqual(s.put_parts(k, b"a", b"b"), INVALID_PARAMS)
        self.assertEqual(s.put_batch([k], [b"v"]), INVALID_PARAMS)
        self.assertEqual(s.put_from(k, p, 10), INVALID_PARAMS)
        self.assertEqual(s.batch_put_from([k, k + "2"], [p, p], [10, 10]), [INVALID_PARAMS] * 2)
        self.assertEqual(s.batch_put_from_multi_buffers([k], [[p]], [[10]]), [INVALID_PARAMS])
        self.assertEqual(s.is_exist(k), INVALID_PARAMS)
        self.assertEqual(s.batch_is_exist([k, k]), [INVALID_PARAMS] * 2)
        self.assertEqual(s.get_size(k), INVALID_PARAMS)
        self.assertEqual(s.get(k), b"")
        self.assertEqual(s.get_batch([k, k]), [b""])  # Mooncake's quirk: one b"" when not initialized
        self.assertIsNone(s.get_buffer(k))
        self.assertEqual(s.batch_get_buffer([k, k]), [None, None])
        self.assertEqual(s.get_into(k, p, 4096), INVALID_PARAMS)
        self.assertEqual(s.batch_get_into([k, k], [p, p], [10, 10]), [INVALID_PARAMS] * 2)
        self.assertEqual(s.batch_get_into_multi_buffers([k], [[p]], [[10]]), [INVALID_PARAMS])
        self.assertEqual(s.remove(k), INVALID_PARAMS)
        self.assertEqual(s.remove(k, force=True), INVALID_PARAMS)
        self.assertEqual(s.batch_remove([k, k]), [INVALID_PARAMS] * 2)
        self.assertEqual(s.remove_by_regex(".*"), INVALID_PARAMS)
        self.assertEqual(s.remove_all(), INVALID_PARAMS)
        self.assertEqual(s.remove_all(force=True), INVALID_PARAMS)
        self.assertEqual(s.get_replica_desc(k), [])
        self.assertEqual(s.batch_get_replica_desc([k]), {})
        self.assertEqual(s.alloc_from_mem_pool(4096), 0)
        self.assertEqual(s.close(), OK)

    def test_before_setup(self):
        p, _buf = self.plain(4096)
        s = MooncakeDistributedStore()
        self._assert_unusable(s, p)
        self.assertEqual(s.get_hostname(), "")

    def test_closed_store(self):
        p, _buf = self.plain(4096)
        s = self.new_store()
        key = self.keys(1)[0]
        self.assertEqual(s.register_buffer(p, 4096), OK)
        self.assertEqual(s.put(key, b"before close"), OK)
        self.assertEqual(s.close(), OK)
        self._assert_unusable(s, p)
        # The object outlives the store; a new store finds it.
        self.assertEqual(self.new_store().get(key), b"before close")

    def test_absent_keys(self):
        s = self.new_store()
        p, _buf = self.plain(4096)
        self.assertEqual(s.register_buffer(p, 4096), OK)
        k = self.prefix + "absent"
        self.assertEqual(s.get_size(k), OBJECT_NOT_FOUND)
        self.assertEqual(s.get_into(k, p, 4096), OBJECT_NOT_FOUND)
        self.assertEqual(s.batch_get_into([k], [p], [4096]), [OBJECT_NOT_FOUND])
        self.assertEqual(s.batch_get_into_multi_buffers([k], [[p]], [[4096]]), [OBJECT_NOT_FOUND])
        self.assertEqual(s.remove(k), OBJECT_NOT_FOUND)
        self.assertEqual(s.remove(k, force=True), OBJECT_NOT_FOUND)
        self.assertEqual(s.batch_remove([k]), [OBJECT_NOT_FOUND])
        self.assertEqual(s.get(k), b"")
        self.assertEqual(s.get_batch([k]), [b""])
        self.assertIsNone(s.get_buffer(k))
        self.assertEqual(s.batch_get_buffer([k]), [None])
        self.assertIs(s.is_exist(k), 0)
        self.assertEqual(s.get_replica_desc(k), [])
        self.assertEqual(s.batch_get_replica_desc([k]), {})
        self.assertEqual(s.remove_by_regex("^" + self.prefix), 0)

    def test_put_of_an_existing_key(self):
        s = self.new_store()
        key = self.keys(1)[0]
        first = rbytes(8, 3000)
        p, _buf = self.plain(8192)
        fill(p, rbytes(9, 8192))
        self.assertEqual(s.register_buffer(p, 8192), OK)
        self.assertEqual(s.put(key, first), OK)
        self.assertEqual(s.put(key, b"second"), OK)
        self.assertEqual(s.put_from(key, p, 5000), OK)
        self.assertEqual(s.batch_put_from([key], [p], [100]), [OK])
        self.assertEqual(s.batch_put_from_multi_buffers([key], [[p, p + 10]], [[10, 10]]), [OK])
        self.assertEqual(s.put_parts(key, b"a", b"b"), OK)
        self.assertEqual(s.put_batch([key], [b"third"]), OK)
        self.assertEqual(s.get(key), first)
        self.assertEqual(s.get_size(key), 3000)
        # Remove, and the key takes a new value.
        self.assertEqual(s.remove(key), OK)
        self.assertEqual(s.put(key, b"second"), OK)
        self.assertEqual(s.get(key), b"second")

    def test_is_exist_is_exactly_1_or_0(self):
        s = self.new_store()
        keys = self.keys(3)
        self.assertEqual(s.put(keys[0], b"1"), OK)
        self.assertIs(s.is_exist(keys[0]), 1)
        self.assertIs(s.is_exist(keys[1]), 0)
        got = s.batch_is_exist(keys)
        self.assertEqual(got, [1, 0, 0])
        self.assertEqual([type(x) for x in got], [int] * 3)  # not bools, not negative

    def test_concurrent_puts_of_one_key(self):
        s = self.new_store()
        key = self.keys(1)[0]
        vals = [bytes([i]) * 50000 for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            self.assertEqual(list(ex.map(lambda v: s.put(key, v), vals)), [OK] * 8)
        self.assertIn(s.get(key), vals)  # one of them, whole

    def test_bare_str_for_a_list_of_keys(self):
        s = self.new_store()
        p, _buf = self.plain(4096)
        fill(p, b"\x33" * 4096)
        self.assertEqual(s.register_buffer(p, 4096), OK)
        for k in "abc":
            s.remove(k)
            self.assertEqual(s.put(k, k.encode() * 10), OK)
        for k in "xyz":
            s.remove(k)
        # Never taken apart character by character (pybind11 would raise
        # TypeError; the layer answers -600).
        self.assertEqual(s.batch_remove("abc"), [INVALID_PARAMS])
        self.assertEqual(s.batch_is_exist("abc"), [INVALID_PARAMS])
        self.assertEqual(s.batch_get_into("abc", [p] * 3, [4096] * 3), [INVALID_PARAMS])
        self.assertEqual(s.batch_get_into_multi_buffers("abc", [[p]] * 3, [[4096]] * 3), [INVALID_PARAMS])
        self.assertEqual(s.batch_get_buffer("abc"), [])
        self.assertEqual(s.get_batch("abc"), [b""])
        self.assertEqual(s.batch_get_replica_desc("abc"), {})
        self.assertEqual(s.batch_put_from("xyz", [p] * 3, [10] * 3), [INVALID_PARAMS])
        self.assertEqual(s.batch_put_from_multi_buffers("xyz", [[p]] * 3, [[10]] * 3), [INVALID_PARAMS])
        self.assertEqual(s.put_batch("xyz", [b"1", b"2", b"3"]), INVALID_PARAMS)
        self.assertEqual(s.batch_is_exist(list("abcxyz")), [1, 1, 1, 0, 0, 0])
        self.assertEqual([s.get(k) for k in "abc"], [k.encode() * 10 for k in "abc"])
        self.assertEqual(read(p, 4096), b"\x33" * 4096)
        self.assertEqual(s.batch_remove(list("abc")), [OK] * 3)

    def test_native_client_remove_refuses_a_bare_str(self):
        with tidepool.Client(self.agent.socket, shm_bytes=MiB, client_name=self.id()) as c:
            for k in "abc":
                c.remove([k])
                c.set(k, k.encode())
            c.set("abc", b"abc")
            with self.assertRaises(tidepool.InvalidArgument):
                c.remove("abc")
            self.assertEqual(c.present(["a", "b", "c", "abc"]), [True] * 4)
            self.assertEqual(c.remove(["a", "b", "c", "abc"]), [True] * 4)

    def test_failures_leave_other_keys_untouched(self):
        s = self.new_store()
        p, _buf = self.plain(8192)
        fill(p, rbytes(10, 8192))
        self.assertEqual(s.register_buffer(p, 8192), OK)
        keys = self.keys(3)
        long_key = self.prefix + "L" * 5000
        res = s.batch_put_from(["", keys[0], long_key, keys[1], keys[2]], [p, p, p, p + 100, 0],
                               [10, 100, 10, 200, 10])
        self.assertEqual(res, [INVALID_PARAMS, OK, INVALID_PARAMS, OK, INVALID_PARAMS])  # the last: a null pointer
        self.assertEqual(s.batch_is_exist(["", keys[0], long_key, keys[1], keys[2]]), [0, 1, 0, 1, 0])
        res = s.batch_put_from_multi_buffers([long_key, keys[2]], [[p], [p, p + 50]], [[10], [50, 50]])
        self.assertEqual(res, [INVALID_PARAMS, OK])
        d = p + 4096
        got = s.batch_get_into([keys[0], "", keys[1], long_key, keys[2], self.prefix + "absent"],
                               [d, d, d + 100, d, d + 300, d], [100, 100, 10, 100, 100, 100])
        self.assertEqual(got, [100, INVALID_PARAMS, INVALID_PARAMS, INVALID_PARAMS, 100, OBJECT_NOT_FOUND])
        self.assertEqual(read(d, 100), read(p, 100))
        self.assertEqual(read(d + 300, 100), read(p, 100))
        self.assertEqual(s.get(keys[1]), read(p + 100, 200))
        self.assertEqual(s.batch_remove(["", keys[0], long_key]), [INVALID_PARAMS, OK, INVALID_PARAMS])
        self.assertEqual(s.batch_is_exist(keys), [0, 1, 1])

    def test_registered_host_value_larger_than_the_local_buffer(self):
        """Mooncake's put_from / get_into move registered memory zero-copy:
        local_buffer_size (16 MiB, SGLang's) bounds only put/get of bytes.
        Here plain registered host memory is staged through the session's
        region, sized from local_buffer_size."""
        s = self.new_store(local_buffer_size=16 * MiB)
        n = 20 * MiB
        buf = bytearray(n)
        p = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        fill(p, rbytes(11, n))
        self.assertEqual(s.register_buffer(p, n), OK)
        key = self.keys(1)[0]
        self.assertEqual(s.put_from(key, p, n), OK)  # Mooncake: 0 (the pool has room)
        self.assertEqual(s.get_size(key), n)

    def test_one_oversized_item_fails_alone(self):
        """In Mooncake each key of a batch succeeds or fails on its own; a
        put_from larger than the session's region fails every key of the
        batch here."""
        s = self.new_store(local_buffer_size=16 * MiB)
        n = 20 * MiB
        buf = bytearray(n)
        p = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        fill(p, rbytes(12, 4096))
        self.assertEqual(s.register_buffer(p, n), OK)
        keys = self.keys(3)
        res = s.batch_put_from(keys, [p, p, p + 100], [100, n, 200])
        self.assertEqual((res[0], res[2]), (OK, OK), res)
        self.assertEqual(s.get(keys[0]), read(p, 100))
        self.assertEqual(s.get(keys[2]), read(p + 100, 200))

    def test_get_into_capacity_larger_than_the_local_buffer(self):
        """get_into's size is the buffer's capacity: Mooncake reads a small
        object into a large registered buffer whatever local_buffer_size."""
        s = self.new_store(local_buffer_size=16 * MiB)
        n = 20 * MiB
        buf = bytearray(n)
        p = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        self.assertEqual(s.register_buffer(p, n), OK)
        key = self.keys(1)[0]
        val = rbytes(13, 100)
        self.assertEqual(s.put(key, val), OK)
        self.assertEqual(s.get_into(key, p, 4096), 100)
        self.assertEqual(s.get_into(key, p, n), 100)  # Mooncake: 100
        self.assertEqual(read(p, 100), val)


class AgentRestartTest(_Cluster):
    """The agent is killed and started again on the same socket between
    calls: calls meanwhile answer codes (never raise), and once the agent
    is back the next calls reopen the session and succeed."""

    def test_calls_survive_an_agent_restart(self):
        s = self.new_store()
        shared = self.host_alloc(64 * KiB)
        plain, _buf = self.plain(64 * KiB)
        fill(shared, rbytes(14, 64 * KiB))
        fill(plain, rbytes(15, 64 * KiB))
        self.assertEqual(s.register_buffer(shared, 64 * KiB), OK)
        self.assertEqual(s.register_buffer(plain, 64 * KiB), OK)
        keys = self.keys(6)
        self.assertEqual(s.put_from(keys[0], shared, 10000), OK)
        self.assertEqual(s.put_from(keys[1], plain, 10000), OK)
        self.assertEqual(s.put(keys[2], b"bytes"), OK)

        self.agent.kill()
        self.assertEqual(s.health_check(), 2)
        # Existence needs no agent: the client asks the master directly.
        self.assertEqual(s.is_exist(keys[0]), 1)
        self.assertLess(s.put_from(keys[3], shared, 100), 0)
        self.assertLess(s.put_from(keys[3], plain, 100), 0)
        self.assertEqual(s.get(keys[2]), b"")
        self.assertIsNone(s.get_buffer(keys[2]))
        self.assertLess(s.get_into(keys[0], shared + 32 * KiB, 10000), 0)
        self.assertTrue(all(r < 0 for r in s.batch_get_into(keys[:2], [shared + 32 * KiB, plain + 32 * KiB],
                                                           [10000, 10000])))
        self.agent.start()

        harness.poll(lambda: s.is_exist(keys[0]) == 1, what="is_exist after the agent restarted")
        self.assertEqual(s.health_check(), 0)
        harness.poll(lambda: s.get(keys[2]) == b"bytes", what="get after the agent restarted")
        # Both kinds of memory, both ways, on the new session.
        self.assertEqual(s.batch_get_into(keys[:2], [shared + 32 * KiB, plain + 32 * KiB], [16384, 16384]),
                         [10000, 10000])
        self.assertEqual(read(shared + 32 * KiB, 10000), read(shared, 10000))
        self.assertEqual(read(plain + 32 * KiB, 10000), read(plain, 10000))
        self.assertEqual(s.batch_put_from(keys[3:5], [shared + 100, plain + 100], [2000, 3000]), [OK, OK])
        self.assertEqual(s.put_from(keys[5], shared, 1), OK)
        self.assertEqual(s.get(keys[3]), read(shared + 100, 2000))
        self.assertEqual(s.get(keys[4]), read(plain + 100, 3000))
        self.assertEqual(s.get(keys[5]), read(shared, 1))


# ---------------------------------------------------------------------------
# 5. The compat/mooncake shim.


class ShimTest(unittest.TestCase):
    def run_python(self, code, pythonpath, cwd):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if pythonpath is not None:
            env["PYTHONPATH"] = pythonpath
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd,
                              capture_output=True, text=True, timeout=60)

    def test_compat_first_on_the_path_gives_tidepools_store(self):
        code = """
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
            from mooncake.store import MooncakeHostMemAllocator, bind_to_numa_node
            import mooncake, mooncake.store, tidepool.mooncake as tm
            assert mooncake.TIDEPOOL is True
            assert MooncakeDistributedStore is tm.MooncakeDistributedStore
            assert ReplicateConfig is tm.ReplicateConfig
            assert MooncakeHostMemAllocator is tm.MooncakeHostMemAllocator
            assert hasattr(ReplicateConfig, "group_ids")
            assert set(tm.__all__) <= set(dir(mooncake.store))
            MooncakeDistributedStore()
            print("ok", mooncake.store.__file__)
        """
        # From elsewhere, with only compat on the path: the shim finds the SDK next to it.
        for cwd in (tempfile.gettempdir(), harness.REPO):
            with self.subTest(cwd=cwd):
                r = self.run_python(code, COMPAT, cwd)
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assertTrue(r.stdout.startswith("ok "), r.stdout)
                self.assertTrue(r.stdout.split()[1].startswith(COMPAT), r.stdout)

    def test_nothing_shadows_mooncake_by_accident(self):
        code = """
            try:
                import mooncake
            except ImportError:
                print("ImportError")
            else:
                print("imported", mooncake.__file__)
        """
        for path, cwd in ((None, harness.REPO), (None, harness.PYTHON_DIR), (harness.PYTHON_DIR, harness.REPO),
                          (harness.PYTHON_DIR, tempfile.gettempdir())):
            with self.subTest(pythonpath=path, cwd=cwd):
                r = self.run_python(code, path, cwd)
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assertEqual(r.stdout.strip(), "ImportError")
        # tidepool.mooncake itself imports without Mooncake.
        r = self.run_python("import tidepool.mooncake; import sys; assert 'mooncake' not in sys.modules",
                            harness.PYTHON_DIR, tempfile.gettempdir())
        self.assertEqual(r.returncode, 0, r.stderr)


class ReplicateConfigTest(unittest.TestCase):
    def test_fields_and_defaults(self):
        rc = ReplicateConfig()
        self.assertEqual((rc.replica_num, rc.with_soft_pin, rc.with_hard_pin, rc.preferred_segment,
                          rc.preferred_segments, rc.prefer_alloc_in_same_node), (1, False, False, "", [], False))
        self.assertIsNone(rc.group_ids)
        rc.replica_num = 3
        rc.group_ids = ["group-a", ""]
        self.assertIn("3", str(rc))
        self.assertIs(mooncake.MooncakeDistributedStore, MooncakeDistributedStore)


if __name__ == "__main__":
    unittest.main()
