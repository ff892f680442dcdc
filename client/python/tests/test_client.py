"""tidepool.Client, tidepool.sglang and tidepool.vllm against a real
`tidepool up` and `tidepool agent`."""

import array
import concurrent.futures
import ctypes
import gc
import os
import shutil
import tempfile
import textwrap
import threading
import time
import unittest
from unittest import mock

import grpc
import torch

import harness
import tidepool
from tidepool import hashing
from tidepool._proto import agent_pb2, agent_pb2_grpc, tidepool_pb2
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


class RpcError(grpc.RpcError):
    """A failed call as gRPC raises it."""

    def __init__(self, code, details="injected"):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def end_session(socket, session):
    """Asks the agent at socket to end session: the StatusCode it answers
    (NOT_FOUND: no such session)."""
    with grpc.insecure_channel("unix:" + socket) as ch:
        try:
            agent_pb2_grpc.AgentStub(ch).Close(agent_pb2.SessionRef(session=session), timeout=10)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


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
    def test_present_asks_the_master_directly(self):
        keys = self.keys(3)
        self.assertEqual(self.c.batch_set(keys[:2], [b"a", b"b"]), [True, True])
        # The agent announced its masters; once the line to the leader is up
        # present() goes there, and the agent sees no Exists.
        harness.poll(lambda: self.c._res.masters._ready, what="the direct line to the master")
        before = self.c.stats()["lookups"]
        self.assertEqual(self.c.present(keys), [True, True, False])
        self.assertEqual(self.c.stats()["lookups"], before)
        # A key the master refuses in a batch: the agent answers, it absent.
        self.assertEqual(self.c.present(["", keys[0], "x" * 5000]), [False, True, False])
        self.assertEqual(self.c.stats()["lookups"], before + 1)
        # A bare str is refused, not taken apart.
        with self.assertRaises(tidepool.InvalidArgument):
            self.c.present(keys[0])
        with self.assertRaises(tidepool.InvalidArgument):
            self.c.remove(keys[0])

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

    def test_close_waits_for_calls_in_flight(self):
        c = tidepool.Client(self.agent.socket, shm_bytes=MiB)
        self.addCleanup(c.close)
        key = self.keys(1)[0]
        self.assertEqual(c.batch_set([key], [b"value"]), [True])
        session = c.session
        stub = c._res.stub
        real = stub.BatchGet
        closer = threading.Thread(target=c.close)

        def batch_get(req, **kw):
            resp = real(req, **kw)
            # Another thread closes the client while this answer is on its
            # way back: close() waits for the call before unmapping.
            closer.start()
            harness.poll(lambda: c._closed, what="close() started")
            time.sleep(0.05)
            if not closer.is_alive():
                raise AssertionError("close() returned under a call in flight")
            return resp

        stub.BatchGet = batch_get
        buf = bytearray(16)
        self.assertEqual(c.batch_get_into([key], [buf]), [5])
        self.assertEqual(bytes(buf[:5]), b"value")
        closer.join(30)
        self.assertFalse(closer.is_alive())
        with self.assertRaises(tidepool.ClientClosed):
            c.batch_get_into([key], [buf])
        self.assertEqual(end_session(self.agent.socket, session), grpc.StatusCode.NOT_FOUND)

    def test_batch_set_reports_the_groups_stored_before_a_failure(self):
        c = self.client(shm_bytes=256 * 1024)  # groups of at most half: 128 KiB
        keys = self.keys(6)
        vals = [value(i, 60 * 1024) for i in range(6)]  # two values a group
        stub = c._res.stub
        real = stub.BatchPut
        calls = []
        fail = {}

        def batch_put(req, **kw):
            calls.append(len(req.keys))
            if len(calls) in fail:
                raise RpcError(fail[len(calls)])
            return real(req, **kw)

        stub.BatchPut = batch_put
        session = c.session
        fail[2] = grpc.StatusCode.INVALID_ARGUMENT
        res = c.batch_set(keys, vals, chain=True)
        self.assertEqual(calls, [2, 2])
        self.assertEqual(res[:2], [True, True])
        for r in res[2:]:
            self.assertIsInstance(r, tidepool.InvalidArgument)
        self.assertEqual(c.batch_exists(keys), 2)
        # The agent answered: its spans went back, and the session is kept.
        self.assertEqual(c.session, session)
        self.assertEqual(c._region.alloc.free_bytes(), c._region.size)

        # A failure of the first group is raised: nothing was stored.
        calls.clear()
        fail = {1: grpc.StatusCode.INVALID_ARGUMENT}
        with self.assertRaises(tidepool.InvalidArgument):
            c.batch_set(keys[2:], vals[2:], chain=True, parent=keys[1])

        # No answer (the deadline passed): the agent may still read the
        # span, so the session is retired, and ended, before the call
        # returns; the next call opens another.
        calls.clear()
        fail = {1: grpc.StatusCode.DEADLINE_EXCEEDED}
        with self.assertRaises(tidepool.DeadlineExceeded):
            c.batch_set(keys[2:], vals[2:], chain=True, parent=keys[1])
        self.assertEqual(end_session(self.agent.socket, session), grpc.StatusCode.NOT_FOUND)
        fail = {}
        self.assertEqual(c.batch_set(keys[2:], vals[2:], chain=True, parent=keys[1]), [True] * 4)
        self.assertNotEqual(c.session, session)
        self.assertEqual(c.reopened, 1)
        self.assertEqual(c.batch_get(keys), vals)

    def test_an_abandoned_get_retires_its_session(self):
        # The deadline of a get may pass while the agent copies into its
        # span: the span must not go back to the allocator (another call
        # would stage bytes there for the late copy to overwrite). The
        # session is retired instead: the agent's Close waits for the copy.
        size = 32 * MiB
        key = self.keys(1)[0]
        val = value(5, size)
        self.assertEqual(self.c.batch_set([key], [val]), [True])
        buf = bytearray(size)
        abandoned = 0
        for t in [0.0005 * 2 ** i for i in range(14)]:
            c = self.client(shm_bytes=size + MiB, timeout=30)
            old = c._region
            # A view of the span's end outlives the unmap, as a late write
            # would see it.
            tail = old.view[size - 4096:size]
            c._timeout = t
            try:
                got = c.batch_get_into([key], [buf])
            except (tidepool.DeadlineExceeded, tidepool.Cancelled):
                # Cancelled: the agent's gRPC reset the stream at the
                # deadline before the client's own timer fired.
                abandoned += 1
            else:
                self.assertEqual(got, [size])
                tail.release()
                break  # the deadline is longer than the get: done
            finally:
                c._timeout = 30
            with self.subTest(timeout=t):
                self.assertTrue(old.retired)
                self.assertTrue(old.ended)
                self.assertLess(old.alloc.free_bytes(), old.size, "the abandoned span was given back")
                self.assertEqual(end_session(self.agent.socket, old.session), grpc.StatusCode.NOT_FOUND)
                # Nothing writes into the span once the call has returned.
                tail[:] = b"\xee" * 4096
                time.sleep(0.05)
                self.assertEqual(bytes(tail), b"\xee" * 4096)
                # The next call opens a new session.
                self.assertEqual(c.batch_get_into([key], [buf]), [size])
                self.assertEqual(buf, val)
                self.assertNotEqual(c.session, old.session)
                self.assertEqual(c.reopened, 1)
            tail.release()
            c.close()
        self.assertGreater(abandoned, 0, "no deadline was short enough")

    def test_opening_a_session_does_not_hold_up_other_calls(self):
        c = self.client(shm_bytes=MiB)
        key = self.keys(1)[0]
        c.set(key, b"v")
        old = c._region
        c._retire(old)  # the next call that needs a session opens one
        stub = c._res.stub
        real = stub.Open
        opening, release = threading.Event(), threading.Event()

        def open_(req, **kw):
            opening.set()
            release.wait(30)
            return real(req, **kw)

        stub.Open = open_
        got = []
        t = threading.Thread(target=lambda: got.append(c.get(key)))
        t.start()
        try:
            self.assertTrue(opening.wait(30))
            self.assertEqual(c.batch_exists([key]), 1)  # while the Open waits
        finally:
            release.set()
            t.join(30)
        self.assertEqual(got, [b"v"])
        self.assertEqual(c.reopened, 1)
        # The retired session was ended by the call that opened the next.
        self.assertTrue(old.ended)
        self.assertEqual(end_session(self.agent.socket, old.session), grpc.StatusCode.NOT_FOUND)


class EngineFlowsTest(ClusterTest):
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
            self.assertTrue(s.batch_set(["ab" * 32], [b"page"]))
            self.assertEqual(s.batch_get(["ab" * 32]), [b"page"])
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


    def test_a_dropped_client_ends_its_session(self):
        c = tidepool.Client(self.agent.socket, shm_bytes=MiB)
        session = c.session
        self.assertEqual(c.batch_set(self.keys(1), [b"v"]), [True])
        del c
        gc.collect()
        self.assertEqual(end_session(self.agent.socket, session), grpc.StatusCode.NOT_FOUND)

    def test_a_forked_child_opens_a_session_of_its_own(self):
        # gRPC works in a forked child only with its fork support on, which
        # must be set before it is imported: hence a process of its own.
        script = textwrap.dedent("""
            import tidepool

            c = tidepool.Client(%(socket)r, shm_bytes=1 << 20)
            c.set(%(key)r + "parent", b"p")
            parent = c.session
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                try:
                    ok = c.session != parent and c.get(%(key)r + "parent") == b"p"
                    c.set(%(key)r + "child", b"c")
                    msg = "child ok" if ok and c.reopened == 0 else "child shares the session"
                except Exception as e:
                    msg = "child failed: %%r" %% e
                os.write(w, msg.encode())
                sys.exit(0)  # its finalizers must not end the parent's session
            os.close(w)
            with os.fdopen(r) as f:
                print(f.read())
            os.waitpid(pid, 0)
            # The parent's session is whole: same id, never reopened.
            c.stats()
            print("parent ok" if c.session == parent and c.reopened == 0 else "parent lost its session")
            print("child's value", c.get(%(key)r + "child"))
            c.close()
        """) % {"socket": self.agent.socket, "key": self.prefix}
        p = harness.run_script(script, fork_support=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.split("\n")[:3], ["child ok", "parent ok", "child's value b'c'"], p.stderr)


class FakeAgent(agent_pb2_grpc.AgentServicer):
    """Answers Open with a region of its choosing, as a process that bound
    the agent's socket first could."""

    def __init__(self, path, size):
        self.path, self.size = path, size
        self.opened, self.closed = 0, []

    def Open(self, req, ctx):
        self.opened += 1
        return agent_pb2.OpenResponse(session=7, shm_path=self.path, shm_bytes=self.size, idle_timeout_ms=600000)

    def BatchPut(self, req, ctx):
        return tidepool_pb2.ItemsResponse(results=[tidepool_pb2.ItemStatus() for _ in req.keys])

    def Close(self, req, ctx):
        self.closed.append(req.session)
        return req


class TrustTest(unittest.TestCase):
    """The client stages values only in a memfd of an agent of its own
    user."""

    SIZE = 1 << 20

    def serve(self, path, size=SIZE):
        d = tempfile.mkdtemp(prefix="tpt")
        self.addCleanup(shutil.rmtree, d, True)
        agent = FakeAgent(path, size)
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
        agent_pb2_grpc.add_AgentServicer_to_server(agent, server)
        sock = os.path.join(d, "agent.sock")
        server.add_insecure_port("unix:" + sock)
        server.start()
        self.addCleanup(server.stop, None)
        return sock, agent

    def memfd(self, size):
        fd = os.memfd_create("tidepool-test")
        self.addCleanup(os.close, fd)
        os.ftruncate(fd, size)
        return fd, "/proc/%d/fd/%d" % (os.getpid(), fd)

    def test_a_plain_file_is_refused(self):
        d = tempfile.mkdtemp(prefix="tpt")
        self.addCleanup(shutil.rmtree, d, True)
        region = os.path.join(d, "not-a-memfd")
        with open(region, "wb") as f:
            f.truncate(self.SIZE)
        os.chmod(region, 0o666)  # what another user would leave for us
        sock, agent = self.serve(region)
        with self.assertRaises(tidepool.PermissionDenied) as cm:
            tidepool.Client(sock, shm_bytes=self.SIZE)
        self.assertIn("not an agent's", str(cm.exception))
        self.assertEqual(agent.closed, [7])  # the session is ended

    def test_a_memfd_of_another_size_is_refused(self):
        _, path = self.memfd(self.SIZE // 2)
        sock, agent = self.serve(path)
        with self.assertRaises(tidepool.PermissionDenied) as cm:
            tidepool.Client(sock, shm_bytes=self.SIZE)
        self.assertIn("%d bytes" % (self.SIZE // 2), str(cm.exception))
        self.assertEqual(agent.closed, [7])

    def test_a_memfd_of_this_user_is_mapped(self):
        fd, path = self.memfd(self.SIZE)
        sock, agent = self.serve(path)
        with tidepool.Client(sock, shm_bytes=self.SIZE) as c:
            self.assertEqual(c.batch_set(["k"], [b"staged here"]), [True])
        self.assertEqual(os.pread(fd, 11, 0), b"staged here")
        self.assertEqual(agent.closed, [7])

    def test_an_agent_of_another_user_is_refused(self):
        _, path = self.memfd(self.SIZE)
        sock, agent = self.serve(path)
        with mock.patch("os.getuid", return_value=os.getuid() + 1):
            with self.assertRaises(tidepool.PermissionDenied) as cm:
                tidepool.Client(sock, shm_bytes=self.SIZE)
        self.assertIn("runs as uid %d" % os.getuid(), str(cm.exception))
        self.assertEqual(agent.opened, 0)  # refused before opening a session


class DownClient:
    """A tidepool.Client while its agent restarts: every call raises
    Unavailable, as the real one does."""

    def __getattr__(self, name):
        def call(*args, **kwargs):
            raise tidepool.Unavailable("%s: failed to connect to all addresses" % name)
        return call


class StorageConfig:
    """The fields of SGLang's HiCacheStorageConfig."""

    def __init__(self, **kw):
        self.model_name = "org/m"
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = 0, 1, 0, 1
        self.attn_cp_rank, self.attn_cp_size = 0, 1
        self.dp_rank, self.dp_size = 0, 1
        self.is_mla_model = False
        self.is_page_first_layout = False
        self.enable_storage_metrics = False
        self.extra_config = None
        self.__dict__.update(kw)


class AdapterTest(unittest.TestCase):
    """The engine adapters' contracts, without an agent."""

    PAGE = "ab" * 32

    def test_sglang_backend_never_raises(self):
        # SGLang's prefetch and backup threads catch nothing else: an
        # exception would end them, and L3 with them, for the process's life.
        s = HiCacheStorage("org/m", client=DownClient())
        page = self.PAGE
        with self.assertLogs("tidepool.sglang", "WARNING") as logs:
            for name, call, want in [
                ("batch_exists", lambda: s.batch_exists([page]), 0),
                ("exists", lambda: s.exists(page), False),
                ("batch_get_v1", lambda: s.batch_get_v1([page], torch.arange(4)), [False]),
                ("batch_set_v1", lambda: s.batch_set_v1([page], torch.arange(4)), [False]),
                ("get", lambda: s.get(page), None),
                ("get into", lambda: s.get(page, bytearray(8)), None),
                ("batch_get", lambda: s.batch_get([page, page]), [None, None]),
                ("batch_get into", lambda: s.batch_get([page], [bytearray(8)]), [None]),
                ("set", lambda: s.set(page, b"x"), False),
                ("batch_set", lambda: s.batch_set([page], [b"x"]), False),
                ("clear", s.clear, None),
            ]:
                with self.subTest(name):
                    self.assertEqual(call(), want)
        self.assertIn("Unavailable", "\n".join(logs.output))

    def test_vllm_connector_never_raises(self):
        conn = KVConnector(DownClient(), model="org/m", block_size=4, seed="0")
        tokens = list(range(12))
        with self.assertLogs("tidepool.vllm", "WARNING"):
            self.assertEqual(conn.get_num_matched_tokens(tokens), 0)
            self.assertEqual(conn.get_num_new_matched_tokens(tokens, 0), (0, False))
            self.assertEqual(conn.load(tokens, [bytearray(8)] * 3), 0)
            self.assertEqual(conn.save(tokens, [b"x"] * 3), 0)

        class Flaky:  # counting fails; storing works, or fails after two blocks are known stored
            def __init__(self, exists=None):
                self.exists = exists

            def batch_exists(self, keys):
                if self.exists is None:
                    raise tidepool.Unavailable("down")
                return self.exists

            def batch_set(self, keys, values, chain=False, parent=None):
                if self.exists is not None:
                    raise tidepool.Unavailable("down")
                return [True] * len(keys)

        with self.assertLogs("tidepool.vllm", "WARNING"):
            self.assertEqual(KVConnector(Flaky(), "org/m", 4, "0").save(tokens, [b"x"] * 3), 3)
            self.assertEqual(KVConnector(Flaky(exists=2), "org/m", 4, "0").save(tokens, [b"x"] * 3), 2)

    def test_sglang_namespace_from_config(self):
        def prefix(**kw):
            return HiCacheStorage.from_config(StorageConfig(**kw), client=object()).namespace.prefix

        self.assertEqual(prefix(), "kv/sglang-sha256/org%2Fm@tp0-1//")
        self.assertEqual(prefix(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2), "kv/sglang-sha256/org%2Fm@tp1-2@pp1-2//")
        # Context-parallel ranks hold different slices of a page.
        self.assertEqual(prefix(attn_cp_rank=1, attn_cp_size=2), "kv/sglang-sha256/org%2Fm@tp0-1@cp1-2//")
        self.assertNotEqual(prefix(attn_cp_rank=0, attn_cp_size=2), prefix(attn_cp_rank=1, attn_cp_size=2))
        self.assertEqual(prefix(is_mla_model=True, attn_cp_rank=1, attn_cp_size=2), "kv/sglang-sha256/org%2Fm@cp1-2//")
        # The host pool's layout changes a page's bytes.
        self.assertEqual(prefix(is_page_first_layout=True), "kv/sglang-sha256/org%2Fm@tp0-1@page-first//")
        # Once the pool is registered, its own layout names it.
        s = HiCacheStorage.from_config(StorageConfig(), client=object())
        s.register_mem_pool_host(type("Pool", (), {"layout": "page_first_direct"})())
        self.assertEqual(s.namespace.prefix, "kv/sglang-sha256/org%2Fm@tp0-1@page-first-direct//")
        self.assertEqual(prefix(extra_config={"tenant": "acme"}), "kv/sglang-sha256/org%2Fm@tp0-1/acme/")

    def test_sglang_registers_the_host_pool(self):
        s = HiCacheStorage("org/m", client=object())
        pool = object()
        s.register_mem_pool_host(pool)  # SGLang calls it on every backend it attaches
        self.assertIs(s.mem_pool_host, pool)


if __name__ == "__main__":
    unittest.main()
