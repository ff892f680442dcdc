"""Runs the real binary for the tests: `tidepool up` and `tidepool agent` as
separate processes on loopback ports and a unix socket in a temporary
directory. Readiness is polled, never slept for.

The binary is built once per test run with `go build` into a temporary
directory, or taken from $TIDEPOOL_BIN.
"""

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)
REPO = os.path.dirname(os.path.dirname(PYTHON_DIR))
sys.path.insert(0, PYTHON_DIR)

import tidepool  # noqa: E402

READY_TIMEOUT = 30.0

_binary = None


def binary():
    """The path of the tidepool binary, built on first use."""
    global _binary
    if _binary is None:
        path = os.environ.get("TIDEPOOL_BIN")
        if not path:
            if shutil.which("go") is None:
                raise RuntimeError("no go on PATH to build tidepool, and $TIDEPOOL_BIN unset")
            d = tempfile.mkdtemp(prefix="tidepool-pytest-bin-")
            atexit.register(shutil.rmtree, d, True)
            path = os.path.join(d, "tidepool")
            subprocess.run(["go", "build", "-o", path, "./cmd/tidepool"], cwd=REPO, check=True)
        _binary = path
    return _binary


def have_go():
    return bool(os.environ.get("TIDEPOOL_BIN")) or shutil.which("go") is not None


def fork_env(fork_support):
    """The environment of a script that forks: gRPC's fork support on for
    a forked child that makes calls, off otherwise. Off, not unset:
    Debian's gRPC runs its fork handlers unless told not to."""
    return dict(os.environ, GRPC_ENABLE_FORK_SUPPORT="1" if fork_support else "0")


_FRAME = re.compile(r'(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):\n  File "<string>", line (\d+) ')


def run_script(script, fork_support=False, timeout=60):
    """Runs script in a fresh interpreter with the SDK on its path and
    returns the CompletedProcess. A script still running after timeout
    seconds dumps its stacks (faulthandler on SIGUSR1: a signal handler
    survives a fork, which its timer thread does not) and is killed, with
    any child it forked. One stuck in os.fork() runs again, at most twice:
    gRPC 1.51's prefork handler deadlocks now and then (on two loaded
    cores about one fork in 50 with fork support unset, one in 10 with it
    on) when an executor thread wakes just as it joins it, and a test
    whose child makes calls cannot turn it off."""
    script = ("import faulthandler, os, signal, sys\nfaulthandler.register(signal.SIGUSR1)\n"
              "sys.path.insert(0, %r)\n" % PYTHON_DIR) + script
    lines = script.splitlines()
    for attempt in range(3):
        p = subprocess.Popen([sys.executable, "-c", script], env=fork_env(fork_support), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGUSR1)  # a forked child's stacks too
            except ProcessLookupError:
                pass
            try:
                out, err = p.communicate(timeout=2)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # gone meanwhile
                out, err = p.communicate()
            err += "\nharness: killed after %d s" % timeout
        p = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if attempt == 2 or not any("os.fork()" in lines[int(n) - 1] for n in _FRAME.findall(err)):
            return p
        print("harness: gRPC's fork handler deadlocked (run %d); running the script again" % (attempt + 1),
              file=sys.stderr)


def free_addr():
    """A loopback address with a port free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return "127.0.0.1:%d" % s.getsockname()[1]


def poll(cond, timeout=READY_TIMEOUT, what="condition"):
    """Calls cond until it returns a true value (returned), backing off from
    10 ms to 200 ms; raises AssertionError with cond's last exception after
    timeout."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    last = None
    while True:
        try:
            v = cond()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - reported on timeout
            last = e
        if time.monotonic() > deadline:
            raise AssertionError("%s not met after %.0fs; last error: %r" % (what, timeout, last))
        time.sleep(delay)
        delay = min(2 * delay, 0.2)


_live = set()  # every Proc not yet stopped, killed at exit should a test leave one


@atexit.register
def _kill_live():
    for p in list(_live):
        p.kill()


class Proc:
    """A daemon started from the binary; its output goes to a log file."""

    def __init__(self, name, args, log_dir):
        self.name = name
        self.args = args
        self.log_path = os.path.join(log_dir, "%s-%d.log" % (name, time.monotonic_ns()))
        self._log = open(self.log_path, "wb")
        self.p = subprocess.Popen([binary()] + args, stdout=self._log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        _live.add(self)

    def exited(self):
        return self.p.poll() is not None

    def output(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def check_alive(self):
        if self.exited():
            raise RuntimeError("%s exited with %s:\n%s" % (self.name, self.p.returncode, self.output()[-4000:]))

    def kill(self):
        """SIGKILL, as a crash would, and wait."""
        if not self.exited():
            self.p.send_signal(signal.SIGKILL)
        self.p.wait()
        self._log.close()
        _live.discard(self)

    def stop(self, timeout=10.0):
        """SIGTERM, then SIGKILL if it lingers."""
        if not self.exited():
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.send_signal(signal.SIGKILL)
                self.p.wait()
        self._log.close()
        _live.discard(self)


def _http_ready(addr):
    try:
        with urllib.request.urlopen("http://%s/readyz" % addr, timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class Up:
    """`tidepool up` on fresh loopback ports with its data in dir."""

    def __init__(self, dir, extra=()):
        for attempt in range(3):
            self.grpc, self.raft, self.engine, self.http = free_addr(), free_addr(), free_addr(), free_addr()
            self.proc = Proc("up", ["up", "--dir", os.path.join(dir, "up"), "--listen", self.grpc,
                                    "--raft", self.raft, "--engine", self.engine, "--http", self.http,
                                    "--dram", "256MiB", "--ssd", "64MiB"] + list(extra), dir)

            def ready():
                self.proc.check_alive()
                return _http_ready(self.http)

            try:
                poll(ready, what="tidepool up ready")
                return
            except RuntimeError:
                if "address already in use" in self.proc.output() and attempt < 2:
                    continue  # a port was taken between probing and binding
                raise

    def stop(self):
        self.proc.stop()


class Agent:
    """`tidepool agent` on a unix socket, for the masters of up."""

    def __init__(self, dir, masters, sock=None, extra=()):
        self.dir = dir
        self.masters = masters
        self.socket = sock or os.path.join(dir, "agent-%d.sock" % time.monotonic_ns())
        self.extra = list(extra)
        self.start()

    def start(self):
        for attempt in range(3):
            self.http = free_addr()
            self.proc = Proc("agent", ["agent", "--socket", self.socket, "--masters", self.masters,
                                       "--http", self.http] + self.extra, self.dir)

            def ready():
                # Ready: a master answers it (/readyz), and it opens sessions.
                self.proc.check_alive()
                if not _http_ready(self.http):
                    return False
                with tidepool.Client(self.socket, shm_bytes=4096, client_name="readiness", timeout=2):
                    return True

            try:
                poll(ready, what="tidepool agent ready")
                return
            except RuntimeError:
                if "address already in use" in self.proc.output() and attempt < 2:
                    continue
                raise

    def kill(self):
        self.proc.kill()

    def stop(self):
        self.proc.stop()
