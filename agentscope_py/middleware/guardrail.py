"""The old path of `agentscope_py.middleware.safety.guardrail`: importing it gives that module."""

import sys

from .safety import guardrail

sys.modules[__name__] = guardrail
