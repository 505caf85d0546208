"""The old path of `agentscope_py.middleware.shapes.stage`: importing it gives that module."""

import sys

from .shapes import stage

sys.modules[__name__] = stage
