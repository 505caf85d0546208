"""The old path of `agentscope_py.middleware.caching.cache_stores`: importing it gives that module."""

import sys

from .caching import cache_stores

sys.modules[__name__] = cache_stores
