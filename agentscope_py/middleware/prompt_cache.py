"""The old path of `agentscope_py.middleware.context.prompt_cache`: importing it gives that module."""

import sys

from .context import prompt_cache

sys.modules[__name__] = prompt_cache
