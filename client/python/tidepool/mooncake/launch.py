"""How setup finds its `tidepool agent`, or starts one for the process.

Mooncake's integrations pass their configuration to ``setup``; what is
Tidepool's own comes from the environment or from the same JSON file the
integration reads (``MOONCAKE_CONFIG_PATH``, or SGLang's
``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``), under ``tidepool_*`` keys:

- ``TIDEPOOL_AGENT_SOCKET`` / ``tidepool_agent_socket``: the agent to use
  (default /tmp/tidepool-agent.sock). When none answers there, setup starts
  a private agent for the process (on a socket of its own) and stops it at
  close.
- ``TIDEPOOL_BIN`` / ``tidepool_bin``: the tidepool binary that agent runs
  (default: ``tidepool`` on PATH).
- ``TIDEPOOL_TIMEOUT`` / ``tidepool_timeout``: seconds one request may take
  (default 20: a master failover fits; a pool that is gone answers -901).
"""

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref

logger = logging.getLogger("tidepool.mooncake")

DEFAULT_SOCKET = "/tmp/tidepool-agent.sock"

# How long a started agent may take to serve and register its segment.
START_TIMEOUT = 30.0

_CONFIG_ENVS = ("MOONCAKE_CONFIG_PATH", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH")

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(v):
    """A byte count from an int or a string such as "4gb", "16MB", "1GiB"
    (powers of 1024, as Mooncake reads them); ValueError otherwise."""
    if isinstance(v, bool):
        raise ValueError("size %r" % v)
    if isinstance(v, int):
        if v < 0:
            raise ValueError("negative size %d" % v)
        return v
    m = _SIZE.match(str(v))
    if not m:
        raise ValueError("size %r: want bytes or a number with kb, mb, gb or tb" % v)
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "")[:1].lower()])


def parse_masters(addr):
    """Tidepool master addresses from Mooncake's master_server_addr:
    host:port, several separated by commas or semicolons."""
    addr = str(addr or "").strip()
    for scheme in ("tidepool://", "grpc://"):
        if addr.startswith(scheme):
            addr = addr[len(scheme):]
    masters = [a.strip() for a in re.split(r"[,;]", addr) if a.strip()]
    for a in masters:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError("master_server_addr %r: want host:port[,host:port...] of Tidepool masters" % addr)
    return ",".join(masters)


def file_config():
    """The tidepool_* keys of the first JSON file the Mooncake config
    variables name ({} when none is set or readable)."""
    for env in _CONFIG_ENVS:
        path = os.environ.get(env)
        if not path:
            continue
        try:
            with open(path) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            logger.warning("cannot read %s=%s: %s", env, path, e)
            return {}
        return {k: v for k, v in cfg.items() if isinstance(k, str) and k.startswith("tidepool_")} \
            if isinstance(cfg, dict) else {}
    return {}


def timeout(cfg, default):
    """Seconds a request may take: $TIDEPOOL_TIMEOUT, the config file's
    tidepool_timeout, else default."""
    v = os.environ.get("TIDEPOOL_TIMEOUT") or cfg.get("tidepool_timeout")
    try:
        return float(v) if v else default
    except ValueError:
        logger.warning("tidepool_timeout %r is not a number of seconds; using %gs", v, default)
        return default


def agent_socket(cfg):
    return os.environ.get("TIDEPOOL_AGENT_SOCKET") or cfg.get("tidepool_agent_socket") or DEFAULT_SOCKET


def answers(path):
    """Whether something listens on the unix socket path."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(2.0)
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _segment_listen(local_hostname):
    """Where a started agent's segment listens: local_hostname's port if it
    names one, else any free port on its address."""
    host, sep, port = local_hostname.rpartition(":")
    if sep and port.isdigit() and host:
        return "%s:%s" % (host, port)
    host = local_hostname or "127.0.0.1"
    if host == "localhost":
        host = "127.0.0.1"
    return "%s:0" % host


# The agents this process started, for the fork handler.
_agents = weakref.WeakSet()


def _after_fork_in_child():
    # A child holding the lifeline's write end would keep its parent's
    # agent alive after the parent died.
    for a in list(_agents):
        a.forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _loopback(host):
    return host == "localhost" or host.startswith("127.") or host == "::1"


def loopback_only(local_hostname, masters):
    """Whether a segment on local_hostname would listen on loopback while
    the masters (and so, likely, other hosts' clients) are elsewhere."""
    if not _loopback(_segment_listen(local_hostname).rpartition(":")[0]):
        return False
    return any(not _loopback(m.rpartition(":")[0]) for m in masters.split(","))


class Agent:
    """A `tidepool agent` this process started: on a private socket, with
    a pipe on its standard input that ends it if this process dies."""

    def __init__(self, binary, masters, segment, local_hostname, shm_bytes):
        self.pid = os.getpid()  # a forked child must not stop its parent's agent
        self.dir = tempfile.mkdtemp(prefix="tidepool-mooncake-")
        self.socket = os.path.join(self.dir, "agent.sock")
        self.log_path = os.path.join(self.dir, "agent.log")
        self.proc = None
        for attempt in range(3):
            self.http = "127.0.0.1:%d" % _free_port()
            args = [binary, "agent", "--socket", self.socket, "--masters", masters, "--http", self.http,
                    "--exit-with-stdin", "--log-level", "warn",
                    "--max-session-bytes", str(max(shm_bytes, 4 << 30))]
            if segment > 0:
                args += ["--segment", str(segment), "--segment-listen", _segment_listen(local_hostname)]
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True, close_fds=True)
            if self._wait_ready():
                _agents.add(self)
                logger.info("started tidepool agent (pid %d) on %s for masters %s, segment %d bytes",
                            self.proc.pid, self.socket, masters, segment)
                return
            out = self.output()
            self.stop()
            if "address already in use" in out and attempt < 2:
                continue  # the http port was taken between probing and binding
            raise RuntimeError("tidepool agent did not start serving in %.0fs:\n%s" % (START_TIMEOUT, out[-2000:]))

    def _wait_ready(self):
        """Polls until the agent serves its socket (whether a master answers
        it is setup's next question)."""
        return self._poll(lambda: answers(self.socket), START_TIMEOUT)

    def wait_registered(self, timeout):
        """Polls /readyz until the agent's segment is registered with a
        master (and a master leader answers it)."""
        return self._poll(lambda: self._readyz() == 200, timeout)

    def _readyz(self):
        """/readyz's status, or None when nothing answers."""
        try:
            # The agent's readiness asks a master, for up to 2 s.
            with urllib.request.urlopen("http://%s/readyz" % self.http, timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (urllib.error.URLError, OSError):
            return None

    def _poll(self, cond, timeout):
        deadline = time.monotonic() + timeout
        delay = 0.01
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if cond():
                return True
            time.sleep(delay)
            delay = min(2 * delay, 0.2)
        return False

    def output(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def forget(self):
        """In a forked child: let go of the parent's agent (and close this
        process's copy of its lifeline)."""
        p, self.proc = self.proc, None
        if p is not None and p.stdin is not None:
            try:
                os.close(p.stdin.fileno())
            except OSError:
                pass

    def stop(self, timeout=10.0):
        """Closes the lifeline and waits; SIGKILL if it lingers. In a forked
        child, only forgets it: the parent goes on using it."""
        p, self.proc = self.proc, None
        if os.getpid() != self.pid:
            return
        if p is not None:
            try:
                p.stdin.close()
            except OSError:
                pass
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def binary(cfg):
    b = os.environ.get("TIDEPOOL_BIN") or cfg.get("tidepool_bin") or shutil.which("tidepool")
    if not b:
        raise RuntimeError("no running tidepool agent, and no tidepool binary to start one: "
                           "set TIDEPOOL_AGENT_SOCKET to a running agent, or TIDEPOOL_BIN (or PATH) to the binary")
    return b
