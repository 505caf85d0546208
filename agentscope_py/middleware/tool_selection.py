"""The old path of `agentscope_py.middleware.context.tool_selection`: importing it gives that module."""

import sys

from .context import tool_selection

sys.modules[__name__] = tool_selection
