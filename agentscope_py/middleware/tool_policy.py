"""The old path of `agentscope_py.middleware.policy.tool_policy`: importing it gives that module."""

import sys

from .policy import tool_policy

sys.modules[__name__] = tool_policy
