"""Benchmarks of tidepool.mooncake against memcpy, run by docs/benchmarks.sh.

Starts `tidepool up` and two agents (shared memory, and --no-shm: bytes
over TCP loopback) from $TIDEPOOL_BIN, then measures, one Python thread:
memcpy of 64 MiB between two buffers (ctypes.memmove, the baseline);
batch_get_into and batch_put_from of 64 x 1 MiB into and from
MooncakeHostMemAllocator memory and into and from another registered host
buffer; the same gets over TCP; batch_is_exist of 1024 keys. Prints one
JSON object per row.
"""

import ctypes
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import harness  # noqa: E402

from tidepool.mooncake import MooncakeDistributedStore, MooncakeHostMemAllocator  # noqa: E402

MiB = 1 << 20
N = 64
ROWS = []
DURATION = float(os.environ.get("BENCH_SECONDS", "3"))


def timed(fn, bytes_per_call=0, keys_per_call=0, cleanup=None):
    """Runs fn for DURATION seconds (cleanup, untimed, after each call)."""
    fn()
    if cleanup:
        cleanup()
    spent, calls = 0.0, 0
    while spent < DURATION:
        t = time.perf_counter()
        fn()
        spent += time.perf_counter() - t
        calls += 1
        if cleanup:
            cleanup()
    row = {"calls": calls, "seconds": round(spent, 3), "ms_per_call": round(spent / calls * 1e3, 3)}
    if bytes_per_call:
        row["GBps"] = round(bytes_per_call * calls / spent / 1e9, 3)
    if keys_per_call:
        row["Mkeys_per_s"] = round(keys_per_call * calls / spent / 1e6, 3)
    return row


def check(results, want):
    bad = [r for r in results if r != want]
    if bad:
        raise SystemExit("benchmark call failed after %d rows: %r" % (len(ROWS), bad[:4]))


def run(store, label, shared_ptr, host_ptr, rows):
    keys = ["bench/%s/%d" % (label, i) for i in range(N)]
    src = [shared_ptr + i * MiB for i in range(N)]
    dst = [shared_ptr + (N + i) * MiB for i in range(N)]
    hsrc = [host_ptr + i * MiB for i in range(N)]
    hdst = [host_ptr + (N + i) * MiB for i in range(N)]
    sizes = [MiB] * N
    check(store.batch_put_from(keys, src, sizes), 0)

    def put(ptrs):
        k = ["%s/p" % x for x in keys]
        return lambda: check(store.batch_put_from(k, ptrs, sizes), 0), lambda: store.batch_remove(k)

    rows.append(dict(op="batch_get_into", into="MooncakeHostMemAllocator", path=label,
                     **timed(lambda: check(store.batch_get_into(keys, dst, sizes), MiB), N * MiB)))
    rows.append(dict(op="batch_get_into", into="registered host buffer", path=label,
                     **timed(lambda: check(store.batch_get_into(keys, hdst, sizes), MiB), N * MiB)))
    if label == "shm":
        fn, clean = put(src)
        rows.append(dict(op="batch_put_from", into="MooncakeHostMemAllocator", path=label,
                         **timed(fn, N * MiB, cleanup=clean)))
        fn, clean = put(hsrc)
        rows.append(dict(op="batch_put_from", into="registered host buffer", path=label,
                         **timed(fn, N * MiB, cleanup=clean)))
        small = ["bench/exist/%04d" % i for i in range(1024)]
        for i in range(0, 1024, 256):
            check([store.put_batch(small[i:i + 256], [b"x"] * 256)], 0)
        rows.append(dict(op="batch_is_exist", keys=1024, path="master, direct",
                         **timed(lambda: check(store.batch_is_exist(small), 1), keys_per_call=1024)))
        store.batch_remove(small)
    store.batch_remove(keys)


def main():
    d = tempfile.mkdtemp(prefix="tidepool-bench-mc-")
    # A short lease: a new leader frees removed space only a lease TTL after
    # it took office, and the put rows remove what they put.
    up = harness.Up(d, extra=["--dram", "2GiB", "--ssd", "0", "--lease-ttl", "2s"])
    rows = ROWS
    try:
        a = MooncakeHostMemAllocator()
        shared = a.alloc(2 * N * MiB)
        host = ctypes.create_string_buffer(2 * N * MiB)
        host_ptr = ctypes.addressof(host)
        ctypes.memset(shared, 7, 2 * N * MiB)
        ctypes.memset(host_ptr, 9, 2 * N * MiB)
        rows.append(dict(op="memcpy", into="64 MiB between two buffers", path="ctypes.memmove",
                         **timed(lambda: ctypes.memmove(host_ptr + N * MiB, host_ptr, N * MiB), N * MiB)))
        for label, extra in (("shm", []), ("tcp", ["--no-shm"])):
            agent = harness.Agent(d, up.grpc, extra=extra)
            os.environ["TIDEPOOL_AGENT_SOCKET"] = agent.socket
            store = MooncakeDistributedStore()
            if store.setup("localhost", "P2PHANDSHAKE", 0, 256 * MiB, "tcp", "", up.grpc) != 0:
                raise SystemExit("setup failed")
            store.register_buffer(shared, 2 * N * MiB)
            store.register_buffer(host_ptr, 2 * N * MiB)
            try:
                run(store, label, shared, host_ptr, rows)
            finally:
                store.close()
                agent.stop()
    finally:
        up.stop()
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
