"""Resilience built-ins: retries of model and tool calls, timeouts, model fallback and hedged
calls (see `retry` for the streaming contract they keep)."""

from .hedge import HedgeMiddleware
from .retry import ModelFallbackMiddleware, RetryMiddleware, TimeoutMiddleware, ToolRetryMiddleware

__all__ = [
    "HedgeMiddleware", "ModelFallbackMiddleware", "RetryMiddleware", "TimeoutMiddleware", "ToolRetryMiddleware",
]
