"""The old path of `agentscope_py.middleware.observability.observe`: importing it gives that module."""

import sys

from .observability import observe

sys.modules[__name__] = observe
