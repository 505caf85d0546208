"""The old path of `agentscope_py.middleware.limits.budget`: importing it gives that module."""

import sys

from .limits import budget

sys.modules[__name__] = budget
