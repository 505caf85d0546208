"""The old path of `agentscope_py.middleware.safety.pii`: importing it gives that module."""

import sys

from .safety import pii

sys.modules[__name__] = pii
