"""The old path of `agentscope_py.middleware.caching.cache_keys`: importing it gives that module."""

import sys

from .caching import cache_keys

sys.modules[__name__] = cache_keys
