"""The old path of `agentscope_py.middleware.observability.evaluation`: importing it gives that module."""

import sys

from .observability import evaluation

sys.modules[__name__] = evaluation
