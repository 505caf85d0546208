"""The old path of `agentscope_py.middleware.caching.cache`: importing it gives that module."""

import sys

from .caching import cache

sys.modules[__name__] = cache
