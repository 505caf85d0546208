"""The old path of `agentscope_py.middleware.safety.approval`: importing it gives that module."""

import sys

from .safety import approval

sys.modules[__name__] = approval
