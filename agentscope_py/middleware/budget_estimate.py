"""The old path of `agentscope_py.middleware.limits.budget_estimate`: importing it gives that module."""

import sys

from .limits import budget_estimate

sys.modules[__name__] = budget_estimate
