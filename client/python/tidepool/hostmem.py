"""Host memory this process shares with the agent.

An allocation is a memfd of this process, sealed against resizing and
mapped here; a Client attaches it to its session on first use (the agent
maps it too), so gets land in it and puts leave from it with no copy on
this side. ``tidepool.mooncake.MooncakeHostMemAllocator`` hands these out;
any backend finds them with :data:`HOST`.
"""

import bisect
import ctypes
import fcntl
import mmap
import os
import threading
import weakref

from .client import Attachment

_PAGE = mmap.PAGESIZE


class _Allocation:
    """One MooncakeHostMemAllocator allocation: a sealed memfd mapped here."""

    def __init__(self, size):
        self.size = (size + _PAGE - 1) // _PAGE * _PAGE
        self.fd = os.memfd_create("tidepool-host", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            # Neither side can resize it under the other's mapping.
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self.mm = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self.mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.att = Attachment(self.fd, self.size)

    def close(self):
        self.att.closed = True
        try:
            self.mm.close()
        except BufferError:  # a view of it is still alive: the mapping goes with it
            pass
        os.close(self.fd)


class _HostMemory:
    """The process's allocations, by address; and the users (objects with a
    _forget(Attachment) method) that may have attached them, told when one
    is freed."""

    def __init__(self):
        self._lock = threading.Lock()
        self._starts = []  # sorted addresses; guarded by _lock
        self._by_start = {}  # address -> _Allocation; guarded by _lock
        self.users = weakref.WeakSet()

    def alloc(self, size):
        a = _Allocation(size)
        with self._lock:
            bisect.insort(self._starts, a.addr)
            self._by_start[a.addr] = a
        return a

    def free(self, addr):
        with self._lock:
            a = self._by_start.pop(addr, None)
            if a is not None:
                self._starts.remove(addr)
        if a is None:
            return False
        try:
            for user in list(self.users):
                user._forget(a.att)
        finally:
            a.close()
        return True

    def find(self, addr, n):
        """The allocation holding [addr, addr+n), or None."""
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i < 0:
                return None
            a = self._by_start[self._starts[i]]
        return a if addr + n <= a.addr + a.size else None


#: The allocations of this process: allocators are made anywhere (SGLang
#: makes one per host pool), and whoever moves bytes finds them here.
HOST = _HostMemory()


