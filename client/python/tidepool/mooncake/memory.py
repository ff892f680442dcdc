"""Memory the store reads from and writes to: host memory shared with the
agent (MooncakeHostMemAllocator, from tidepool.hostmem), other host memory,
and GPU memory.

MooncakeHostMemAllocator hands out memfds of this process, mapped here and,
once a store uses them, by the agent too: gets land there and puts leave
from there with no copy on this side. Memory registered with
register_buffer that is not from the allocator is host memory the agent
cannot see (one memmove through the session's region, GIL released) or,
where the CUDA runtime is loaded, GPU memory (one cudaMemcpy through the
region).
"""

import bisect
import ctypes
import ctypes.util
import logging
import threading

from ..hostmem import HOST

logger = logging.getLogger("tidepool.mooncake")

class MooncakeHostMemAllocator:
    """Host memory the agent shares, Mooncake's allocator for host KV pools:
    ``alloc(size)`` returns the address of size bytes (0 on failure),
    ``free(ptr)`` returns 0 (-600 for an address alloc did not return).
    Gets into it and puts from it move no bytes on this side."""

    def alloc(self, size, /):
        try:
            if int(size) <= 0:
                return 0
            return HOST.alloc(int(size)).addr
        except (OSError, ValueError, TypeError, OverflowError) as e:
            logger.warning("MooncakeHostMemAllocator.alloc(%r) failed: %s", size, e)
            return 0

    def free(self, ptr, /):
        try:
            return 0 if HOST.free(int(ptr)) else -600
        except (TypeError, ValueError):
            return -600


# Kinds of registered memory.
HOST_KIND, READ_ONLY_KIND, CUDA_KIND = "host", "read-only", "cuda"


def mapped(addr, n, writable):
    """Whether [addr, addr+n) is mapped readable (and writable) in this
    process: registered memory is checked so that a bad pointer is an error
    code, never a crash."""
    end = addr + n
    want = addr
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                span, perms = line.split(None, 2)[:2]
                lo, hi = (int(x, 16) for x in span.split("-"))
                if hi <= want or lo > want:
                    continue
                if perms[0] != "r" or (writable and perms[1] != "w"):
                    return False
                want = hi
                if want >= end:
                    return True
    except OSError:
        return False
    return False


class _Cuda:
    """The CUDA runtime, when one loads: pointer kinds and copies."""

    # cudaPointerAttributes (CUDA 10+): type, device, devicePointer, hostPointer.
    class _Attrs(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                    ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p)]

    _DEVICE, _MANAGED = 2, 3
    _DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers

    def __init__(self):
        self.lib = None
        self.why = None
        names = [ctypes.util.find_library("cudart"), "libcudart.so", "libcudart.so.12", "libcudart.so.11.0"]
        for name in names:
            if not name:
                continue
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError as e:
                self.why = str(e)
        if self.lib is None:
            self.why = "no CUDA runtime (libcudart) could be loaded" + (": %s" % self.why if self.why else "")
            return
        self.lib.cudaPointerGetAttributes.argtypes = [ctypes.POINTER(self._Attrs), ctypes.c_void_p]
        self.lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def is_device(self, addr):
        if self.lib is None:
            return False
        a = self._Attrs()
        if self.lib.cudaPointerGetAttributes(ctypes.byref(a), ctypes.c_void_p(addr)) != 0:
            return False
        return a.type in (self._DEVICE, self._MANAGED)

    def copy(self, dst, src, n):
        """cudaMemcpy(dst, src, n): ctypes releases the GIL meanwhile."""
        rc = self.lib.cudaMemcpy(dst, src, n, self._DEFAULT)
        if rc != 0:
            raise OSError("cudaMemcpy of %d bytes failed: CUDA error %d" % (n, rc))


_cuda = None
_cuda_lock = threading.Lock()


def cuda():
    global _cuda
    with _cuda_lock:
        if _cuda is None:
            _cuda = _Cuda()
        return _cuda


class Registry:
    """A store's registered ranges, by address. Ranges never overlap."""

    def __init__(self):
        self._lock = threading.Lock()
        self._starts = []  # guarded by _lock
        self._ranges = {}  # start -> (size, kind); guarded by _lock

    def add(self, addr, size, kind):
        """False when [addr, addr+size) overlaps a registered range."""
        with self._lock:
            i = bisect.bisect_right(self._starts, addr)
            if i > 0:
                prev = self._starts[i - 1]
                if prev + self._ranges[prev][0] > addr:
                    return False
            if i < len(self._starts) and self._starts[i] < addr + size:
                return False
            self._starts.insert(i, addr)
            self._ranges[addr] = (size, kind)
            return True

    def remove(self, addr):
        with self._lock:
            if self._ranges.pop(addr, None) is None:
                return False
            self._starts.remove(addr)
            return True

    def kind(self, addr, n):
        """The kind of the registered range holding [addr, addr+n), or
        None."""
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i < 0:
                return None
            start = self._starts[i]
            size, kind = self._ranges[start]
        return kind if addr + n <= start + size else None

    def clear(self):
        with self._lock:
            self._starts, self._ranges = [], {}
