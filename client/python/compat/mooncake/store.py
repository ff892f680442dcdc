"""``mooncake.store`` answered by Tidepool: see tidepool.mooncake."""

from tidepool.mooncake import *  # noqa: F401,F403
from tidepool.mooncake import __all__  # noqa: F401
