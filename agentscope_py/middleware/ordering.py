"""The old path of `agentscope_py.extension.ordering`: importing it gives that module."""

import sys

from ..extension import ordering

sys.modules[__name__] = ordering
