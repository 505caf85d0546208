"""The old path of `agentscope_py.middleware.limits.rate_limit`: importing it gives that module."""

import sys

from .limits import rate_limit

sys.modules[__name__] = rate_limit
