"""The old path of `agentscope_py.middleware.context.compression`: importing it gives that module."""

import sys

from .context import compression

sys.modules[__name__] = compression
