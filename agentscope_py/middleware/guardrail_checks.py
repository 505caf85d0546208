"""The old path of `agentscope_py.middleware.safety.guardrail_checks`: importing it gives that module."""

import sys

from .safety import guardrail_checks

sys.modules[__name__] = guardrail_checks
