"""tidepool.mooncake's view of memory, without a cluster: what
register_buffer takes, and GPU memory through a stand-in CUDA runtime."""

import ctypes
import mmap
import unittest

import harness  # noqa: F401 - puts the SDK on sys.path

from tidepool.mooncake import MooncakeDistributedStore, memory
from tidepool.mooncake import store as mstore


class _SetUp:
    """Enough of a Client for register_buffer: the store is "set up"."""

    def close(self):
        pass

    def detach(self, att):
        pass


class _FakeCuda:
    """A CUDA runtime whose "device memory" is one host range, copied with
    memmove: the store's GPU path, on a host without a GPU."""

    def __init__(self, lo, n):
        self.lib, self.why, self.lo, self.n = object(), None, lo, n
        self.copies = 0

    def is_device(self, addr):
        return self.lo <= addr < self.lo + self.n

    def copy(self, dst, src, n):
        self.copies += 1
        ctypes.memmove(dst, src, n)


class RegisterTest(unittest.TestCase):
    def setUp(self):
        self.s = MooncakeDistributedStore()
        self.s._client = _SetUp()
        self.addCleanup(setattr, self.s, "_client", None)

    def test_host_memory(self):
        buf = ctypes.create_string_buffer(1 << 16)
        p = ctypes.addressof(buf)
        self.assertEqual(self.s.register_buffer(p, 1 << 16), 0)
        self.assertEqual(self.s._where(p + 10, 100), [(p + 10, 100, ctypes.memmove)])
        self.assertIsNone(self.s._where(p + (1 << 16) - 10, 100))  # runs past the end
        self.assertEqual(self.s.unregister_buffer(p), 0)
        self.assertIsNone(self.s._where(p, 100))

    def test_not_memory_without_cuda(self):
        # A reserved, inaccessible range is what a GPU pointer looks like to
        # the host; without a CUDA runtime it is refused, never touched.
        p = _prot_none_address(1 << 16)
        no_cuda = memory._Cuda.__new__(memory._Cuda)
        no_cuda.lib, no_cuda.why = None, "no CUDA runtime (libcudart) could be loaded"
        old = memory._cuda
        memory._cuda = no_cuda
        self.addCleanup(setattr, memory, "_cuda", old)
        with self.assertLogs("tidepool.mooncake", "ERROR") as logs:
            self.assertEqual(self.s.register_buffer(p, 1 << 16), -600)
        self.assertIn("libcudart", "\n".join(logs.output))
        self.assertEqual(self.s.register_buffer(0, 10), -600)
        self.assertEqual(self.s.register_buffer(12345, 0), -600)

    def test_gpu_memory_is_copied_with_cuda(self):
        p = _prot_none_address(1 << 16)
        fake = _FakeCuda(p, 1 << 16)
        old = memory._cuda
        memory._cuda = fake
        self.addCleanup(setattr, memory, "_cuda", old)
        self.assertEqual(self.s.register_buffer(p, 1 << 16), 0)
        where = self.s._where(p + 64, 128)
        self.assertEqual(where, [(p + 64, 128, fake.copy)])
        # Overlapping GPU registrations are refused like host ones.
        self.assertEqual(self.s.register_buffer(p + 100, 10), -600)

    def test_setup_keywords_of_the_config_files(self):
        # master_server_address / device_name, the JSON files' spellings.
        s = MooncakeDistributedStore()
        calls = []
        s._setup = lambda *a, **kw: calls.append(a) or 0
        self.assertEqual(s.setup("h", "P2PHANDSHAKE", 0, 1 << 20, "tcp", device_name="mlx5_0",
                                 master_server_address="127.0.0.1:1"), 0)
        self.assertEqual(calls[0][5:7], ("mlx5_0", "127.0.0.1:1"))
        with self.assertRaises(TypeError):
            s.setup("h", "P2PHANDSHAKE", 0, 1 << 20, "tcp")  # no masters, no device: Python's contract


_keep = []


def _prot_none_address(n):
    """The address of n reserved, inaccessible bytes (as CUDA reserves its
    device address space)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    prot_none = 0
    p = libc.mmap(None, n, prot_none, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert p not in (None, ctypes.c_void_p(-1).value)
    _keep.append(p)
    return p


if __name__ == "__main__":
    unittest.main()
