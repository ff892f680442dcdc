"""A span allocator over a session's shared-memory region."""

import threading
import time

from . import errors

#: Spans start on this boundary (a cache line), so values never share one.
ALIGN = 64


def align(n):
    """n rounded up to ALIGN; at least ALIGN."""
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


class SpanAllocator:
    """First-fit allocation of ranges of [0, size), safe for concurrent use.

    Each batch call takes one extent for all the values it stages and frees
    it when the call returns, so a caller never holds one extent while
    waiting for another: alloc waits for room (frees coalesce), and any
    request no larger than the region is eventually served.
    """

    def __init__(self, size):
        if size <= 0:
            raise ValueError("region of %d bytes" % size)
        self.size = size
        self._cond = threading.Condition()
        self._free = [(0, size)]  # (offset, length), sorted, coalesced; guarded by _cond
        self._closed = False  # guarded by _cond

    def alloc(self, n, timeout=None):
        """Returns the offset of a free extent of align(n) bytes, waiting up
        to timeout seconds (None: for ever) for one. Raises ValueTooLarge
        when the region is smaller than n, ResourceExhausted on timeout and
        ClientClosed once closed."""
        n = align(n)
        if n > self.size:
            raise errors.ValueTooLarge(
                "%d bytes do not fit the session's shared-memory region of %d bytes; "
                "open the Client with a larger shm_bytes" % (n, self.size))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise errors.ClientClosed("client closed")
                for i, (off, length) in enumerate(self._free):
                    if length >= n:
                        if length == n:
                            del self._free[i]
                        else:
                            self._free[i] = (off + n, length - n)
                        return off
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise errors.ResourceExhausted(
                        "no room for %d bytes in the shared-memory region of %d bytes after %.1fs"
                        % (n, self.size, timeout))
                self._cond.wait(left)

    def free(self, off, n):
        """Returns the extent alloc(n) gave at off."""
        n = align(n)
        with self._cond:
            free = self._free
            lo, hi = 0, len(free)
            while lo < hi:  # the first free range after off
                mid = (lo + hi) // 2
                if free[mid][0] < off:
                    lo = mid + 1
                else:
                    hi = mid
            i = lo
            if i > 0 and free[i - 1][0] + free[i - 1][1] > off or i < len(free) and off + n > free[i][0]:
                raise ValueError("free of [%d, %d) overlaps free space" % (off, off + n))
            start, end = off, off + n
            if i < len(free) and free[i][0] == end:  # merge with the next
                end += free[i][1]
                del free[i]
            if i > 0 and free[i - 1][0] + free[i - 1][1] == start:  # and the previous
                start = free[i - 1][0]
                i -= 1
                del free[i]
            free.insert(i, (start, end - start))
            self._cond.notify_all()

    def free_bytes(self):
        with self._cond:
            return sum(length for _, length in self._free)

    def close(self):
        """Wakes every waiter with ClientClosed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
