"""The old path of `agentscope_py.middleware.observability.audit`: importing it gives that module."""

import sys

from .observability import audit

sys.modules[__name__] = audit
