"""tidepool.Client, tidepool.sglang and tidepool.vllm against a real
`tidepool up` and `tidepool agent`."""

import array
import ctypes
import os
import shutil
import tempfile
import threading
import unittest

import grpc

import harness
import tidepool
from tidepool import hashing
from tidepool._proto import agent_pb2, agent_pb2_grpc
from tidepool.sglang import HiCacheStorage
from tidepool.vllm import KVConnector

try:
    import numpy
except ImportError:  # optional: the SDK never needs it
    numpy = None

MiB = 1 << 20


def value(i, n):
    """n bytes that differ from key to key."""
    b = bytes([(i * 7 + j) & 0xFF for j in range(min(n, 251))])
    return (b * (n // len(b) + 1))[:n]


@unittest.skipUnless(harness.have_go(), "needs go (or $TIDEPOOL_BIN) to build tidepool")
class ClusterTest(unittest.TestCase):
    """One `tidepool up` and one agent for the class; keys are per test."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="tidepool-pytest-")
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)
        cls.up = harness.Up(cls.dir)
        cls.addClassCleanup(cls.up.stop)
        cls.agent = harness.Agent(cls.dir, cls.up.grpc)
        cls.addClassCleanup(cls.agent.stop)

    def setUp(self):
        self.prefix = "py/%s/" % self.id().rsplit(".", 1)[-1]
        self.c = self.client()

    def client(self, **kw):
        kw.setdefault("client_name", self.id())
        c = tidepool.Client(self.agent.socket, **kw)
        self.addCleanup(c.close)
        return c

    def keys(self, n, tag=""):
        return ["%s%sk%d" % (self.prefix, tag, i) for i in range(n)]


class ClientTest(ClusterTest):
    def test_set_and_get(self):
        keys = self.keys(5)
        vals = [b"a", bytearray(b"bb" * 1000), memoryview(b"ccc"), array.array("i", range(100)),
                value(4, 3 * MiB)]
        self.assertEqual(self.c.batch_set(keys, vals), [True] * 5)
        got = self.c.batch_get(keys + [self.prefix + "absent"])
        self.assertEqual(got, [bytes(v) for v in vals] + [None])
        # A key that exists is left as it is, and the put succeeds.
        self.assertEqual(self.c.batch_set(keys[:1], [b"other"]), [True])
        self.assertEqual(self.c.get(keys[0]), b"a")
        self.c.set(self.prefix + "one", b"1")
        self.assertEqual(self.c.get(self.prefix + "one"), b"1")
        self.assertIsNone(self.c.get(self.prefix + "absent"))
        # Absent keys anywhere in a batch.
        mixed = [self.prefix + "absent1", keys[1], self.prefix + "absent2", keys[2]]
        self.assertEqual(self.c.batch_get(mixed), [None, bytes(vals[1]), None, bytes(vals[2])])
        self.assertEqual(self.c.batch_get([]), [])
        self.assertEqual(self.c.batch_set([], []), [])

    def test_get_into(self):
        keys = self.keys(4)
        vals = [value(i, 1000 + i) for i in range(4)]
        self.assertEqual(self.c.batch_set(keys, vals), [True] * 4)
        big = bytearray(4096 * 4)
        bufs = [memoryview(big)[i * 4096:(i + 1) * 4096] for i in range(4)]
        self.assertEqual(self.c.batch_get_into(keys, bufs), [1000, 1001, 1002, 1003])
        for i in range(4):
            self.assertEqual(big[i * 4096:i * 4096 + 1000 + i], vals[i])
        # Absent: 0. Too short a buffer: OutOfRange, as that item's result.
        short = bytearray(10)
        floats = array.array("f", [0.0] * 300)  # 1200 bytes, a non-byte format
        got = self.c.batch_get_into([keys[0], self.prefix + "absent", keys[1], keys[2]],
                                    [bytearray(1000), bytearray(5), short, floats])
        self.assertEqual(got[:2], [1000, 0])
        self.assertIsInstance(got[2], tidepool.OutOfRange)
        self.assertEqual(got[3], 1002)
        self.assertEqual(floats.tobytes()[:1002], vals[2])
        with self.assertRaises(tidepool.InvalidArgument):
            self.c.batch_get_into(keys[:1], [b"read-only"])
        with self.assertRaises(tidepool.InvalidArgument):
            self.c.batch_get_into(keys[:1], [memoryview(bytearray(10))[::2]])  # not contiguous
        with self.assertRaises(tidepool.InvalidArgument):
            self.c.batch_get_into(keys, [bytearray(10)])

    @unittest.skipUnless(numpy, "numpy (python3-numpy) not installed")
    def test_numpy(self):
        keys = self.keys(2)
        src = numpy.arange(2 * 1024, dtype=numpy.float16).reshape(2, 1024)
        self.assertEqual(self.c.batch_set(keys, [src[0], src[1]]), [True, True])
        dst = numpy.zeros((2, 1024), dtype=numpy.float16)
        self.assertEqual(self.c.batch_get_into(keys, [dst[0], dst[1]]), [2048, 2048])
        self.assertTrue((dst == src).all())
        # A non-contiguous source is copied first.
        self.assertEqual(self.c.batch_set(self.keys(1, "t"), [src.T]), [True])
        self.assertEqual(self.c.get(self.keys(1, "t")[0]), src.T.tobytes())

    def test_tensor_like(self):
        class Tensor:  # what the SDK uses of a torch.Tensor, which has no buffer protocol
            def __init__(self, data, device="cpu"):
                self.mem = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
                self.device, self.is_cuda = device, device != "cpu"

            def data_ptr(self):
                return ctypes.addressof(self.mem)

            def is_contiguous(self):
                return True

            def numel(self):
                return len(self.mem) // 2

            def element_size(self):
                return 2  # as for bf16

        keys = self.keys(2)
        self.assertEqual(self.c.batch_set(keys, [Tensor(value(0, 512)), Tensor(value(1, 512))]), [True, True])
        dst = [Tensor(bytes(512)), Tensor(bytes(512))]
        self.assertEqual(self.c.batch_get_into(keys, dst), [512, 512])
        self.assertEqual([bytes(t.mem) for t in dst], [value(0, 512), value(1, 512)])
        with self.assertRaises(tidepool.InvalidArgument):
            self.c.batch_get_into(keys[:1], [Tensor(bytes(512), device="cuda:0")])

    def test_lookup_and_exists(self):
        keys = self.keys(6)
        self.assertEqual(self.c.lookup(keys).matched, 0)
        self.assertEqual(self.c.batch_exists(keys), 0)
        self.assertEqual(self.c.batch_set(keys[:4], [value(i, 100 * (i + 1)) for i in range(4)], chain=True),
                         [True] * 4)
        m = self.c.lookup(keys)
        self.assertEqual(m.matched, 4)
        self.assertEqual(len(m), 4)
        self.assertEqual(m.keys, keys[:4])
        self.assertEqual([b.size for b in m.blocks], [100, 200, 300, 400])
        self.assertEqual(m.tiers, ["dram"] * 4)
        self.assertTrue(all(m.nodes))
        self.assertTrue(all(b.replicas[0].segment for b in m.blocks))
        self.assertGreater(m.lease_ttl_ms, 0)
        self.assertIsNotNone(m.lease_deadline)
        self.assertEqual(self.c.batch_exists(keys), 4)
        self.assertEqual(self.c.batch_exists(keys[:3]), 3)
        # Counting stops at the first absent key.
        self.assertEqual(self.c.batch_exists([keys[0], keys[5], keys[1]]), 1)
        self.assertEqual(self.c.lookup([keys[5]] + keys[:4]).matched, 0)
        self.assertTrue(self.c.exists(keys[0]))
        self.assertFalse(self.c.exists(keys[5]))
        self.assertEqual(self.c.lookup([]).matched, 0)
        self.assertEqual(self.c.batch_exists([]), 0)

    def test_chain_with_parent(self):
        keys = self.keys(4)
        self.assertEqual(self.c.batch_set(keys[:2], [b"0", b"1"], chain=True), [True, True])
        self.assertEqual(self.c.batch_set(keys[2:], [b"2", b"3"], chain=True, parent=keys[1]), [True, True])
        self.assertEqual(self.c.lookup(keys).matched, 4)
        with self.assertRaises(tidepool.InvalidArgument):
            self.c.batch_set(keys[:1], [b"x"], parent=keys[1])  # a parent needs chain

    def test_remove_and_clear(self):
        keys = self.keys(3)
        self.assertEqual(self.c.batch_set(keys, [b"x", b"y", b"z"]), [True] * 3)
        res = self.c.remove([keys[0], self.prefix + "absent"])
        self.assertIs(res[0], True)
        self.assertIsInstance(res[1], tidepool.NotFound)
        self.assertEqual(self.c.batch_get(keys), [None, b"y", b"z"])
        other = self.keys(2, "other/")
        self.assertEqual(self.c.batch_set(other, [b"o", b"p"]), [True, True])
        self.assertEqual(self.c.clear(self.prefix + "k"), 2)
        self.assertEqual(self.c.batch_get(keys + other), [None, None, None, b"o", b"p"])
        self.assertEqual(self.c.batch_get_into(keys + other, [bytearray(1) for _ in range(5)]), [0, 0, 0, 1, 1])
        self.assertEqual([self.c.exists(k) for k in keys + other], [False, False, False, True, True])
        self.assertEqual(self.c.clear(self.prefix + "nothing-here"), 0)
        with self.assertRaises(tidepool.InvalidArgument):
            self.c.clear("")

    def test_lookup_sees_removal(self):
        # The agent's client drops its cached descriptors of removed keys.
        keys = self.keys(2)
        self.assertEqual(self.c.batch_set(keys, [b"x", b"y"]), [True, True])
        self.assertEqual(self.c.lookup(keys).matched, 2)
        self.assertEqual(self.c.remove(keys), [True, True])
        self.assertEqual(self.c.batch_exists(keys), 0)
        self.assertEqual(self.c.lookup(keys).matched, 0)

    def test_stats(self):
        before = self.c.stats()
        for name in ("lookups", "blocks_probed", "blocks_matched", "gets", "get_bytes", "puts", "put_bytes",
                     "errors", "sessions", "session", "reopened"):
            self.assertIn(name, before)
        keys = self.keys(2)
        self.c.batch_set(keys, [b"12345", b"678"])
        self.c.batch_get(keys)
        self.c.lookup(keys)
        after = self.c.stats()
        self.assertGreaterEqual(after["puts"] - before["puts"], 2)
        self.assertGreaterEqual(after["put_bytes"] - before["put_bytes"], 8)
        self.assertGreaterEqual(after["gets"] - before["gets"], 2)
        self.assertGreaterEqual(after["get_bytes"] - before["get_bytes"], 8)
        self.assertGreaterEqual(after["lookups"] - before["lookups"], 2)
        self.assertGreaterEqual(after["sessions"], 1)

    def test_batches_larger_than_the_region(self):
        c = self.client(shm_bytes=1 * MiB)
        self.assertEqual(c.shm_bytes, 1 * MiB)
        keys = self.keys(40)
        vals = [value(i, 100 * 1024 + i) for i in range(40)]  # 4 MiB in all
        res = c.batch_set(keys, vals, chain=True)
        self.assertEqual(res, [True] * 40)
        self.assertEqual(c.lookup(keys).matched, 40)  # chained across the split
        self.assertEqual(c.batch_get(keys), vals)
        bufs = [bytearray(128 * 1024) for _ in keys]
        self.assertEqual(c.batch_get_into(keys, bufs), [len(v) for v in vals])
        self.assertEqual([bytes(b[:len(v)]) for b, v in zip(bufs, vals)], vals)

    def test_batches_of_more_keys_than_a_request_takes(self):
        import tidepool.client
        old = tidepool.client.MAX_BATCH_KEYS
        tidepool.client.MAX_BATCH_KEYS = 3  # as if the limit were 3 keys
        self.addCleanup(setattr, tidepool.client, "MAX_BATCH_KEYS", old)
        keys = self.keys(10)
        vals = [value(i, 10 + i) for i in range(10)]
        self.assertEqual(self.c.batch_set(keys[:8], vals[:8], chain=True), [True] * 8)
        self.assertEqual(self.c.lookup(keys).matched, 8)
        self.assertEqual(self.c.batch_exists(keys), 8)
        self.assertEqual(self.c.batch_exists(keys[:6]), 6)
        self.assertEqual(self.c.batch_get(keys), vals[:8] + [None, None])
        holes = [keys[0], keys[8], keys[1], keys[2], keys[3], keys[9], keys[4]]
        self.assertEqual(self.c.batch_get(holes), [vals[0], None, vals[1], vals[2], vals[3], None, vals[4]])
        bufs = [bytearray(32) for _ in keys]
        self.assertEqual(self.c.batch_get_into(keys, bufs), [len(v) for v in vals[:8]] + [0, 0])
        self.assertEqual(self.c.remove(keys[:7]), [True] * 7)
        self.assertEqual(self.c.batch_exists(keys), 0)

    def test_values_larger_than_the_region(self):
        small = self.client(shm_bytes=64 * 1024)
        key = self.keys(1)[0]
        with self.assertRaises(tidepool.ValueTooLarge) as cm:
            small.batch_set([key, key + "x"], [b"ok", bytes(64 * 1024 + 1)])
        self.assertIn("shm_bytes", str(cm.exception))
        self.assertFalse(self.c.exists(key))  # nothing stored
        self.assertEqual(self.c.batch_set([key], [bytes(100 * 1024)]), [True])
        got = small.batch_get([key])
        self.assertIsInstance(got[0], tidepool.ValueTooLarge)
        got = small.batch_get_into([key], [bytearray(100 * 1024)])
        self.assertIsInstance(got[0], tidepool.OutOfRange)

    def test_bad_keys(self):
        res = self.c.batch_set(["", self.prefix + "fine"], [b"x", b"y"])
        self.assertIsInstance(res[0], tidepool.InvalidArgument)
        self.assertIs(res[1], True)
        got = self.c.batch_get_into(["", self.prefix + "fine"], [bytearray(4), bytearray(4)])
        self.assertIsInstance(got[0], tidepool.InvalidArgument)
        self.assertEqual(got[1], 1)
        got = self.c.batch_get(["", self.prefix + "fine", "k" * 5000])
        self.assertIsInstance(got[0], tidepool.InvalidArgument)
        self.assertEqual(got[1], b"y")
        self.assertIsInstance(got[2], tidepool.InvalidArgument)
        with self.assertRaises(tidepool.InvalidArgument):
            self.c.lookup([""])
        with self.assertRaises(tidepool.InvalidArgument):
            self.c.batch_set([b"bytes-key"], [b"x"])
        with self.assertRaises(tidepool.InvalidArgument):
            self.c.batch_set(["a"], [b"x", b"y"])
        with self.assertRaises(tidepool.InvalidArgument):
            self.c.batch_set(["a"], [12])

    def test_closed_client(self):
        c = self.client()
        c.close()
        c.close()  # twice is fine
        calls = [
            lambda: c.lookup(["a"]), lambda: c.batch_exists(["a"]), lambda: c.batch_get(["a"]),
            lambda: c.batch_get_into(["a"], [bytearray(1)]), lambda: c.batch_set(["a"], [b"x"]),
            lambda: c.remove(["a"]), lambda: c.clear("a"), lambda: c.stats(), lambda: c.exists("a"),
        ]
        for i, call in enumerate(calls):
            with self.subTest(call=i):
                with self.assertRaises(tidepool.ClientClosed):
                    call()
        with tidepool.Client(self.agent.socket) as c2:
            self.assertEqual(c2.batch_exists(["a"]), 0)
        with self.assertRaises(tidepool.ClientClosed):
            c2.batch_exists(["a"])

    def test_no_agent(self):
        with self.assertRaises(tidepool.Unavailable):
            tidepool.Client(os.path.join(self.dir, "nobody.sock"))
        with self.assertRaises(tidepool.InvalidArgument):
            tidepool.Client(self.agent.socket, shm_bytes=1 << 60)  # more than the agent allows

    def test_threads_share_a_client(self):
        c = self.client(shm_bytes=512 * 1024)  # small: threads wait for room in turn
        failures = []

        def worker(t):
            try:
                keys = self.keys(20, "t%d/" % t)
                vals = [value(t * 100 + i, 20 * 1024 + t) for i in range(20)]
                for _ in range(3):
                    if c.batch_set(keys, vals) != [True] * 20:
                        failures.append("set %d" % t)
                    if c.batch_get(keys) != vals:
                        failures.append("get %d" % t)
                    bufs = [bytearray(len(v)) for v in vals]
                    if c.batch_get_into(keys, bufs) != [len(v) for v in vals] or bufs != vals:
                        failures.append("get_into %d" % t)
            except Exception as e:  # noqa: BLE001 - reported below
                failures.append(repr(e))

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        self.assertEqual(failures, [])


class EngineFlowsTest(ClusterTest):
    def test_sglang_flow(self):
        page = 16
        hasher = hashing.Hasher(hashing.SGLANG_SHA256, block_size=page)
        storage = HiCacheStorage("org/model@tp0-1", client=self.c, tenant=self.prefix)
        self.addCleanup(storage.close)
        prompt = list(range(1000, 1000 + 6 * page))
        pages = [h.hex() for h in hasher.hash(prompt)]  # SGLang's page keys
        page_bytes = 4096
        host = [value(i, page_bytes) for i in range(6)]

        # Nothing cached yet.
        self.assertEqual(storage.batch_exists(pages), 0)
        self.assertFalse(storage.exists(pages[0]))
        # Back up the first four pages, then the next two as their
        # continuation (prefix_keys names the pages before).
        self.assertEqual(storage.batch_set_v1(pages[:4], host[:4]), [True] * 4)
        self.assertEqual(storage.batch_set_v1(pages[4:], host[4:], extra_info={"prefix_keys": pages[:4]}),
                         [True, True])
        self.assertTrue(storage.exists(pages[0]))

        # A second request shares the first five pages and then diverges.
        other = prompt[:5 * page] + list(range(7, 7 + 2 * page))
        other_pages = [h.hex() for h in hasher.hash(other)]
        self.assertEqual(other_pages[:5], pages[:5])
        hit = storage.batch_exists(other_pages)
        self.assertEqual(hit, 5)
        bufs = [bytearray(page_bytes) for _ in range(hit)]
        self.assertEqual(storage.batch_get_v1(other_pages[:hit], bufs), [True] * hit)
        self.assertEqual(bufs, host[:hit])
        # A page absent, or of another size than the host page, is a miss.
        self.assertEqual(storage.batch_get_v1([other_pages[5], pages[0]],
                                              [bytearray(page_bytes), bytearray(page_bytes + 1)]), [False, False])
        # Compute and back up the rest.
        new = [value(100 + i, page_bytes) for i in range(2)]
        self.assertEqual(storage.batch_set_v1(other_pages[hit:], new, extra_info={"prefix_keys": other_pages[:hit]}),
                         [True, True])
        self.assertEqual(storage.batch_exists(other_pages), 7)
        self.assertEqual(storage.batch_exists([]), 0)

        # The older, bytes-based interface.
        self.assertEqual(storage.get(pages[1]), host[1])
        target = bytearray(page_bytes)
        self.assertIs(storage.get(pages[2], target), target)
        self.assertEqual(target, host[2])
        self.assertIsNone(storage.get("00" * 32))
        self.assertEqual(storage.batch_get(pages[:2] + ["00" * 32]), host[:2] + [None])
        self.assertTrue(storage.set("11" * 32, b"v"))
        self.assertTrue(storage.batch_set(["22" * 32, "33" * 32], [b"a", b"b"]))

        stats = storage.get_stats()
        self.assertGreater(stats["puts"], 0)
        # Pages live under the namespace: clear removes them all, and only them.
        self.assertTrue(all(k.startswith(storage.namespace.prefix) for k in storage._keys(pages)))
        outside = self.prefix + "outside"
        self.c.set(outside, b"stays")
        storage.clear()
        self.assertEqual(storage.batch_exists(pages), 0)
        self.assertEqual(self.c.batch_exists(storage._keys(pages)), 0)
        self.assertFalse(storage.exists("11" * 32))
        self.assertEqual(self.c.get(outside), b"stays")

    def test_sglang_from_config(self):
        class Config:  # the fields of SGLang's HiCacheStorageConfig it reads
            model_name = "org/m"
            tp_rank, tp_size, pp_rank, pp_size = 1, 2, 0, 1
            is_mla_model = False
            extra_config = {"tenant": "acme", "socket": self.agent.socket, "shm_bytes": MiB}

        s = HiCacheStorage.from_config(Config())
        try:
            self.assertEqual(s.namespace.prefix, "kv/sglang-sha256/org%2Fm@tp1-2/acme/")
            self.assertEqual(s.client.shm_bytes, MiB)
            self.assertEqual(s.batch_set_v1(["ab" * 32], [b"page"]), [True])
            self.assertEqual(s.batch_exists(["ab" * 32]), 1)
            s.clear()
        finally:
            s.close()
        Config.is_mla_model = True
        s = HiCacheStorage.from_config(Config(), client=self.c)
        self.assertEqual(s.namespace.model, "org/m")
        s.close()
        self.assertEqual(self.c.batch_exists(["x"]), 0)  # a shared client stays open

    def test_vllm_flow(self):
        bs = 4
        conn = KVConnector(self.c, model="org/model", block_size=bs, seed="0", tenant=self.prefix)
        tokens = list(range(50, 70))  # 5 full blocks
        block_bytes = 2048
        kv = [value(i, block_bytes) for i in range(5)]

        self.assertEqual(conn.get_num_matched_tokens(tokens), 0)
        self.assertEqual(conn.get_num_new_matched_tokens(tokens, 0), (0, False))
        self.assertEqual(conn.load(tokens, [bytearray(block_bytes) for _ in range(5)]), 0)
        # Save the first three blocks: the match grows to 12 tokens.
        self.assertEqual(conn.save(tokens, kv[:3]), 3)
        self.assertEqual(conn.get_num_matched_tokens(tokens), 12)
        # Then all five (the first three are not sent again).
        before = self.c.stats()["puts"]
        self.assertEqual(conn.save(tokens, kv), 5)
        self.assertEqual(self.c.stats()["puts"] - before, 2)
        self.assertEqual(conn.get_num_matched_tokens(tokens), 20)
        # A prompt cached whole still recomputes its last token: one block less.
        self.assertEqual(conn.get_num_new_matched_tokens(tokens, 0), (16, False))
        self.assertEqual(conn.get_num_new_matched_tokens(tokens + [1], 4), (16, False))
        self.assertEqual(conn.block_keys(tokens), conn.namespace.keys(conn.hasher, tokens))
        # The keys are vLLM's own block hashes.
        self.assertEqual(conn.block_keys(tokens)[0],
                         conn.namespace.key(hashing.Hasher(hashing.VLLM_SHA256_CBOR, bs, "0").hash(tokens[:4])[0]))

        bufs = [bytearray(block_bytes) for _ in range(5)]
        self.assertEqual(conn.load(tokens, bufs), 5)
        self.assertEqual(bufs, kv)
        # A request sharing two blocks matches 8 tokens; its own blocks chain on.
        other = tokens[:8] + [9] * 9
        self.assertEqual(conn.get_num_matched_tokens(other), 8)
        self.assertEqual(conn.save(other, kv[:2] + [value(9, block_bytes)] * 2), 4)
        self.assertEqual(conn.get_num_matched_tokens(other), 16)
        # Extra keys (a LoRA) make other blocks.
        lora = [["my-lora"]] * 5
        self.assertEqual(conn.get_num_matched_tokens(tokens, extra=lora), 0)
        # Blocks saved on a chain continue their parents: the cached prefix is exact.
        self.assertEqual(self.c.lookup(conn.block_keys(other)).matched, 4)


class SessionTest(ClusterTest):
    """Sessions the agent forgets are reopened."""

    def test_reopen_after_agent_restart(self):
        agent = harness.Agent(self.dir, self.up.grpc)
        self.addCleanup(agent.stop)
        c = tidepool.Client(agent.socket, shm_bytes=MiB)
        self.addCleanup(c.close)
        keys = self.keys(3)
        self.assertEqual(c.batch_set(keys, [b"a", b"b", b"c"]), [True] * 3)
        session = c.session

        agent.kill()  # a crash: the session is gone with the agent
        with self.assertRaises(tidepool.Unavailable):
            c.batch_get(keys)
        agent.start()

        # The cluster kept the values; the new agent does not know the
        # session, and the client opens another and carries on.
        bufs = [bytearray(1) for _ in keys]
        self.assertEqual(harness.poll(lambda: c.batch_get_into(keys, bufs), what="a get through the new agent"),
                         [1, 1, 1])
        self.assertEqual(bufs, [b"a", b"b", b"c"])
        self.assertEqual(c.reopened, 1)
        self.assertNotEqual(c.session, session)
        self.assertEqual(c.batch_set(self.keys(1, "after"), [b"d"]), [True])
        self.assertEqual(c.batch_get(keys + self.keys(1, "after")), [b"a", b"b", b"c", b"d"])

    def test_reopen_after_idle(self):
        agent = harness.Agent(self.dir, self.up.grpc, extra=["--session-idle", "500ms"])
        self.addCleanup(agent.stop)
        c = tidepool.Client(agent.socket, shm_bytes=MiB)
        self.addCleanup(c.close)
        key = self.keys(1)[0]
        self.assertEqual(c.batch_set([key], [b"v"]), [True])
        session, reopened = c.session, c.reopened  # a slow machine may have reopened already

        # Ask the agent how many sessions are open without naming one (which
        # would keep it alive), until it has ended the idle one.
        channel = grpc.insecure_channel("unix:" + agent.socket)
        self.addCleanup(channel.close)
        stub = agent_pb2_grpc.AgentStub(channel)
        harness.poll(lambda: stub.Stats(agent_pb2.SessionRef(session=0), timeout=5).sessions == 0,
                     what="the idle session ended")

        self.assertEqual(c.get(key), b"v")
        self.assertEqual(c.reopened, reopened + 1)
        self.assertNotEqual(c.session, session)


if __name__ == "__main__":
    unittest.main()
