"""An agent of a secure pool (`tidepool up --secure`): it asks every
process for its token, which the SDK sends from token_file or
$TIDEPOOL_TOKEN_FILE, and carries every call itself."""

import os
import shutil
import tempfile
import unittest
from unittest import mock

import torch

import harness
import tidepool


@unittest.skipUnless(harness.have_go(), "needs go to build the tidepool binary")
class SecureAgentTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="tidepool-secure-")
        cls.up = harness.Up(cls.dir, extra=["--secure"])
        certs = os.path.join(cls.dir, "up", "certs")
        cls.token = os.path.join(certs, "client.token")
        cls.admin_token = os.path.join(certs, "admin.token")
        # The harness's readiness check opens a Client: it reads the env.
        with mock.patch.dict(os.environ, {"TIDEPOOL_TOKEN_FILE": cls.token}):
            cls.agent = harness.Agent(cls.dir, cls.up.grpc, extra=[
                "--tls-ca", os.path.join(certs, "ca.crt"), "--token-file", cls.token, "--no-shm"])

    @classmethod
    def tearDownClass(cls):
        cls.agent.stop()
        cls.up.stop()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def test_token_file_tensor_round_trip(self):
        t = torch.arange(4096, dtype=torch.float16)
        with tidepool.Client(self.agent.socket, shm_bytes=1 << 20, token_file=self.token) as c:
            self.assertEqual(c.batch_set(["secure/t"], [t]), [True])
            out = torch.empty_like(t)
            self.assertEqual(c.batch_get_into(["secure/t"], [out]), [t.numel() * t.element_size()])
            self.assertTrue(torch.equal(out, t))
            self.assertTrue(c.exists("secure/t"))

    def test_env_token(self):
        with mock.patch.dict(os.environ, {"TIDEPOOL_TOKEN_FILE": self.token}):
            with tidepool.Client(self.agent.socket, shm_bytes=1 << 20) as c:
                c.set("secure/env", b"from the env's token")
                self.assertEqual(c.get("secure/env"), b"from the env's token")

    def test_without_or_with_another_token_refused(self):
        env = {k: v for k, v in os.environ.items() if k != "TIDEPOOL_TOKEN_FILE"}
        with mock.patch.dict(os.environ, env, clear=True):
            for token_file in (None, self.admin_token):
                with self.subTest(token_file=token_file):
                    with self.assertRaises(tidepool.Unauthenticated):
                        with tidepool.Client(self.agent.socket, shm_bytes=1 << 20, token_file=token_file) as c:
                            c.exists("secure/t")

    def test_unreadable_token_file(self):
        missing = os.path.join(self.dir, "no-such.token")
        with self.assertRaises(tidepool.InvalidArgument) as cm:
            tidepool.Client(self.agent.socket, token_file=missing)
        self.assertIn("no-such.token", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
