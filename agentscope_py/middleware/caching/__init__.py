"""Caching built-ins: model responses and read-only tool results (`ResponseCacheMiddleware`,
`ToolResultCacheMiddleware`) and their stores. Each module loads on first use: import the names
from `agentscope_py.middleware` or from the module itself.
"""

__all__: list[str] = []
