"""The agent setup starts: it contributes global_segment_size to the pool
as a store node of its own, and it dies with the process that started it,
however that process ends."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import unittest

import harness

CHILD = textwrap.dedent("""
    import json, sys, time
    from tidepool.mooncake import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", sys.argv[1])
    put = s.put("segment/probe", b"x" * (2 << 20))  # larger than the other store
    nodes = sorted({d.node for d in s.get_replica_desc("segment/probe")})
    print(json.dumps({"rc": rc, "put": put, "agent": s._agent.proc.pid, "nodes": nodes}), flush=True)
    time.sleep(600)  # until killed
""")


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


class PrivateAgentTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="tidepool-mc-agent-")
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)
        # No DRAM of its own to speak of: puts land on the agent's segment.
        cls.up = harness.Up(cls.dir, extra=["--dram", "1MiB", "--ssd", "0"])
        cls.addClassCleanup(cls.up.stop)

    def test_segment_and_lifeline(self):
        env = dict(os.environ, TIDEPOOL_BIN=harness.binary(), PYTHONPATH=harness.PYTHON_DIR,
                   TIDEPOOL_AGENT_SOCKET=os.path.join(self.dir, "none.sock"))
        p = subprocess.Popen([sys.executable, "-c", CHILD, self.up.grpc], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        self.addCleanup(p.stderr.close)
        self.addCleanup(p.stdout.close)
        self.addCleanup(p.kill)
        line = p.stdout.readline()
        if not line:
            self.fail("child: %s" % p.stderr.read())
        got = json.loads(line)
        self.assertEqual((got["rc"], got["put"]), (0, 0))
        # The value went to the store node the agent runs for the process.
        self.assertEqual(len(got["nodes"]), 1)
        self.assertIn("-agent-%d" % got["agent"], got["nodes"][0])
        self.assertTrue(alive(got["agent"]))
        # SIGKILL leaves no time to close(): the agent notices its standard
        # input's end and goes too.
        p.send_signal(signal.SIGKILL)
        p.wait()
        harness.poll(lambda: not alive(got["agent"]), what="the private agent to exit")


if __name__ == "__main__":
    unittest.main()
