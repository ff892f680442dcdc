"""bind_to_numa_node: Mooncake's module function."""

import logging
import os

logger = logging.getLogger("tidepool.mooncake")


def _cpus(spec):
    out = set()
    for part in spec.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def bind_to_numa_node(node):
    """Runs this process on the CPUs of NUMA node (best effort, as
    Mooncake's: a warning, never an error, when it cannot). Memory policy is
    left to the kernel's first touch."""
    try:
        with open("/sys/devices/system/node/node%d/cpulist" % int(node)) as f:
            cpus = _cpus(f.read())
        if cpus:
            os.sched_setaffinity(0, cpus)
    except (OSError, ValueError, TypeError) as e:
        logger.warning("bind_to_numa_node(%r): %s", node, e)
