"""The old path of `agentscope_py.middleware.safety.pii_detectors`: importing it gives that module."""

import sys

from .safety import pii_detectors

sys.modules[__name__] = pii_detectors
