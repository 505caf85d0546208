"""The old path of `agentscope_py.middleware.policy.final_answer`: importing it gives that module."""

import sys

from .policy import final_answer

sys.modules[__name__] = final_answer
