"""Review tests: failures found reading the Mooncake layer, the SGLang
backend, hostmem and the client's attached memory, each shown against a
real `tidepool up` and `tidepool agent`.

Run from this directory:
TIDEPOOL_BIN=/tmp/tp /usr/bin/python3 -m unittest test_review -v
"""

import ctypes
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import unittest
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grpc  # noqa: E402

import harness  # noqa: E402
from test_client import ClusterTest  # noqa: E402
import tidepool  # noqa: E402
from tidepool._proto import agent_pb2, agent_pb2_grpc  # noqa: E402
from tidepool.hostmem import HOST  # noqa: E402
from tidepool.mooncake import MooncakeHostMemAllocator  # noqa: E402
from tidepool.sglang import HiCacheStorage  # noqa: E402

MiB = 1 << 20

# The layers log the failures these tests provoke.
for _name in ("tidepool.sglang", "tidepool.mooncake"):
    logging.getLogger(_name).addHandler(logging.NullHandler())
    logging.getLogger(_name).propagate = False


def run_script(body, fork_support=False, **subs):
    """Runs body, a script %-formatted with subs (harness.run_script)."""
    return harness.run_script(textwrap.dedent(body) % subs, fork_support)


class Gate:
    """A TCP proxy to target that can hold what its clients send: while
    closed it keeps reading (and records what arrives) but forwards
    nothing, so a request of the agent's to the master hangs until
    opened."""

    def __init__(self, target):
        self.target = target
        self.ln = socket.socket()
        self.ln.bind(("127.0.0.1", 0))
        self.ln.listen(16)
        self.addr = "127.0.0.1:%d" % self.ln.getsockname()[1]
        self.cond = threading.Condition()
        self.closed = False
        self.held = b""
        self.socks = []
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.ln.accept()
            except OSError:
                return
            host, port = self.target.rsplit(":", 1)
            up = socket.create_connection((host, int(port)))
            self.socks += [c, up]
            threading.Thread(target=self._copy, args=(up, c), daemon=True).start()
            self._forward(up, c)

    def _copy(self, src, dst):
        try:
            while True:
                b = src.recv(65536)
                if not b:
                    break
                dst.sendall(b)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _forward(self, dst, src):
        """src -> dst through the gate: a reader that never stops, a writer
        that waits while closed."""
        pending = []
        eof = [False]

        def reader():
            try:
                while True:
                    b = src.recv(65536)
                    with self.cond:
                        if self.closed:
                            self.held += b
                        pending.append(b)
                        eof[0] = not b
                        self.cond.notify_all()
                    if not b:
                        return
            except OSError:
                with self.cond:
                    eof[0] = True
                    self.cond.notify_all()

        def writer():
            while True:
                with self.cond:
                    while not eof[0] and (self.closed or not pending):
                        self.cond.wait()
                    out, done = b"".join(pending), eof[0]
                    pending.clear()
                try:
                    if out:
                        dst.sendall(out)
                except OSError:
                    return
                if done:
                    return

        threading.Thread(target=reader, daemon=True).start()
        threading.Thread(target=writer, daemon=True).start()

    def close(self):
        with self.cond:
            self.closed, self.held = True, b""

    def open(self):
        with self.cond:
            self.closed = False
            self.cond.notify_all()

    def wait_held(self, marker, timeout=30.0):
        deadline = time.monotonic() + timeout
        with self.cond:
            while marker not in self.held:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError("no request holding %r reached the gate" % marker)
                self.cond.wait(left)

    def stop(self):
        self.open()
        self.ln.close()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


@unittest.skipUnless(harness.have_go(), "needs go (or $TIDEPOOL_BIN) to build tidepool")
class ReviewTest(ClusterTest):
    def setUp(self):
        self.prefix = "review/%s/%s/" % (self.id().rsplit(".", 1)[-1], uuid.uuid4().hex[:8])

    def script(self, body, fork_support=False, **subs):
        subs.update(socket=self.agent.socket, masters=self.up.grpc, prefix=self.prefix, bin=harness.binary(),
                    dir=self.dir)
        return run_script(body, fork_support, **subs)

    # -- a forked child's attached memory --------------------------------

    def test_forked_child_get_into_lands_in_its_own_memory(self):
        # An Attachment's path is /proc/<pid>/fd/N with the pid of the
        # process that allocated it. A forked child that reads into its
        # (inherited) allocation makes the agent open the parent's fd N: once
        # the parent freed that allocation and made another (fd N reused),
        # the child's value lands in the parent's new memory, the child's
        # stays as it was, and the get answers success.
        p = self.script("""
            import ctypes
            os.environ["TIDEPOOL_AGENT_SOCKET"] = %(socket)r
            from tidepool.mooncake import MooncakeDistributedStore, MooncakeHostMemAllocator
            from tidepool.hostmem import HOST
            s = MooncakeDistributedStore()
            assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", %(masters)r) == 0
            S = 1 << 16
            key = %(prefix)r + "v"
            V = bytes(range(256)) * (S // 256)
            assert s.put(key, V) == 0
            alloc = MooncakeHostMemAllocator()
            A = alloc.alloc(S)
            a_fd = HOST.find(A, S).fd
            go_r, go_w = os.pipe()
            res_r, res_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.read(go_r, 1)
                n = s.get_into(key, A, S)
                os.write(res_w, ("%%d %%s" %% (n, ctypes.string_at(A, S) == V)).encode())
                os._exit(0)
            alloc.free(A)
            B = alloc.alloc(S)
            b_fd = HOST.find(B, S).fd
            ctypes.memset(B, 0xab, S)
            os.write(go_w, b"x")
            child = os.read(res_r, 100).decode()
            os.waitpid(pid, 0)
            print("fd reused:", a_fd == b_fd)
            print("child:", child)
            print("parent's new memory intact:", ctypes.string_at(B, S) == b"\\xab" * S)
            s.close()
        """, fork_support=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        lines = p.stdout.splitlines()
        if lines[0] != "fd reused: True":
            self.skipTest("the allocator's fd was not reused: %r" % lines)
        self.assertEqual(lines[1:], ["child: %d True" % (1 << 16), "parent's new memory intact: True"],
                         "the child's get went into the parent's memory\n" + p.stderr[-3000:])

    def test_forked_child_close_leaves_the_parents_agent(self):
        # setup started a private agent; a forked child's close() (or its
        # store's __del__) runs Agent.stop(): it cannot wait for a process
        # that is not its child, and removes the parent's socket directory,
        # so the parent can never open a session again (after an idle
        # timeout, a retired session, ...). The child then exits through
        # interpreter shutdown: destroying the gRPC channels it inherited
        # hung it (1 run in 5 on loaded cores).
        p = self.script("""
            os.environ["TIDEPOOL_AGENT_SOCKET"] = os.path.join(%(dir)r, "no-agent-%%d.sock" %% os.getpid())
            os.environ["TIDEPOOL_BIN"] = %(bin)r
            import gc
            import tidepool
            from tidepool.mooncake import MooncakeDistributedStore
            s = MooncakeDistributedStore()
            assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", %(masters)r) == 0
            sock = s._agent.socket
            pid = os.fork()
            if pid == 0:
                s.close()
                del s
                gc.collect()
                sys.exit(0)
            os.waitpid(pid, 0)
            print("socket:", os.path.exists(sock))
            try:
                # wait: a connect may meet EPIPE once, rarely, just after
                # the child exited (about 1 run in 10 under load).
                tidepool.Client(sock, shm_bytes=1 << 20, wait=5).close()
                print("new session: ok")
            except tidepool.Error as e:
                print("new session:", type(e).__name__, e)
            s.close()
        """)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.splitlines(), ["socket: True", "new session: ok"], p.stderr[-3000:])

    def test_private_agent_exits_with_its_process_despite_a_forked_child(self):
        # The private agent's lifeline is a pipe on its stdin; a forked
        # child (a multiprocessing worker, a DataLoader) inherits the write
        # end, so when the process that ran setup dies the agent lives on,
        # with its segment in the pool, for as long as any child does.
        r, w = os.pipe()
        self.addCleanup(os.close, w)
        p = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
            import faulthandler, os, sys, time
            faulthandler.dump_traceback_later(60, exit=True)
            sys.path.insert(0, %(path)r)
            os.environ["TIDEPOOL_AGENT_SOCKET"] = os.path.join(%(dir)r, "no-agent-%%d.sock" %% os.getpid())
            os.environ["TIDEPOOL_BIN"] = %(bin)r
            from tidepool.mooncake import MooncakeDistributedStore
            s = MooncakeDistributedStore()
            assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", %(masters)r) == 0
            if os.fork() == 0:  # a worker that outlives its parent, blocked on the test's pipe
                os.read(%(r)d, 1)
                os._exit(0)
            print(s._agent.proc.pid, flush=True)
            os._exit(1)  # the engine's process dies without close()
        """) % {"path": harness.PYTHON_DIR, "dir": self.dir, "bin": harness.binary(), "masters": self.up.grpc,
                "r": r}], env=harness.fork_env(False), stdout=subprocess.PIPE, text=True, pass_fds=(r,))
        os.close(r)
        agent_pid = int(p.stdout.readline())
        p.wait(30)
        self.addCleanup(lambda: os.write(w, b"x"))  # let the worker go

        def gone():
            try:
                with open("/proc/%d/status" % agent_pid) as f:
                    return "\nState:\tZ" in f.read()  # exited, not reaped by a pid 1 that does not reap
            except FileNotFoundError:
                return True

        try:
            harness.poll(gone, timeout=10, what="the private agent to exit with the process that started it")
        finally:
            if not gone():
                os.kill(agent_pid, 9)

    # -- registered memory the layer writes with memmove -----------------

    def test_get_into_read_only_registered_memory_is_an_error(self):
        # register_buffer accepts a read-only mapping (it checks readable
        # only), and _where ignores its write flag: get_into memmoves into
        # it and the process dies of SIGSEGV. docs/engines.md promises "a
        # bad pointer is an error code, never a crash".
        p = self.script("""
            import ctypes, mmap
            os.environ["TIDEPOOL_AGENT_SOCKET"] = %(socket)r
            from tidepool.mooncake import MooncakeDistributedStore
            s = MooncakeDistributedStore()
            assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", %(masters)r) == 0
            key = %(prefix)r + "ro"
            assert s.put(key, b"x" * 4096) == 0
            libc = ctypes.CDLL(None)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_long]
            addr = libc.mmap(None, 8192, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
            rc = s.register_buffer(addr, 8192)
            print("get_into:", s.get_into(key, addr, 8192) if rc == 0 else "refused at register", flush=True)
            s.close()
        """)
        self.assertEqual(p.returncode, 0, "the process died (%d): %s" % (p.returncode, p.stderr[-2000:]))
        self.assertIn(p.stdout.strip(), ("get_into: -600", "get_into: refused at register"))

    def test_contiguous_buffers_of_two_registrations(self):
        # _where_parts moves an object's buffers as one span when they are
        # contiguous, and then asks for one registration holding the whole
        # span: buffers that are each registered (SGLang registers K and V
        # of one pool tensor with two calls, and they are adjacent) but
        # through two adjacent registrations are refused with -600.
        from tidepool.mooncake import MooncakeDistributedStore  # noqa: PLC0415
        os.environ["TIDEPOOL_AGENT_SOCKET"] = self.agent.socket
        self.addCleanup(os.environ.pop, "TIDEPOOL_AGENT_SOCKET", None)
        s = MooncakeDistributedStore()
        self.addCleanup(s.close)
        self.assertEqual(s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "", self.up.grpc), 0)
        n = 4096
        buf = (ctypes.c_char * (4 * n))()
        base = ctypes.addressof(buf)
        ctypes.memmove(base, os.urandom(2 * n), 2 * n)
        self.assertEqual(s.register_buffer(base, n), 0)  # "K"
        self.assertEqual(s.register_buffer(base + n, n), 0)  # "V", right after it
        self.assertEqual(s.register_buffer(base + 2 * n, 2 * n), 0)  # where it is read back
        key = self.prefix + "kv"
        self.assertEqual(s.batch_put_from_multi_buffers([key], [[base, base + n]], [[n, n]]), [0])
        self.assertEqual(s.batch_get_into_multi_buffers([key], [[base + 2 * n, base + 3 * n]], [[n, n]]), [2 * n])
        self.assertEqual(ctypes.string_at(base + 2 * n, 2 * n), ctypes.string_at(base, 2 * n))

    # -- the client's regions at interpreter exit ------------------------

    def test_exit_with_a_call_in_flight_does_not_crash(self):
        # weakref.finalize runs the client's shutdown at interpreter exit,
        # while daemon threads (SGLang's prefetch and backup threads are
        # daemons) may still be in a call: shutdown unmaps the session's
        # region under the call's memmove (users == 1), and the process
        # dies of SIGSEGV. The move here waits for the unmap to make the
        # window certain; a plain ctypes.memmove hits it by chance.
        p = self.script("""
            import atexit, ctypes, threading

            in_move, go, done = threading.Event(), threading.Event(), threading.Event()

            def after_finalizers():  # registered before any finalize: runs after them
                print("at exit: unmapped=%%s with %%d call(s) in flight" %% (region.unmapped, region.users),
                      flush=True)
                go.set()
                done.wait(10)
            atexit.register(after_finalizers)

            import tidepool
            c = tidepool.Client(%(socket)r, shm_bytes=1 << 20)
            key = %(prefix)r + "exit"
            c.set(key, b"v" * 4096)
            region = c._region
            dst = ctypes.create_string_buffer(4096)

            def move(d, s, n):
                in_move.set()
                go.wait()
                ctypes.memmove(d, s, n)

            def reader():
                c.batch_get_regions([key], [[(ctypes.addressof(dst), 4096, move)]])
                done.set()

            threading.Thread(target=reader, daemon=True).start()
            in_move.wait()
        """)
        self.assertEqual(p.returncode, 0, "exit crashed (%d): %s %s" % (p.returncode, p.stdout, p.stderr[-2000:]))

    # -- hostmem allocations used by tidepool.sglang ---------------------

    def test_sglang_backend_lets_go_of_freed_host_memory(self):
        # tidepool.sglang attaches MooncakeHostMemAllocator memory to its
        # Client's session, but hostmem.HOST.free tells only Mooncake stores
        # (HOST.users): the agent keeps every freed allocation mapped (its
        # memory is never given back) and after 64 the session refuses to
        # attach more, so every page of a new pool fails.
        c = tidepool.Client(self.agent.socket, shm_bytes=MiB)
        self.addCleanup(c.close)
        backend = HiCacheStorage("review-model", client=c)
        page_size, page_bytes = 4, 4096

        class Pool:
            def __init__(self, ptr):
                self.ptr, self.page_size = ptr, page_size

            def get_page_buffer_meta(self, indices):
                return [self.ptr + i // page_size * page_bytes for i in list(indices)[::page_size]], \
                       [page_bytes] * (len(indices) // page_size)

        alloc = MooncakeHostMemAllocator()
        for i in range(70):
            ptr = alloc.alloc(page_bytes)
            self.assertNotEqual(ptr, 0)
            ctypes.memset(ptr, i, page_bytes)
            backend.register_mem_pool_host(Pool(ptr))
            ok = backend.batch_set_v1([self.prefix + "page%d" % i], list(range(page_size)))
            self.assertEqual(alloc.free(ptr), 0)
            self.assertEqual(ok, [True], "pool %d: its page was not stored" % i)

    # -- the direct line to the master ------------------------------------

    def test_direct_exists_uses_a_live_master(self):
        # The agent announces every master; _Masters dials only the first
        # (or the leader a follower named) and never tries another, so with
        # the first master down the direct path is off for good and every
        # present() pays the hop through the agent.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = "127.0.0.1:%d" % s.getsockname()[1]  # nothing listens once closed
        agent = harness.Agent(self.dir, "%s,%s" % (dead, self.up.grpc))
        self.addCleanup(agent.stop)
        c = tidepool.Client(agent.socket, shm_bytes=MiB)
        self.addCleanup(c.close)
        key = self.prefix + "k"
        c.set(key, b"v")

        def direct():
            before = c.stats()["lookups"]
            started = time.monotonic()
            self.assertEqual(c.present([key]), [True])
            self.assertLess(time.monotonic() - started, 1.0, "present() stalled")
            return c.stats()["lookups"] == before

        harness.poll(direct, timeout=10, what="present() answered by a master directly")

    def test_direct_exists_follows_a_followers_leader_hint(self):
        # A follower answers every master call UNAVAILABLE and names the
        # leader in the tidepool-leader trailer (the agent's leaderconn
        # follows it). The direct line must follow it too, or in a cluster
        # whose first listed master is a follower (two in three) the
        # direct path is never used.
        real = self.up.grpc

        class Follower(grpc.GenericRpcHandler):
            def service(self, details):
                def refuse(req, ctx):
                    ctx.set_trailing_metadata((("tidepool-leader", real),))
                    ctx.abort(grpc.StatusCode.UNAVAILABLE, "not the leader")
                return grpc.unary_unary_rpc_method_handler(refuse)

        import concurrent.futures  # noqa: PLC0415
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(4), handlers=[Follower()])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self.addCleanup(server.stop, None)
        agent = harness.Agent(self.dir, "127.0.0.1:%d,%s" % (port, real))
        self.addCleanup(agent.stop)
        c = tidepool.Client(agent.socket, shm_bytes=MiB)
        self.addCleanup(c.close)
        key = self.prefix + "k"
        c.set(key, b"v")

        def direct():
            before = c.stats()["lookups"]
            self.assertEqual(c.present([key]), [True])
            return c.stats()["lookups"] == before

        harness.poll(direct, timeout=10, what="present() answered by the leader directly")

    # -- an Attach the client stopped waiting for --------------------------

    def test_attach_after_a_timed_out_attach(self):
        # The first use of an allocation in a session attaches it. When that
        # Attach times out (it waits for the session's write lock, held by
        # a slow get), the agent still maps it, under an id the client
        # never learns; every later attempt is refused ("already a region of
        # session"), so gets and puts from that memory fail for the rest
        # of the session.
        gate = Gate(self.up.grpc)
        self.addCleanup(gate.stop)
        agent = harness.Agent(self.dir, gate.addr)
        self.addCleanup(agent.stop)
        c = tidepool.Client(agent.socket, shm_bytes=MiB, timeout=1.0)
        self.addCleanup(c.close)
        key = self.prefix + "slow"
        value = os.urandom(4096)
        c.set(key, value)
        session = c.session

        a = HOST.alloc(4096)
        self.addCleanup(HOST.free, a.addr)

        channel = grpc.insecure_channel("unix:" + agent.socket)
        self.addCleanup(channel.close)
        stub = agent_pb2_grpc.AgentStub(channel)
        gate.close()
        slow = {}

        def slow_get():
            try:
                slow["resp"] = stub.BatchGet(agent_pb2.AgentGetRequest(
                    session=session, keys=[key], spans=[agent_pb2.Span(offset=MiB - 4096, length=4096)]),
                    timeout=30)
            except grpc.RpcError as e:
                slow["err"] = e

        t = threading.Thread(target=slow_get)
        t.start()
        gate.wait_held(key.encode())
        with self.assertRaises(tidepool.DeadlineExceeded):
            c.batch_get_regions([key], [(a.att, 0, 4096)])
        gate.open()
        t.join(30)
        self.assertNotIn("err", slow)

        def agent_maps_it():
            with open("/proc/%d/maps" % agent.proc.p.pid) as f:
                return "memfd:tidepool-host" in f.read()

        harness.poll(agent_maps_it, what="the abandoned Attach to map the allocation")
        try:
            got = c.batch_get_regions([key], [(a.att, 0, 4096)])
        except tidepool.Error as e:
            self.fail("the allocation is unusable in this session: %r" % e)
        self.assertEqual(got, [4096])
        self.assertEqual(bytes(a.mm[:4096]), value)


if __name__ == "__main__":
    unittest.main()
