"""The committed stubs are what `make proto-python` makes of proto/."""

import filecmp
import os
import shutil
import subprocess
import tempfile
import unittest

import harness

STUBS = os.path.join(harness.PYTHON_DIR, "tidepool", "_proto")


@unittest.skipUnless(shutil.which("protoc") and shutil.which("grpc_python_plugin") and shutil.which("make"),
                     "needs protoc and grpc_python_plugin (protobuf-compiler, protobuf-compiler-grpc)")
class StubsTest(unittest.TestCase):
    def test_stubs_are_current(self):
        with tempfile.TemporaryDirectory() as d:
            subprocess.run(["make", "-s", "proto-python", "PY_PROTO_DIR=" + d], cwd=harness.REPO, check=True,
                           stdout=subprocess.DEVNULL)
            made = sorted(f for f in os.listdir(d) if f.endswith(".py"))
            committed = sorted(f for f in os.listdir(STUBS) if f.endswith("_pb2.py") or f.endswith("_pb2_grpc.py"))
            self.assertEqual(made, committed)
            _, mismatch, errors = filecmp.cmpfiles(d, STUBS, made, shallow=False)
            self.assertEqual(mismatch + errors, [], "stale stubs: run `make proto-python`")


class ImportTest(unittest.TestCase):
    def test_stubs_import_as_a_package(self):
        from tidepool._proto import agent_pb2, agent_pb2_grpc, tidepool_pb2
        self.assertEqual(agent_pb2.DESCRIPTOR.dependencies[0].name, "tidepool.proto")
        self.assertIs(agent_pb2.tidepool__pb2, tidepool_pb2)
        self.assertTrue(hasattr(agent_pb2_grpc, "AgentStub"))


if __name__ == "__main__":
    unittest.main()
