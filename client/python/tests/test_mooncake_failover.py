"""tidepool.mooncake through a master failover mid-batch: three `tidepool
master` processes, a store and an agent; the leader is killed while a
thread keeps putting and getting. Every call answers a code (never raises),
the calls succeed again once a new leader serves, and every value a put
answered 0 for reads back byte for byte."""

import ctypes
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import unittest

import harness

from tidepool.mooncake import MooncakeDistributedStore, MooncakeHostMemAllocator

MiB = 1 << 20
N = 16  # values per batch


class FailoverTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="tidepool-mc-failover-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.grpc = [harness.free_addr() for _ in range(3)]
        raft = [harness.free_addr() for _ in range(3)]
        peers = ",".join("m%d=%s" % (i + 1, raft[i]) for i in range(3))
        self.masters = {}
        for i in range(3):
            p = harness.Proc("master", ["master", "--id", "m%d" % (i + 1), "--dir", os.path.join(self.dir, "m%d" % i),
                                        "--listen", self.grpc[i], "--raft", raft[i], "--peers", peers,
                                        "--http", harness.free_addr(), "--lease-ttl", "2s"], self.dir)
            self.addCleanup(p.stop)
            self.masters["m%d" % (i + 1)] = p
        all_masters = ",".join(self.grpc)
        store = harness.Proc("store", ["store", "--id", "s1", "--masters", all_masters, "--listen", harness.free_addr(),
                                       "--tier", "dram:256MiB", "--http", harness.free_addr()], self.dir)
        self.addCleanup(store.stop)
        self.agent = harness.Agent(self.dir, all_masters)
        self.addCleanup(self.agent.stop)
        self.all = all_masters

    def leader(self):
        out = subprocess.run([harness.binary(), "status", "--masters", self.all, "--timeout", "5s"],
                             capture_output=True, text=True).stdout
        m = re.search(r"^leader (\S+) at", out, re.M)
        return m.group(1) if m else None

    def test_failover_mid_batch(self):
        env = {"TIDEPOOL_AGENT_SOCKET": self.agent.socket}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        self.addCleanup(lambda: [os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
                                 for k, v in old.items()])
        s = MooncakeDistributedStore()
        self.assertEqual(s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 * MiB, "tcp", "", self.all), 0)
        self.addCleanup(s.close)
        src = MooncakeHostMemAllocator().alloc(2 * N * MiB)
        self.assertEqual(s.register_buffer(src, 2 * N * MiB), 0)
        stored = {}  # key -> the bytes a put answered 0 for
        failures, raised = [], []
        stop = threading.Event()

        def work():
            batch = 0
            try:
                while not stop.is_set():
                    keys = ["failover/%d/%d" % (batch, i) for i in range(N)]
                    fill = bytes([batch % 251]) * 1024
                    for i in range(N):
                        ctypes.memmove(src + i * MiB, (fill * 1024)[:MiB], MiB)
                    rs = s.batch_put_from(keys, [src + i * MiB for i in range(N)], [MiB] * N)
                    for k, r in zip(keys, rs):
                        if r == 0:
                            stored[k] = (fill * 1024)[:MiB]
                        else:
                            failures.append(r)
                    batch += 1
            except Exception as e:  # noqa: BLE001 - what the test is about
                raised.append(e)

        t = threading.Thread(target=work)
        t.start()
        self.addCleanup(stop.set)
        harness.poll(lambda: len(stored) >= 2 * N, what="puts before the failover")
        leader = harness.poll(self.leader, what="a leader")
        before = len(stored)
        self.masters[leader].kill()
        harness.poll(lambda: (self.leader() or leader) != leader, timeout=60, what="a new leader")
        harness.poll(lambda: len(stored) >= before + 2 * N, timeout=60, what="puts after the failover")
        stop.set()
        t.join(60)
        self.assertEqual(raised, [])
        self.assertTrue(all(isinstance(r, int) and r < 0 for r in failures), failures[:5])
        # Every value stored reads back, byte for byte.
        dst = src + N * MiB
        for k, want in stored.items():
            n = s.get_into(k, dst, MiB)
            self.assertEqual(n, MiB, k)
            self.assertEqual(ctypes.string_at(dst, MiB), want, k)


if __name__ == "__main__":
    unittest.main()
