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
import inspect
import logging
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest
import uuid
from unittest import mock

import grpc

# Run from the repository root (python3 -m unittest client/python/tests/test_mooncake.py)
# as well as by discovery in this directory.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import tidepool  # noqa: E402
from tidepool import mooncake  # noqa: E402
from tidepool.mooncake import MooncakeDistributedStore, MooncakeHostMemAllocator, ReplicateConfig  # noqa: E402
from tidepool.mooncake import launch  # noqa: E402
from tidepool.mooncake import store as mc_store  # noqa: E402

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
    test: once the pool is full and its objects are read (leased for the
    whole test), nothing is evictable and puts find no room."""

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
        # Read, so leased: nothing is evictable, and every new put answers
        # -200, whatever its path.
        for k in stored:
            self.assertEqual(len(s.get(k)), MiB)
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


# ---------------------------------------------------------------------------
# 6. The return-code table of docs/engines.md, row by row. Each test is
# named after its row (test_row_<code>_...) and asserts the exact code of
# every "when" clause of that row: end to end where real processes provoke
# it reliably, else with a fake client under the store (a per-item error,
# or a whole request's raised), and codes.of itself over every error class.

RPC_FAIL, RPC_TIMEOUT, INTERNAL_ERROR = -900, -901, -1
LEASE_EXPIRED, TRANSFER_FAIL, CHECKSUM_MISMATCH = -707, -800, -801
SLOW = bool(os.environ.get("TIDEPOOL_MOONCAKE_SLOW_TESTS"))


def _short_client(timeout):
    """A stand-in for tidepool.Client in tidepool.mooncake.store whose
    requests time out after timeout seconds instead of setup's 60 s, so
    that a master that does not answer costs a test seconds, not minutes."""

    def make(*args, **kw):
        kw["timeout"] = timeout
        return tidepool.Client(*args, **kw)

    return mock.patch.object(mc_store, "Client", make)


def _exe(dir, name, body):
    """An executable shell script in dir."""
    path = os.path.join(dir, name)
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body + "\n")
    os.chmod(path, 0o755)
    return path


class _FakeClient:
    """What MooncakeDistributedStore calls of tidepool.Client (set as a
    store's _client): every item of every call answers `item` (a
    tidepool.Error instance, as a batch call answers a failed item; None:
    success), or every call raises `whole` (a whole request's failure, or
    any other exception)."""

    def __init__(self, item=None, whole=None, size=100):
        self.item, self.whole, self.size = item, whole, size
        self.calls = []
        self.closed = False

    def _answer(self, name, keys, ok):
        self.calls.append(name)
        if self.whole is not None:
            raise self.whole
        return [ok(k) if self.item is None else self.item for k in keys]

    def batch_get_regions(self, keys, dests):
        return self._answer("batch_get_regions", keys, lambda k: self.size)

    def batch_set_regions(self, keys, srcs, chain=False, parent=None, replicas=0):
        return self._answer("batch_set_regions", keys, lambda k: True)

    def batch_set(self, keys, values, chain=False, parent=None, replicas=0):
        return self._answer("batch_set", keys, lambda k: True)

    def batch_get(self, keys):
        return self._answer("batch_get", keys, lambda k: b"v" * self.size)

    def present(self, keys, timeout=None):
        return self._answer("present", keys, lambda k: True)

    def describe(self, keys):
        return self._answer("describe", keys, lambda k: tidepool.BlockInfo(k, self.size, 0, ()))

    def remove(self, keys):
        return self._answer("remove", keys, lambda k: True)

    def clear_all(self, regex=None):
        return len(self._answer("clear_all", ["*"], lambda k: 3)) * 3

    def ping(self, timeout=None):
        self._answer("ping", [], None)

    def detach(self, att):
        pass

    def close(self):
        self.closed = True


class FakeClientCodeTest(unittest.TestCase):
    """The rows real processes cannot provoke reliably (an expired lease, a
    transfer or checksum failure, a deadline, a region timeout, a racing
    put): the store runs on a _FakeClient answering them."""

    K, K2 = "fake/k", "fake/k2"

    def store(self, **kw):
        """A store on a _FakeClient(**kw), with 16 KiB of plain host memory
        registered: the store, its fake and the memory's address."""
        s = MooncakeDistributedStore()
        self.addCleanup(s.close)
        fake = _FakeClient(**kw)
        s._client = fake
        buf = (ctypes.c_char * (16 * KiB))()
        self.addCleanup(lambda b=buf: None)
        p = ctypes.addressof(buf)
        self.assertEqual(s.register_buffer(p, 16 * KiB), OK)
        return s, fake, p

    def reads(self, s, p):
        """The reads that answer codes, by name."""
        k, k2 = self.K, self.K2
        return {
            "get_into": s.get_into(k, p, 4096),
            "batch_get_into": s.batch_get_into([k, k2], [p, p + 4096], [4096, 4096]),
            "batch_get_into_multi_buffers": s.batch_get_into_multi_buffers([k, k2], [[p, p + 2048], [p + 4096]],
                                                                           [[2048, 2048], [4096]]),
        }

    def puts(self, s, p):
        """The puts, by name."""
        k, k2 = self.K, self.K2
        return {
            "put": s.put(k, b"v" * 100),
            "put_parts": s.put_parts(k, b"a" * 50, b"b" * 50),
            "put_batch": s.put_batch([k, k2], [b"1" * 10, b"2" * 10]),
            "put_from": s.put_from(k, p, 100),
            "batch_put_from": s.batch_put_from([k, k2], [p, p + 100], [100, 100]),
            "batch_put_from_multi_buffers": s.batch_put_from_multi_buffers([k, k2], [[p, p + 100], [p + 200]],
                                                                           [[50, 50], [100]]),
        }

    def others(self, s):
        """The other calls that reach the client and answer codes."""
        k, k2 = self.K, self.K2
        return {
            "is_exist": s.is_exist(k),
            "batch_is_exist": s.batch_is_exist([k, k2]),
            "get_size": s.get_size(k),
            "remove": s.remove(k),
            "remove(force)": s.remove(k, force=True),
            "batch_remove": s.batch_remove([k, k2]),
            "remove_all": s.remove_all(),
            "remove_by_regex": s.remove_by_regex("^fake/"),
        }

    def assert_codes(self, got, code, why):
        """Every answer in got (a dict name: int or list of ints) is code."""
        for name, v in got.items():
            with self.subTest(call=name, why=why):
                if isinstance(v, list):
                    self.assertEqual(v, [code] * len(v), "%s: %r" % (name, v))
                    self.assertTrue(v)
                else:
                    self.assertEqual(v, code, name)

    def test_fake_success(self):
        # The fake itself: what a healthy client answers.
        s, fake, p = self.store()
        self.assert_codes(self.puts(s, p), OK, "success")
        got = self.reads(s, p)
        self.assertEqual(got, {"get_into": 100, "batch_get_into": [100, 100],
                               "batch_get_into_multi_buffers": [100, 100]})
        self.assertEqual(s.is_exist(self.K), 1)
        self.assertEqual(s.get_size(self.K), 100)
        self.assertEqual(s.remove_all(), 3)
        self.assertEqual(s.health_check(), 0)
        self.assertIn("batch_set_regions", fake.calls)
        self.assertIn("batch_get_regions", fake.calls)
        self.assertEqual(s.close(), OK)
        self.assertTrue(fake.closed)

    def test_row_0_ok_put_that_races_another_put(self):
        # Aborted on a put: another put of the key is under way (Mooncake
        # answers a put of a key that exists 0); per item, or the whole request.
        for how in ("item", "whole"):
            s, _, p = self.store(**{how: tidepool.Aborted("put of the key in progress")})
            self.assert_codes(self.puts(s, p), OK, "Aborted " + how)

    def test_row_minus1_unexpected_failure(self):
        # An error no row names (INTERNAL, UNKNOWN, ...) answered for an item.
        for err in (tidepool.errors.Internal("boom"), tidepool.errors.Unknown("?")):
            s, _, p = self.store(item=err)
            self.assert_codes(self.puts(s, p), INTERNAL_ERROR, repr(err))
            self.assert_codes(self.reads(s, p), INTERNAL_ERROR, repr(err))
        # A Python exception inside the layer: logged with its traceback and
        # answered -1, never raised into the engine's thread.
        s, _, p = self.store(whole=RuntimeError("a bug in the layer"))
        for group in (lambda: self.puts(s, p), lambda: self.reads(s, p), lambda: self.others(s)):
            with self.assertLogs("tidepool.mooncake", "ERROR") as logs:
                got = group()
            self.assertTrue(all(r.exc_info for r in logs.records), logs.output)
            self.assert_codes(got, INTERNAL_ERROR, "RuntimeError inside the layer")

    def test_row_minus200_no_room(self):
        # ResourceExhausted: no room and nothing evictable; OutOfRange on a
        # put: larger than any segment. Per item and for the whole request.
        for err in (tidepool.ResourceExhausted("no space"), tidepool.OutOfRange("larger than any segment")):
            for how in ("item", "whole"):
                s, _, p = self.store(**{how: err})
                self.assert_codes(self.puts(s, p), NO_AVAILABLE_HANDLE, "%r %s" % (err, how))

    def test_row_minus600_from_the_client(self):
        # A value larger than the session's region (the client's
        # ValueTooLarge), per item and whole.
        for how in ("item", "whole"):
            s, _, p = self.store(**{how: tidepool.errors.ValueTooLarge("larger than the region")})
            self.assert_codes(self.puts(s, p), INVALID_PARAMS, "ValueTooLarge " + how)
        # OutOfRange on a read: the value is longer than the buffer given.
        s, _, p = self.store(item=tidepool.OutOfRange("value longer than its span"))
        self.assert_codes(self.reads(s, p), INVALID_PARAMS, "OutOfRange on a read")
        # A client closed under the store (after close).
        s, _, p = self.store(whole=tidepool.errors.ClientClosed("client closed"))
        self.assert_codes(self.puts(s, p), INVALID_PARAMS, "ClientClosed")
        self.assert_codes(self.reads(s, p), INVALID_PARAMS, "ClientClosed")
        self.assert_codes(self.others(s), INVALID_PARAMS, "ClientClosed")

    def test_row_minus704_not_found(self):
        s, _, p = self.store(item=tidepool.NotFound("no such key"))
        self.assert_codes(self.reads(s, p), OBJECT_NOT_FOUND, "NotFound")
        self.assert_codes({"get_size": s.get_size(self.K), "remove": s.remove(self.K),
                           "batch_remove": s.batch_remove([self.K, self.K2])}, OBJECT_NOT_FOUND, "NotFound")

    def test_row_minus707_lease_expired_on_a_read(self):
        # Aborted on a read: it outlived its lease. Per item and whole.
        for how in ("item", "whole"):
            s, _, p = self.store(**{how: tidepool.Aborted("lease expired")})
            self.assert_codes(self.reads(s, p), LEASE_EXPIRED, "Aborted " + how)

    def test_row_minus800_transfer_fail(self):
        # One value's bytes failed to move (its store went away, or the
        # transfer timed out or was cancelled): that item alone, both ways.
        for err in (tidepool.Unavailable("store gone"), tidepool.errors.DeadlineExceeded("copy timed out"),
                    tidepool.errors.Cancelled("store closing")):
            s, _, p = self.store(item=err)
            self.assert_codes(self.reads(s, p), TRANSFER_FAIL, repr(err))
            self.assert_codes(self.puts(s, p), TRANSFER_FAIL, repr(err))
        # In a batch, only the failed item: the fake fails every item; here
        # a client failing only the second.
        s, fake, p = self.store()
        fake.batch_get_regions = lambda keys, dests: [100, tidepool.Unavailable("store gone")]
        self.assertEqual(s.batch_get_into([self.K, self.K2], [p, p + 4096], [4096, 4096]), [100, TRANSFER_FAIL])
        fake.batch_set_regions = lambda keys, srcs, **kw: [tidepool.Unavailable("store gone"), True]
        self.assertEqual(s.batch_put_from([self.K, self.K2], [p, p + 100], [100, 100]), [TRANSFER_FAIL, OK])

    def test_row_minus801_checksum_mismatch(self):
        for how in ("item", "whole"):
            s, _, p = self.store(**{how: tidepool.DataLoss("no replica passed its checksum")})
            self.assert_codes(self.reads(s, p), CHECKSUM_MISMATCH, "DataLoss " + how)

    def test_row_minus900_rpc_fail(self):
        # The agent, or the cluster behind it, did not answer: the whole request.
        s, _, p = self.store(whole=tidepool.Unavailable("agent gone"))
        self.assert_codes(self.puts(s, p), RPC_FAIL, "Unavailable whole")
        self.assert_codes(self.reads(s, p), RPC_FAIL, "Unavailable whole")
        self.assert_codes(self.others(s), RPC_FAIL, "Unavailable whole")
        self.assertEqual(s.health_check(), 2)

    def test_row_minus901_rpc_timeout(self):
        # The request's deadline passed (or it was cancelled): the whole request.
        for err in (tidepool.errors.DeadlineExceeded("Deadline Exceeded"), tidepool.errors.Cancelled("cancelled")):
            s, _, p = self.store(whole=err)
            self.assert_codes(self.puts(s, p), RPC_TIMEOUT, repr(err))
            self.assert_codes(self.reads(s, p), RPC_TIMEOUT, repr(err))
            self.assert_codes(self.others(s), RPC_TIMEOUT, repr(err))
        # Waiting for room in the session's region timed out (RegionTimeout),
        # raised whole or answered for an item.
        for how in ("item", "whole"):
            s, _, p = self.store(**{how: tidepool.RegionTimeout("region busy")})
            self.assert_codes(self.puts(s, p), RPC_TIMEOUT, "RegionTimeout " + how)
            self.assert_codes(self.reads(s, p), RPC_TIMEOUT, "RegionTimeout " + how)

    def test_health_check_on_a_fake(self):
        s, fake, _ = self.store()
        self.assertEqual(s.health_check(), 0)
        fake.whole = tidepool.Unavailable("agent gone")
        self.assertEqual(s.health_check(), 2)
        fake.whole = tidepool.errors.DeadlineExceeded("master silent")
        self.assertEqual(s.health_check(), 2)
        self.assertEqual(s.close(), OK)
        self.assertEqual(s.health_check(), 1)


class CodesOfTest(unittest.TestCase):
    """codes.of over every error class of tidepool/errors.py: of a whole
    request and of one item, on a read and on a put."""

    # class: (read whole, read item, put whole, put item), from the table.
    E = tidepool.errors
    WANT = {
        E.Error: (-1, -1, -1, -1),
        E.Cancelled: (-901, -800, -901, -800),
        E.Unknown: (-1, -1, -1, -1),
        E.InvalidArgument: (-600, -600, -600, -600),
        E.DeadlineExceeded: (-901, -800, -901, -800),
        E.NotFound: (-704, -704, -704, -704),
        E.AlreadyExists: (-1, -1, -1, -1),
        E.PermissionDenied: (-1, -1, -1, -1),
        E.ResourceExhausted: (-200, -200, -200, -200),
        E.FailedPrecondition: (-1, -1, -1, -1),
        E.Aborted: (-707, -707, 0, 0),
        E.OutOfRange: (-600, -600, -200, -200),
        E.Unimplemented: (-1, -1, -1, -1),
        E.Internal: (-1, -1, -1, -1),
        E.Unavailable: (-900, -800, -900, -800),
        E.DataLoss: (-801, -801, -801, -801),
        E.Unauthenticated: (-1, -1, -1, -1),
        E.ValueTooLarge: (-600, -600, -600, -600),
        E.RegionTimeout: (-901, -901, -901, -901),
        E.ClientClosed: (-600, -600, -600, -600),
    }

    def test_every_error_class_is_in_the_table(self):
        classes = {c for _, c in inspect.getmembers(self.E, inspect.isclass)
                   if issubclass(c, self.E.Error) and c.__module__ == self.E.__name__}
        self.assertEqual(classes, set(self.WANT))

    def test_of(self):
        from tidepool.mooncake import codes
        for cls, want in self.WANT.items():
            err = cls("message")
            got = (codes.of(err), codes.of(err, item=True), codes.of(err, put=True),
                   codes.of(err, item=True, put=True))
            with self.subTest(error=cls.__name__):
                self.assertEqual(got, want)
        # As the client builds them from an item's status code.
        for code in grpc.StatusCode:
            err = self.E.from_code(code, "m")
            with self.subTest(code=code):
                self.assertEqual(codes.of(err, item=True), self.WANT[type(err)][1])
        # Not a Tidepool error at all: unexpected.
        self.assertEqual(codes.of(RuntimeError("x")), -1)
        self.assertEqual(codes.of(RuntimeError("x"), item=True, put=True), -1)

    def test_the_codes_are_mooncakes(self):
        self.assertEqual((mooncake.OK, mooncake.INTERNAL_ERROR, mooncake.NO_AVAILABLE_HANDLE, mooncake.INVALID_PARAMS,
                          mooncake.OBJECT_NOT_FOUND, mooncake.LEASE_EXPIRED, mooncake.TRANSFER_FAIL,
                          mooncake.CHECKSUM_MISMATCH, mooncake.RPC_FAIL, mooncake.RPC_TIMEOUT),
                         (0, -1, -200, -600, -704, -707, -800, -801, -900, -901))


class SetupCodeTest(unittest.TestCase):
    """setup's codes that need no cluster: -600 for bad arguments (answered
    before any agent is looked for), -1 when no agent answers and none can
    be started. No agent answers at TIDEPOOL_AGENT_SOCKET here."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="tidepool-mooncake-setup-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.masters = harness.free_addr()  # nobody listens there
        self.env({"TIDEPOOL_AGENT_SOCKET": os.path.join(self.dir, "nobody.sock"),
                  "TIDEPOOL_BIN": os.path.join(self.dir, "no-such-tidepool"),
                  "MOONCAKE_CONFIG_PATH": None, "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": None})

    def env(self, changes):
        e = _Env(changes)
        self.addCleanup(e.restore)

    def setup_rc(self, *args, **kw):
        """setup's answer, and that the store is left unusable."""
        s = MooncakeDistributedStore()
        self.addCleanup(s.close)
        t0 = time.monotonic()
        rc = s.setup(*args, **kw)
        self.elapsed = time.monotonic() - t0
        self.assertEqual(s.health_check(), 1)
        self.assertIsNone(s._agent)
        return rc

    def args(self, gss=0, lbs=16 * MiB, masters=None):
        return ("localhost", "P2PHANDSHAKE", gss, lbs, "tcp", "", self.masters if masters is None else masters)

    def test_row_minus600_setup_with_a_bad_size(self):
        for gss, lbs in (("lots", 16 * MiB), (0, "16 parsecs"), (-1, 16 * MiB), (0, -5), ("-1", 16 * MiB),
                         ("1.5xb", 16 * MiB), (True, 16 * MiB), (0, "")):
            with self.subTest(global_segment_size=gss, local_buffer_size=lbs):
                self.assertEqual(self.setup_rc(*self.args(gss, lbs)), INVALID_PARAMS)
        # The dict form too.
        self.assertEqual(self.setup_rc({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                                        "global_segment_size": "huge", "master_server_address": self.masters}),
                         INVALID_PARAMS)
        self.assertEqual(self.setup_rc({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                                        "local_buffer_size": "-16mb", "master_server_address": self.masters}),
                         INVALID_PARAMS)

    def test_row_minus600_setup_with_an_empty_master_server_addr(self):
        for addr in ("", "   ", ",", " ; ", "tidepool://"):
            with self.subTest(master_server_addr=addr):
                self.assertEqual(self.setup_rc(*self.args(masters=addr)), INVALID_PARAMS)
                self.assertLess(self.elapsed, 5)
        for key in ("master_server_addr", "master_server_address"):
            with self.subTest(config_key=key):
                self.assertEqual(self.setup_rc({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                                                key: ""}), INVALID_PARAMS)

    def test_row_minus1_setup_with_no_binary(self):
        # TIDEPOOL_BIN names no file.
        self.assertEqual(self.setup_rc(*self.args()), INTERNAL_ERROR)
        self.assertLess(self.elapsed, 5)
        # No TIDEPOOL_BIN, and no tidepool on PATH.
        empty = os.path.join(self.dir, "empty-bin")
        os.mkdir(empty)
        self.env({"TIDEPOOL_BIN": None, "PATH": empty})
        self.assertEqual(self.setup_rc(*self.args()), INTERNAL_ERROR)
        # The config file's tidepool_bin names no file.
        cfg = os.path.join(self.dir, "mooncake.json")
        with open(cfg, "w") as f:
            f.write('{"tidepool_bin": "%s"}' % os.path.join(self.dir, "also-missing"))
        self.env({"MOONCAKE_CONFIG_PATH": cfg})
        self.assertEqual(self.setup_rc(*self.args()), INTERNAL_ERROR)

    def test_row_minus1_setup_when_the_agent_does_not_become_ready(self):
        # A binary that exits at once instead of serving.
        self.env({"TIDEPOOL_BIN": _exe(self.dir, "tidepool", "exit 3")})
        self.assertEqual(self.setup_rc(*self.args()), INTERNAL_ERROR)
        self.assertLess(self.elapsed, 10)
        # One that serves nothing until the start timeout (shortened here
        # from launch's 30 s).
        self.env({"TIDEPOOL_BIN": _exe(self.dir, "tidepool-waits", "exec cat >/dev/null")})  # ends with its stdin
        with mock.patch.object(launch, "START_TIMEOUT", 1.0):
            self.assertEqual(self.setup_rc(*self.args()), INTERNAL_ERROR)
        self.assertLess(self.elapsed, 20)


@unittest.skipUnless(harness.have_go(), "needs go (or $TIDEPOOL_BIN) to build tidepool")
class DeadMastersTest(unittest.TestCase):
    """An agent whose masters (a free port nobody listens on) do not
    answer, and setup's -900."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="tidepool-mooncake-deadmasters-")
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)
        cls.masters = harness.free_addr()
        cls.socket = os.path.join(cls.dir, "agent.sock")
        cls.proc = harness.Proc("agent", ["agent", "--socket", cls.socket, "--masters", cls.masters,
                                          "--http", harness.free_addr()], cls.dir)
        cls.addClassCleanup(cls.proc.stop)

        def serving():
            cls.proc.check_alive()
            return launch.answers(cls.socket)

        harness.poll(serving, what="the agent serving")
        cls.env = _Env({"TIDEPOOL_AGENT_SOCKET": cls.socket, "MOONCAKE_CONFIG_PATH": None,
                        "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": None})
        cls.addClassCleanup(cls.env.restore)

    def setup_rc(self):
        s = MooncakeDistributedStore()
        self.addCleanup(s.close)
        t0 = time.monotonic()
        rc = s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "", self.masters)
        self.elapsed = time.monotonic() - t0
        self.assertEqual(s.health_check(), 1)
        return rc

    def test_row_minus900_setup_when_no_master_answers(self):
        # Requests time out after 2 s here (setup's Client waits 20 s by
        # default: see the slow test below).
        with _short_client(2.0):
            self.assertEqual(self.setup_rc(), RPC_FAIL)
        self.assertLess(self.elapsed, 10)

    @unittest.skipUnless(SLOW, "takes 20 s: set TIDEPOOL_MOONCAKE_SLOW_TESTS=1")
    def test_setup_when_no_master_answers_is_bounded(self):
        # setup as it is: bounded by its Client's 20 s request timeout.
        self.assertEqual(self.setup_rc(), RPC_FAIL)
        self.assertLess(self.elapsed, 25)

    def test_row_minus900_setup_starting_an_agent_for_masters_that_do_not_answer(self):
        # No agent answers at the socket: setup starts one for the masters
        # named, which serves, but no master leader answers it: -900, after
        # the request timeout (shortened here).
        env = _Env({"TIDEPOOL_AGENT_SOCKET": os.path.join(self.dir, "nobody.sock"), "TIDEPOOL_BIN": harness.binary()})
        self.addCleanup(env.restore)
        with _short_client(2.0):
            self.assertEqual(self.setup_rc(), RPC_FAIL)
        self.assertLess(self.elapsed, 15)


class CodeTableTest(_Cluster):
    """The rows' clauses not covered end to end above."""

    def test_row_0_ok_put_from_of_0_bytes_stores_nothing(self):
        s = self.new_store()
        p, _buf = self.plain(4096)
        a = self.host_alloc(4096)
        unregistered, _buf2 = self.plain(4096)
        self.assertEqual(s.register_buffer(p, 4096), OK)
        self.assertEqual(s.register_buffer(a, 4096), OK)
        keys = self.keys(7)
        self.assertEqual(s.put_from(keys[0], p, 0), OK)
        self.assertEqual(s.put_from(keys[1], a, 0), OK)
        self.assertEqual(s.put_from(keys[2], unregistered, 0), OK)
        self.assertEqual(s.put_from(keys[3], p, 0, ReplicateConfig()), OK)
        self.assertEqual(s.batch_put_from(keys[4:6], [p, a + 10], [0, 10]), [OK, OK])
        self.assertEqual(s.batch_put_from_multi_buffers([keys[6]], [[p, a]], [[0, 0]]), [OK])
        self.assertEqual(s.batch_is_exist(keys), [0, 0, 0, 0, 0, 1, 0])
        for k in keys[:5] + keys[6:]:
            self.assertIs(s.is_exist(k), 0)
            self.assertEqual(s.get_size(k), OBJECT_NOT_FOUND)
        self.assertEqual(s.get(keys[5]), read(a + 10, 10))
        # put_parts of no bytes: 0, nothing stored, as Mooncake's.
        self.assertEqual(s.put_parts(keys[0]), OK)
        self.assertEqual(s.put_parts(keys[0], b"", bytearray()), OK)
        self.assertIs(s.is_exist(keys[0]), 0)

    def test_row_1_0_is_exist(self):
        s = self.new_store()
        k = self.keys(2)
        self.assertEqual(s.put(k[0], b"here"), OK)
        self.assertIs(s.is_exist(k[0]), 1)
        self.assertIs(s.is_exist(k[0].encode()), 1)
        self.assertIs(s.is_exist(k[1]), 0)
        # A key the pool would refuse is absent.
        refused = ["", self.prefix + "x" * 4096, b"\xff\xfe", b""]
        for r in refused:
            self.assertIs(s.is_exist(r), 0)
        got = s.batch_is_exist([k[0], k[1]] + refused + [k[0].encode()])
        self.assertEqual(got, [1, 0, 0, 0, 0, 0, 1])
        self.assertEqual({type(x) for x in got}, {int})

    def test_row_n_gt_0_lengths_sizes_and_counts(self):
        s = self.new_store()
        p, _buf = self.plain(64 * KiB)
        self.assertEqual(s.register_buffer(p, 64 * KiB), OK)
        keys = self.keys(3, "a") + self.keys(2, "b")
        vals = [rbytes(("n", i), 1000 * (i + 1) + i) for i in range(5)]
        for k, v in zip(keys, vals):
            self.assertEqual(s.put(k, v), OK)
        lens = [len(v) for v in vals]
        # get_size: each size.
        self.assertEqual([s.get_size(k) for k in keys], lens)
        # get_into and the batches: each value's length (capacity larger).
        d = p + 32 * KiB
        self.assertEqual(s.get_into(keys[4], d, 8192), lens[4])
        self.assertEqual(read(d, lens[4]), vals[4])
        self.assertEqual(s.batch_get_into(keys, [d + i * 6000 for i in range(5)], [6000] * 5), lens)
        for i in range(5):
            self.assertEqual(read(d + i * 6000, lens[i]), vals[i])
        self.assertEqual(s.batch_get_into_multi_buffers(keys[:2], [[d, d + 600], [d + 2000, d + 4000]],
                                                        [[600, 600], [1500, 1500]]), lens[:2])
        self.assertEqual(read(d, 600) + read(d + 600, 400), vals[0])
        self.assertEqual(read(d + 2000, 1500) + read(d + 4000, 501), vals[1])
        # remove_by_regex: how many it removed (RE2, matching anywhere).
        self.assertEqual(s.remove_by_regex("^" + self.prefix + "a"), 3)
        self.assertEqual(s.remove_by_regex(self.prefix + "a"), 0)
        self.assertEqual(s.batch_is_exist(keys), [0, 0, 0, 1, 1])
        # remove_all: how many it removed (every object of the pool).
        s.remove_all()
        more = self.keys(4, "c")
        for k in more:
            self.assertEqual(s.put(k, b"c"), OK)
        self.assertEqual(s.remove_all(), 4)
        self.assertEqual(s.remove_all(force=True), 0)

    def test_row_minus600_unregister_buffer_of_an_address_not_registered(self):
        s = self.new_store()
        p, _buf = self.plain(8192)
        a = self.host_alloc(8192)
        self.assertEqual(s.register_buffer(p, 4096), OK)
        self.assertEqual(s.register_buffer(a, 8192), OK)
        self.assertEqual(s.unregister_buffer(p + 4096), INVALID_PARAMS)  # never registered
        self.assertEqual(s.unregister_buffer(p + 1), INVALID_PARAMS)  # inside one, not its start
        self.assertEqual(s.unregister_buffer(a + 4096), INVALID_PARAMS)
        self.assertEqual(s.unregister_buffer(0), INVALID_PARAMS)
        self.assertEqual(s.unregister_buffer(p), OK)
        self.assertEqual(s.unregister_buffer(p), INVALID_PARAMS)  # no longer
        self.assertEqual(s.unregister_buffer(a, 8192), OK)
        self.assertEqual(s.unregister_buffer(a, 8192), INVALID_PARAMS)

    def test_row_minus600_remove_by_regex_with_a_bad_pattern(self):
        s = self.new_store()
        k = self.keys(1)[0]
        self.assertEqual(s.put(k, b"stays"), OK)
        for pattern in ("(", "[", "a**", "(?<name", "", None, 5, b"^mc"):
            with self.subTest(pattern=pattern):
                self.assertEqual(s.remove_by_regex(pattern), INVALID_PARAMS)
                self.assertEqual(s.remove_by_regex(pattern, force=True), INVALID_PARAMS)
        self.assertIs(s.is_exist(k), 1)  # nothing removed
        self.assertEqual(s.remove_by_regex("^" + k + "$"), 1)

    def test_row_minus600_value_larger_than_the_sessions_region(self):
        # local_buffer_size 16 MiB: the session's region is its floor, 64 MiB.
        s = self.new_store(local_buffer_size=16 * MiB)
        n = 64 * MiB + 1
        big = bytes(n)
        k = self.keys(3)
        self.assertEqual(s.put(k[0], big), INVALID_PARAMS)
        self.assertEqual(s.put_parts(k[0], big[:MiB], memoryview(big)[MiB:]), INVALID_PARAMS)
        self.assertEqual(s.put_batch([k[1], k[0]], [b"small", big]), INVALID_PARAMS)
        self.assertEqual(s.batch_is_exist(k[:2]), [0, 0])  # nothing stored: not even the small one
        # get_buffer (and get) of a stored value larger than the region:
        # stored zero-copy from the allocator's memory.
        a = self.host_alloc(n)
        self.assertEqual(s.register_buffer(a, n), OK)
        self.assertEqual(s.put_from(k[2], a, n), OK)
        self.assertEqual(s.get_size(k[2]), n)
        self.assertIsNone(s.get_buffer(k[2]))  # get_buffer answers no code: None
        self.assertEqual(s.batch_get_buffer([k[2]]), [None])
        self.assertEqual(s.get(k[2]), b"")
        # Raising local_buffer_size makes them fit.
        s2 = self.new_store(local_buffer_size=n + MiB)
        self.assertEqual(s2.put(k[0], big), OK)
        self.assertEqual(s2.get_size(k[0]), n)
        h = s2.get_buffer(k[2])
        self.assertIsNotNone(h)
        self.assertEqual(len(h), n)
        self.assertEqual(s2.batch_remove([k[0], k[2]]), [OK, OK])

    def test_row_minus600_bare_bytes_for_a_list(self):
        s = self.new_store()
        p, _buf = self.plain(4096)
        self.assertEqual(s.register_buffer(p, 4096), OK)
        for bare in (b"abc", bytearray(b"abc"), "abc"):
            with self.subTest(bare=bare):
                self.assertEqual(s.batch_is_exist(bare), [INVALID_PARAMS])
                self.assertEqual(s.batch_remove(bare), [INVALID_PARAMS])
                self.assertEqual(s.batch_get_into(bare, [p] * 3, [10] * 3), [INVALID_PARAMS])
                self.assertEqual(s.batch_get_into_multi_buffers(bare, [[p]] * 3, [[10]] * 3), [INVALID_PARAMS])
                self.assertEqual(s.batch_put_from(bare, [p] * 3, [10] * 3), [INVALID_PARAMS])
                self.assertEqual(s.batch_put_from_multi_buffers(bare, [[p]] * 3, [[10]] * 3), [INVALID_PARAMS])
        self.assertEqual(s.batch_is_exist(["a", "b", "c"]), [0, 0, 0])

    def test_row_minus704_absent_key_with_an_empty_key(self):
        # An empty key is -600 (its row), also where Mooncake answers -704.
        s = self.new_store()
        p, _buf = self.plain(4096)
        self.assertEqual(s.register_buffer(p, 4096), OK)
        self.assertEqual(s.get_into("", p, 4096), INVALID_PARAMS)
        self.assertEqual(s.get_size(""), INVALID_PARAMS)
        self.assertEqual(s.remove(""), INVALID_PARAMS)
        self.assertEqual(s.batch_get_into(["", self.prefix + "absent"], [p, p], [4096, 4096]),
                         [INVALID_PARAMS, OBJECT_NOT_FOUND])
        self.assertEqual(s.batch_remove(["", self.prefix + "absent"]), [INVALID_PARAMS, OBJECT_NOT_FOUND])

    def test_health_check_0_and_1(self):
        self.assertEqual(MooncakeDistributedStore().health_check(), 1)
        s = self.new_store()
        self.assertEqual(s.health_check(), 0)
        self.assertEqual(s.close(), OK)
        self.assertEqual(s.health_check(), 1)


class AgentGoneTest(_Cluster):
    """-900 end to end: the agent is killed under a set-up store."""

    def test_row_minus900_the_agent_does_not_answer(self):
        s = self.new_store()
        shared = self.host_alloc(64 * KiB)
        plain, _buf = self.plain(64 * KiB)
        fill(shared, rbytes(16, 64 * KiB))
        fill(plain, rbytes(17, 64 * KiB))
        self.assertEqual(s.register_buffer(shared, 64 * KiB), OK)
        self.assertEqual(s.register_buffer(plain, 64 * KiB), OK)
        k = self.keys(4)
        self.assertEqual(s.put_from(k[0], shared, 1000), OK)
        self.assertEqual(s.put_from(k[1], plain, 1000), OK)
        self.agent.kill()
        got = {
            "put": s.put(k[2], b"v"),
            "put_parts": s.put_parts(k[2], b"a", b"b"),
            "put_batch": s.put_batch([k[2], k[3]], [b"1", b"2"]),
            "put_from(shared)": s.put_from(k[2], shared, 100),
            "put_from(plain)": s.put_from(k[2], plain, 100),
            "batch_put_from": s.batch_put_from(k[2:], [shared, plain], [100, 100]),
            "batch_put_from_multi_buffers": s.batch_put_from_multi_buffers(k[2:], [[shared], [plain, plain + 10]],
                                                                           [[10], [10, 10]]),
            "get_into(shared)": s.get_into(k[0], shared + 32 * KiB, 4096),
            "get_into(plain)": s.get_into(k[1], plain + 32 * KiB, 4096),
            "batch_get_into": s.batch_get_into(k[:2], [shared + 32 * KiB, plain + 32 * KiB], [4096, 4096]),
            "batch_get_into_multi_buffers": s.batch_get_into_multi_buffers(
                k[:2], [[shared + 32 * KiB], [plain + 32 * KiB, plain + 40 * KiB]], [[4096], [512, 512]]),
            "get_size": s.get_size(k[0]),
            "remove": s.remove(k[0]),
            "batch_remove": s.batch_remove(k[:2]),
            "remove_all": s.remove_all(),
            "remove_by_regex": s.remove_by_regex("^" + self.prefix),
        }
        for name, v in got.items():
            with self.subTest(call=name):
                self.assertEqual(v, [RPC_FAIL] * len(v) if isinstance(v, list) else RPC_FAIL)
        self.assertEqual(s.health_check(), 2)
        self.assertEqual(s.get(k[0]), b"")


class MasterGoneTest(_Cluster):
    """The master (`tidepool up`) is killed under a set-up store: the
    cluster behind the agent does not answer, and the agent keeps asking
    (a failover would end) until the request's deadline: -901. The store's
    requests time out after 1 s here (tidepool_timeout, 20 s by
    default)."""

    def test_row_minus901_the_cluster_does_not_answer(self):
        with _short_client(1.0):
            s = self.new_store()
        p, _buf = self.plain(8192)
        self.assertEqual(s.register_buffer(p, 8192), OK)
        k = self.keys(2)
        self.assertEqual(s.put(k[0], b"before"), OK)
        self.assertEqual(s.health_check(), 0)
        self.up.proc.kill()
        t0 = time.monotonic()
        self.assertEqual(s.health_check(), 2)
        self.assertLess(time.monotonic() - t0, 10)
        got = {"is_exist": s.is_exist(k[0]), "put": s.put(k[1], b"after"), "get_into": s.get_into(k[0], p, 8192)}
        for name, v in got.items():
            with self.subTest(call=name):
                self.assertEqual(v, RPC_TIMEOUT)


if __name__ == "__main__":
    unittest.main()
