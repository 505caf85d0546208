"""The old path of `agentscope_py.middleware.shapes.lifecycle`: importing it gives that module."""

import sys

from .shapes import lifecycle

sys.modules[__name__] = lifecycle
