"""Resilience built-ins: retries of model and tool calls, timeouts and model fallback (see
`retry` for the streaming contract they keep)."""

from .retry import ModelFallbackMiddleware, RetryMiddleware, TimeoutMiddleware, ToolRetryMiddleware

__all__ = ["ModelFallbackMiddleware", "RetryMiddleware", "TimeoutMiddleware", "ToolRetryMiddleware"]
