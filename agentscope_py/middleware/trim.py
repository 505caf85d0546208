"""The old path of `agentscope_py.middleware.context.trim`: importing it gives that module."""

import sys

from .context import trim

sys.modules[__name__] = trim
