"""The old path of `agentscope_py.middleware.policy.structured`: importing it gives that module."""

import sys

from .policy import structured

sys.modules[__name__] = structured
