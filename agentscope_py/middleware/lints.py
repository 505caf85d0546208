"""The old path of `agentscope_py.extension.lints`: importing it gives that module."""

import sys

from ..extension import lints

sys.modules[__name__] = lints
