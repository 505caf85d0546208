"""The old path of `agentscope_py.middleware.shapes.observer`: importing it gives that module."""

import sys

from .shapes import observer

sys.modules[__name__] = observer
