"""The old path of `agentscope_py.middleware.limits.budget_stores`: importing it gives that module."""

import sys

from .limits import budget_stores

sys.modules[__name__] = budget_stores
