"""The old path of `agentscope_py.extension.base`: importing it gives that module."""

import sys

from ..extension import base

sys.modules[__name__] = base
