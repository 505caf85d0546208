"""Limits and budgets: call limits and concurrency limits (`calls`, re-exported here), rate limits
(`rate_limit`) and token and cost budgets (`budget`, with its stores and estimates). The rate
limit and budget modules load on first use: import their names from `agentscope_py.middleware`
or from the module itself.
"""

from .calls import CallLimitExceeded, ConcurrencyLimitMiddleware, ModelCallLimitMiddleware, ToolCallLimitMiddleware

__all__ = ["CallLimitExceeded", "ConcurrencyLimitMiddleware", "ModelCallLimitMiddleware", "ToolCallLimitMiddleware"]
