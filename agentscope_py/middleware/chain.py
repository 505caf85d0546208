"""The old path of `agentscope_py.extension.chain`: importing it gives that module."""

import sys

from ..extension import chain

sys.modules[__name__] = chain
