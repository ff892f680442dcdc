"""A stand-in for Mooncake's ``mooncake`` package whose ``mooncake.store`` is
Tidepool's (``tidepool.mooncake``).

It takes effect only when this directory (client/python/compat) comes first
on PYTHONPATH, on purpose: then an engine's own ``from mooncake.store import
MooncakeDistributedStore, ReplicateConfig`` runs on Tidepool, unchanged.
Other ``mooncake`` modules (``mooncake.engine``, ...) still come from a real
Mooncake install found later on the path.
"""

import os
import pkgutil
import sys

# The rest of a real mooncake package, if one is installed.
__path__ = pkgutil.extend_path(__path__, __name__)

try:
    import tidepool  # noqa: F401
except ImportError:  # the SDK next to this directory
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

#: Says whose mooncake this is.
TIDEPOOL = True
