"""The old path of `agentscope_py.middleware.observability.tracing`: importing it gives that module."""

import sys

from .observability import tracing

sys.modules[__name__] = tracing
