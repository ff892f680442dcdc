"""A span allocator over a session's shared-memory region."""

import collections
import threading
import time

from . import errors

#: Spans start on this boundary (a cache line), so values never share one.
ALIGN = 64


def align(n):
    """n rounded up to ALIGN; at least ALIGN."""
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


class SessionRetired(errors.Error):
    """The region's session was retired while a call waited for room in it:
    the call starts again on the client's next session. Internal: a Client
    never lets it out."""


class SpanAllocator:
    """Allocation of ranges of [0, size), safe for concurrent use, served in
    the order asked.

    Each batch call takes one extent for all the values it stages and gives
    it back when the agent has answered, so a caller never holds one extent
    while waiting for another. Requests are served first come, first
    served: while one waits for room, later ones queue behind it even when
    they would fit, so a large request is not starved by a stream of small
    ones. Any request no larger than the region is served once the extents
    taken before it come back.
    """

    def __init__(self, size):
        if size <= 0:
            raise ValueError("region of %d bytes" % size)
        self.size = size
        self._cond = threading.Condition()
        self._free = [(0, size)]  # (offset, length), sorted, coalesced; guarded by _cond
        self._queue = collections.deque()  # tickets of the waiting allocs, first come first; guarded by _cond
        self._closed = None  # the error class that waiters raise once closed; guarded by _cond

    def _take(self, n):
        """The offset of a free extent of n bytes taken first-fit, or None."""
        for i, (off, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (off + n, length - n)
                return off
        return None

    def _check_open(self):
        if self._closed is not None:
            raise self._closed("client closed" if self._closed is errors.ClientClosed
                               else "the session was retired")

    def alloc(self, n, timeout=None):
        """Returns the offset of a free extent of align(n) bytes, waiting up
        to timeout seconds (None: for ever) for it, after every request
        that waited before. Raises ValueTooLarge when the region is smaller
        than n, RegionTimeout (a DeadlineExceeded) on timeout, and
        ClientClosed once closed."""
        n = align(n)
        if n > self.size:
            raise errors.ValueTooLarge(
                "%d bytes do not fit the session's shared-memory region of %d bytes; "
                "open the Client with a larger shm_bytes" % (n, self.size))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._check_open()
            if not self._queue:
                off = self._take(n)
                if off is not None:
                    return off
            ticket = object()
            self._queue.append(ticket)
            try:
                while True:
                    self._check_open()
                    if self._queue[0] is ticket:
                        off = self._take(n)
                        if off is not None:
                            return off
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise errors.RegionTimeout(
                            "no room for %d bytes in the shared-memory region of %d bytes after waiting "
                            "%gs (%d calls waiting); raise the Client's timeout or shm_bytes"
                            % (n, self.size, timeout, len(self._queue) - 1))
                    self._cond.wait(left)
            finally:
                self._queue.remove(ticket)
                # The next in line may fit now.
                self._cond.notify_all()

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

    def waiting(self):
        """How many allocs wait for room."""
        with self._cond:
            return len(self._queue)

    def close(self, error=errors.ClientClosed):
        """Wakes every waiter, and fails every later alloc, with error (a
        class: ClientClosed, or SessionRetired). Extents still out may be
        freed."""
        with self._cond:
            if self._closed is None:
                self._closed = error
            self._cond.notify_all()
