"""tidepool.sglang.HiCacheStorage as SGLang's HiCache controller drives it,
against a real `tidepool up` and agent, with host KV pools of real torch
tensors shaped as SGLang's MHATokenToKVPoolHost and MLATokenToKVPoolHost
shape them (sglang/srt/mem_cache/pool_host/{mha,mla}.py)."""

import ctypes
import importlib
import os
import shutil
import tempfile
import unittest
import urllib.request

import harness  # noqa: F401 - puts the SDK on sys.path

import torch

import tidepool
from tidepool import hashing
from tidepool.mooncake import MooncakeHostMemAllocator
from test_client import StorageConfig


def _allocate(dims, dtype, shared):
    """A pool tensor: from MooncakeHostMemAllocator, as SGLang's
    MooncakeHostTensorAllocator makes it (shared with the agent), or plain
    host memory (copied through the session's region)."""
    if not shared:
        return torch.zeros(dims, dtype=dtype)
    size = 1
    for d in dims:
        size *= d
    size *= torch.tensor([], dtype=dtype).element_size()
    alloc = MooncakeHostMemAllocator()
    ptr = alloc.alloc(size)
    assert ptr
    t = torch.frombuffer((ctypes.c_byte * size).from_address(ptr), dtype=torch.uint8, count=size)
    return t.view(dtype).view(dims)


class MHAPool:
    """SGLang's MHATokenToKVPoolHost: kv_buffer and get_page_buffer_meta."""

    def __init__(self, layout, pages, page_size=4, layer_num=3, head_num=2, head_dim=8,
                 dtype=torch.bfloat16, shared=False):
        self.layout, self.page_size, self.layer_num = layout, page_size, layer_num
        self.head_num, self.head_dim, self.dtype = head_num, head_dim, dtype
        self.page_num = pages
        self.size = pages * page_size
        dims = {
            "layer_first": (2, layer_num, self.size, head_num, head_dim),
            "page_first": (2, self.size, layer_num, head_num, head_dim),
            "page_first_direct": (2, pages, layer_num, page_size, head_num, head_dim),
        }[layout]
        self.kv_buffer = _allocate(dims, dtype, shared)
        self.isz = self.kv_buffer.element_size()

    def get_page_buffer_meta(self, indices):
        assert len(indices) % self.page_size == 0
        base = self.kv_buffer.data_ptr()
        L, H, D, P, isz = self.layer_num, self.head_num, self.head_dim, self.page_size, self.isz
        v_offset = L * self.size * H * D * isz
        ptrs, sizes = [], []
        for idx in indices[::P].tolist():
            if self.layout == "layer_first":
                for layer in range(L):
                    k = base + idx * H * D * isz + layer * self.size * H * D * isz
                    ptrs += [k, k + v_offset]
                    sizes += [isz * P * H * D] * 2
            else:
                k = base + idx * L * H * D * isz
                ptrs += [k, k + v_offset]
                sizes += [L * isz * P * H * D] * 2
        return ptrs, sizes

    def page(self, idx):
        """The page's bytes, as get_data_page(idx) would flatten them."""
        P = self.page_size
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, idx:idx + P].flatten()
        if self.layout == "page_first":
            return self.kv_buffer[:, idx:idx + P].flatten()
        return self.kv_buffer[:, idx // P:idx // P + 1].flatten()


class MLAPool(MHAPool):
    """SGLang's MLATokenToKVPoolHost (kv_cache_dim = kv_lora_rank +
    qk_rope_head_dim)."""

    def __init__(self, layout, pages, page_size=4, layer_num=3, kv_cache_dim=24, dtype=torch.bfloat16,
                 shared=False):
        self.layout, self.page_size, self.layer_num, self.kv_cache_dim = layout, page_size, layer_num, kv_cache_dim
        self.page_num, self.size, self.dtype = pages, pages * page_size, dtype
        dims = {
            "layer_first": (layer_num, self.size, 1, kv_cache_dim),
            "page_first": (self.size, layer_num, 1, kv_cache_dim),
            "page_first_direct": (pages, layer_num, page_size, 1, kv_cache_dim),
        }[layout]
        self.kv_buffer = _allocate(dims, dtype, shared)
        self.isz = self.kv_buffer.element_size()

    def get_page_buffer_meta(self, indices):
        base, L, C, P, isz = self.kv_buffer.data_ptr(), self.layer_num, self.kv_cache_dim, self.page_size, self.isz
        ptrs, sizes = [], []
        for idx in indices[::P].tolist():
            if self.layout == "layer_first":
                for layer in range(L):
                    ptrs.append(base + idx * C * isz + layer * self.size * C * isz)
                    sizes.append(isz * P * C)
            else:
                ptrs.append(base + idx * L * C * isz)
                sizes.append(L * isz * P * C)
        return ptrs, sizes

    def page(self, idx):
        P = self.page_size
        if self.layout == "layer_first":
            return self.kv_buffer[:, idx:idx + P].flatten()
        if self.layout == "page_first":
            return self.kv_buffer[idx:idx + P].flatten()
        return self.kv_buffer[idx // P:idx // P + 1].flatten()


class ExtraInfo:
    """SGLang's HiCacheStorageExtraInfo."""

    def __init__(self, prefix_keys=None, extra_info=None):
        self.prefix_keys, self.extra_info = prefix_keys, extra_info


def indices(pages, page_size):
    """Host token indices of the given host pages, as the pool's alloc
    hands them out (int64 CPU)."""
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size, dtype=torch.int64) for p in pages])


class HiCacheTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="tidepool-sglang-")
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)
        cls.up = harness.Up(cls.dir)
        cls.addClassCleanup(cls.up.stop)
        cls.agent = harness.Agent(cls.dir, cls.up.grpc)
        cls.addClassCleanup(cls.agent.stop)

    def backend(self, pool, tenant="", **cfg):
        """Built the way SGLang's dynamic factory builds it: the module and
        class named in extra_config, called with (storage_config, kwargs),
        then given the host pool."""
        extra = {"backend_name": "tidepool", "module_path": "tidepool.sglang", "class_name": "HiCacheStorage",
                 "interface_v1": 1, "socket": self.agent.socket,
                 "tenant": self.id().rsplit(".", 1)[-1] + tenant}
        config = StorageConfig(model_name="org/model", extra_config=extra,
                               is_page_first_layout=pool.layout == "page_first", **cfg)
        cls = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
        b = cls(config, {})
        self.addCleanup(b.close)
        b.register_mem_pool_host(pool)
        self.addCleanup(b.clear)
        return b

    def leased_gets(self):
        """The agent's count of values read under a lookup's lease."""
        with urllib.request.urlopen("http://%s/metrics" % self.agent.http, timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("tidepool_agent_leased_gets_total "):
                    return float(line.split()[1])
        raise AssertionError("no tidepool_agent_leased_gets_total")

    def flow(self, make_pool, layout, shared):
        P = 4
        src, dst = make_pool(layout, 12, shared=shared), make_pool(layout, 12, shared=shared)
        torch.manual_seed(1)
        src.kv_buffer.copy_(torch.randn(src.kv_buffer.shape).to(src.kv_buffer.dtype))
        tenant = "-%s-%s-%s" % (make_pool.__name__, layout, shared)
        b = self.backend(src, tenant, is_mla_model=isinstance(src, MLAPool))
        hasher = hashing.Hasher(hashing.SGLANG_SHA256, block_size=P)
        prompt = list(range(500, 500 + 6 * P))
        pages = [h.hex() for h in hasher.hash(prompt)]

        # Prefetch of an uncached prompt: nothing.
        self.assertEqual(b.batch_exists(pages, ExtraInfo()), 0)
        # Backup: the controller writes pages from host indices, batch by
        # batch, naming the pages before as prefix_keys.
        self.assertEqual(b.batch_set_v1(pages[:4], indices([0, 1, 2, 3], P), ExtraInfo()), [True] * 4)
        self.assertEqual(b.batch_set_v1(pages[4:], indices([7, 5], P), ExtraInfo(prefix_keys=pages[:4])),
                         [True, True])
        # Again: already there, still True.
        self.assertEqual(b.batch_set_v1(pages[:2], indices([0, 1], P)), [True, True])

        # Prefetch on another instance (the destination pool): batch_exists,
        # then batch_get_v1 into freshly allocated host indices.
        d = self.backend(dst, tenant, is_mla_model=isinstance(dst, MLAPool))
        other = prompt[:5 * P] + list(range(9, 9 + P))
        other_pages = [h.hex() for h in hasher.hash(other)]
        hit = d.batch_exists(other_pages, ExtraInfo())
        self.assertEqual(hit, 5)
        into = [10, 3, 4, 11, 6]
        leased = self.leased_gets()
        self.assertEqual(d.batch_get_v1(other_pages[:hit], indices(into, P), ExtraInfo()), [True] * hit)
        # batch_exists leased what it reported: the get read under that lease.
        self.assertEqual(self.leased_gets() - leased, hit * d._per_page)
        for page, (s, t) in enumerate(zip([0, 1, 2, 3, 7], into)):
            with self.subTest(page=page):
                self.assertTrue(torch.equal(src.page(s * P), dst.page(t * P)), "page %d differs" % page)
        # A page that is not there is a miss; the ones before still load.
        self.assertEqual(d.batch_get_v1([other_pages[4], other_pages[5]], indices([8, 9], P)), [True, False])
        stats = d.get_stats()
        self.assertTrue(stats["prefetch_pgs"] if isinstance(stats, dict) else stats.prefetch_pgs)

    def test_layouts(self):
        for make in (MHAPool, MLAPool):
            for layout in ("page_first", "page_first_direct", "layer_first"):
                for shared in (False, True):
                    with self.subTest(pool=make.__name__, layout=layout, shared=shared):
                        self.flow(make, layout, shared)

    def test_layouts_do_not_mix(self):
        # Pages written from one layout are not read into another: their
        # bytes are ordered differently.
        P = 4
        a, b = MHAPool("page_first", 4), MHAPool("page_first_direct", 4)
        wa, wb = self.backend(a), self.backend(b)
        page = "cd" * 32
        self.assertEqual(wa.batch_set_v1([page], indices([0], P)), [True])
        self.assertEqual(wb.batch_exists([page]), 0)

    def test_flat_pages(self):
        # Without interface_v1 the controller moves flat page tensors:
        # get_data_page for a backup, get_dummy_flat_data_page to read into.
        pool = MHAPool("page_first", 4)
        pool.kv_buffer.copy_(torch.arange(pool.kv_buffer.numel()).view(pool.kv_buffer.shape).to(pool.dtype))
        b = self.backend(pool)
        keys = ["ef" * 32, "01" * 32]
        self.assertTrue(b.batch_set(keys, [pool.page(0), pool.page(4)]))
        targets = [torch.zeros_like(pool.page(0)) for _ in range(3)]
        got = b.batch_get(keys + ["23" * 32], targets)
        self.assertTrue(torch.equal(got[0], pool.page(0)))
        self.assertTrue(torch.equal(got[1], pool.page(4)))
        self.assertIsNone(got[2])
        self.assertTrue(b.exists(keys[0]) is False)  # flat pages are not v1 pages
        self.assertIsNotNone(b.get(keys[1], torch.zeros_like(pool.page(0))))

    def test_subclass_of_sglangs_base_when_importable(self):
        import tidepool.sglang as s
        try:
            from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as Base
        except ImportError:
            self.assertIs(s._Base, object)
        else:
            self.assertTrue(issubclass(s.HiCacheStorage, Base))


if __name__ == "__main__":
    unittest.main()
