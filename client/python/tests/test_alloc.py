"""The span allocator over a session's region, without an agent."""

import random
import threading
import time
import unittest

import harness
import tidepool
from tidepool._alloc import ALIGN, SessionRetired, SpanAllocator, align


class AllocatorTest(unittest.TestCase):
    def test_first_fit_and_coalescing(self):
        a = SpanAllocator(10 * ALIGN)
        offs = [a.alloc(ALIGN) for _ in range(10)]
        self.assertEqual(offs, [i * ALIGN for i in range(10)])
        with self.assertRaises(tidepool.RegionTimeout) as cm:
            a.alloc(1, timeout=0.01)
        self.assertIsInstance(cm.exception, tidepool.DeadlineExceeded)
        for i in (1, 3, 2):  # frees merge with both neighbours
            a.free(offs[i], ALIGN)
        self.assertEqual(a.alloc(3 * ALIGN), ALIGN)
        for i in range(10):
            if i not in (1, 2, 3):
                a.free(offs[i], ALIGN)
        a.free(ALIGN, 3 * ALIGN)
        self.assertEqual(a.free_bytes(), 10 * ALIGN)
        self.assertEqual(a.alloc(10 * ALIGN), 0)

    def test_alignment(self):
        self.assertEqual(align(0), ALIGN)
        self.assertEqual(align(1), ALIGN)
        self.assertEqual(align(ALIGN + 1), 2 * ALIGN)
        a = SpanAllocator(1 << 20)
        for n in (1, 100, 3, 4097):
            self.assertEqual(a.alloc(n) % ALIGN, 0)

    def test_too_large_and_double_free(self):
        a = SpanAllocator(4 * ALIGN)
        with self.assertRaises(tidepool.ValueTooLarge):
            a.alloc(4 * ALIGN + 1)
        off = a.alloc(ALIGN)
        a.free(off, ALIGN)
        with self.assertRaises(ValueError):
            a.free(off, ALIGN)

    def test_waiters_get_room_when_freed(self):
        a = SpanAllocator(4 * ALIGN)
        off = a.alloc(4 * ALIGN)
        got = []
        t = threading.Thread(target=lambda: got.append(a.alloc(2 * ALIGN, timeout=30)))
        t.start()
        a.free(off, 4 * ALIGN)
        t.join(30)
        self.assertEqual(got, [0])

    def test_close_wakes_waiters(self):
        a = SpanAllocator(ALIGN)
        a.alloc(ALIGN)
        errs = []

        def wait():
            try:
                a.alloc(ALIGN)
            except tidepool.ClientClosed as e:
                errs.append(e)

        t = threading.Thread(target=wait)
        t.start()
        a.close()
        t.join(30)
        self.assertEqual(len(errs), 1)

    def test_close_for_a_retired_session(self):
        a = SpanAllocator(ALIGN)
        a.alloc(ALIGN)
        errs = []

        def wait():
            try:
                a.alloc(ALIGN, timeout=30)
            except SessionRetired as e:
                errs.append(e)

        t = threading.Thread(target=wait)
        t.start()
        harness.poll(lambda: a.waiting() == 1, what="a waiter")
        a.close(SessionRetired)
        t.join(30)
        self.assertEqual(len(errs), 1)
        with self.assertRaises(SessionRetired):
            a.alloc(1)

    def test_waiters_are_served_in_order(self):
        a = SpanAllocator(4 * ALIGN)
        offs = [a.alloc(ALIGN) for _ in range(4)]
        served = []

        def want(n, name):
            off = a.alloc(n, timeout=30)
            served.append(name)
            time.sleep(0.01)
            a.free(off, n)

        big = threading.Thread(target=want, args=(4 * ALIGN, "big"))
        big.start()
        harness.poll(lambda: a.waiting() == 1, what="the big request waiting")
        small = threading.Thread(target=want, args=(ALIGN, "small"))
        small.start()
        harness.poll(lambda: a.waiting() == 2, what="the small request waiting")
        # Room for the small request, but the big one came first: it waits.
        a.free(offs[0], ALIGN)
        time.sleep(0.02)
        self.assertEqual(served, [])
        for off in offs[1:]:
            a.free(off, ALIGN)
        big.join(30)
        small.join(30)
        self.assertEqual(served, ["big", "small"])
        self.assertEqual(a.free_bytes(), 4 * ALIGN)

    def test_a_timed_out_waiter_leaves_the_queue(self):
        a = SpanAllocator(4 * ALIGN)
        off = a.alloc(2 * ALIGN)
        with self.assertRaises(tidepool.RegionTimeout):
            a.alloc(4 * ALIGN, timeout=0.02)
        self.assertEqual(a.waiting(), 0)
        self.assertEqual(a.alloc(2 * ALIGN, timeout=0), 2 * ALIGN)  # not behind the one that gave up
        a.free(off, 2 * ALIGN)

    def test_a_whole_region_request_is_served_under_small_traffic(self):
        # First fit without a queue starved it: while small extents were
        # taken and given back with overlapping lifetimes, the region was
        # never free at once.
        KiB = 1024
        a = SpanAllocator(1024 * KiB)
        stop = threading.Event()

        def small():
            while not stop.is_set():
                off = a.alloc(300 * KiB, timeout=5)
                time.sleep(0.002)  # a small get's round trip
                a.free(off, 300 * KiB)

        threads = [threading.Thread(target=small) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.05)
            for _ in range(3):
                off = a.alloc(1024 * KiB, timeout=3)
                a.free(off, 1024 * KiB)
        finally:
            stop.set()
            for t in threads:
                t.join()
        self.assertEqual(a.free_bytes(), 1024 * KiB)

    def test_concurrent_use_never_overlaps(self):
        size = 64 * ALIGN
        a = SpanAllocator(size)
        owner = [None] * (size // ALIGN)
        lock = threading.Lock()
        failures = []

        def worker(seed):
            rng = random.Random(seed)
            for _ in range(300):
                n = rng.randrange(1, 16) * ALIGN
                off = a.alloc(n, timeout=30)
                with lock:
                    for i in range(off // ALIGN, (off + n) // ALIGN):
                        if owner[i] is not None:
                            failures.append((off, n))
                        owner[i] = seed
                with lock:
                    for i in range(off // ALIGN, (off + n) // ALIGN):
                        owner[i] = None
                a.free(off, n)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.assertEqual(failures, [])
        self.assertEqual(a.free_bytes(), size)


class ErrorsTest(unittest.TestCase):
    def test_codes(self):
        import grpc
        from tidepool import errors
        self.assertIsInstance(errors.from_code(5, "x"), tidepool.NotFound)
        self.assertIsInstance(errors.from_code(grpc.StatusCode.UNAVAILABLE), tidepool.Unavailable)
        self.assertIsInstance(errors.from_code(11), tidepool.OutOfRange)
        self.assertIsInstance(errors.from_code(99, "?"), tidepool.Unknown)
        e = errors.from_code(3, "bad key")
        self.assertEqual(e.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(e.message, "bad key")
        self.assertTrue(issubclass(tidepool.ValueTooLarge, tidepool.InvalidArgument))
        self.assertTrue(issubclass(tidepool.RegionTimeout, tidepool.DeadlineExceeded))


if __name__ == "__main__":
    unittest.main()
