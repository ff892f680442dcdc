"""Second review: the direct line to the master (_Masters).

Run from this directory:
TIDEPOOL_BIN=/tmp/tp /usr/bin/python3 -m unittest test_review2 -v
"""

import concurrent.futures
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grpc  # noqa: E402

import harness  # noqa: E402,F401  (sets sys.path)
from tidepool import client as tpclient  # noqa: E402
from tidepool._proto import tidepool_pb2  # noqa: E402


class _Leader(grpc.GenericRpcHandler):
    """A master leader that answers every Exists key present."""

    def service(self, details):
        if not details.method.endswith("/Exists"):
            return None

        def exists(req, ctx):
            return tidepool_pb2.ExistsResponse(exists=[True] * len(req.keys))
        return grpc.unary_unary_rpc_method_handler(
            exists, request_deserializer=tidepool_pb2.KeysRequest.FromString,
            response_serializer=tidepool_pb2.ExistsResponse.SerializeToString)


class DirectLineTest(unittest.TestCase):
    def leader(self):
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(4), handlers=[_Leader()])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self.addCleanup(server.stop, None)
        return "127.0.0.1:%d" % port

    def test_exists_racing_a_switch_falls_back_instead_of_raising(self):
        # exists() takes the stub under the lock and calls it after letting
        # go. Another thread may switch meanwhile (set() with the masters a
        # reopened session announced, or exists() moving on after a failed
        # call) and close that channel. gRPC then raises ValueError
        # ("Cannot invoke RPC on closed channel!"), not an RpcError: it
        # escapes exists(), present() raises it, and the Mooncake layer's
        # _guard turns it into -600 (INVALID_PARAMS) for is_exist and
        # batch_is_exist. Expected: None (ask the agent).
        a, b = self.leader(), self.leader()
        m = tpclient._Masters()
        self.addCleanup(m.close)
        m.set([a])
        harness.poll(lambda: m.exists(["k"]) is not None, timeout=10, what="the direct line ready")

        real = m._stub

        class Racing:
            """The stub as exists() saw it, with another thread's set()
            landing between the lock's release and the call."""

            class _Exists:
                def __call__(self, *args, **kwargs):
                    m.set([b])  # closes the channel of `real`
                    return real.Exists(*args, **kwargs)
            Exists = _Exists()

        with m._lock:
            m._stub = Racing()
        try:
            got = m.exists(["k"])
        except ValueError as e:
            self.fail("exists() raised %r across a concurrent switch; want None (fall back to the agent)" % e)
        self.assertIn(got, (None, [True]))


if __name__ == "__main__":
    unittest.main()
