"""The span allocator over a session's region, without an agent."""

import random
import threading
import unittest

import harness  # noqa: F401 - puts client/python on sys.path
import tidepool
from tidepool._alloc import ALIGN, SpanAllocator, align


class AllocatorTest(unittest.TestCase):
    def test_first_fit_and_coalescing(self):
        a = SpanAllocator(10 * ALIGN)
        offs = [a.alloc(ALIGN) for _ in range(10)]
        self.assertEqual(offs, [i * ALIGN for i in range(10)])
        with self.assertRaises(tidepool.ResourceExhausted):
            a.alloc(1, timeout=0.01)
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


if __name__ == "__main__":
    unittest.main()
