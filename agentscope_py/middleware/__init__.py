"""Middleware: the contract (`MiddlewareBase`, `ExtensionPoint`, input records) and built-ins."""

from typing import Any

from .base import (
    ActingInput,
    AgentInput,
    AgentRun,
    ExtensionPoint,
    MiddlewareBase,
    ModelCallInput,
    Next,
    ReasoningInput,
)

__all__ = [
    "ActingInput",
    "AgentInput",
    "AgentRun",
    "CallLimitExceeded",
    "ConcurrencyLimitMiddleware",
    "ExtensionPoint",
    "FinalAnswerFilterMiddleware",
    "InMemoryBucketStore",
    "LoggingMiddleware",
    "MiddlewareBase",
    "ModelCallInput",
    "ModelCallLimitMiddleware",
    "ModelFallbackMiddleware",
    "Next",
    "OtelTracingMiddleware",
    "RateLimitMiddleware",
    "ReasoningInput",
    "RedisBucketStore",
    "RetryMiddleware",
    "StopOnAllDeniedMiddleware",
    "TaskReminderMiddleware",
    "TimeoutMiddleware",
    "ToolCallLimitMiddleware",
    "ToolRetryMiddleware",
    "UsageAccountingMiddleware",
]

# Built-ins load on first use (tracing imports OpenTelemetry only then).
_LAZY = {
    "OtelTracingMiddleware": "tracing",
    "FinalAnswerFilterMiddleware": "final_answer",
    "TaskReminderMiddleware": "task_reminder",
    "StopOnAllDeniedMiddleware": "tool_policy",
    "LoggingMiddleware": "observe",
    "UsageAccountingMiddleware": "observe",
    "RetryMiddleware": "resilience",
    "ToolRetryMiddleware": "resilience",
    "TimeoutMiddleware": "resilience",
    "ModelFallbackMiddleware": "resilience",
    # limits and rate limits (issue #17)
    "CallLimitExceeded": "limits",  # (defined in agentscope_py.errors)
    "ConcurrencyLimitMiddleware": "limits",
    "ModelCallLimitMiddleware": "limits",
    "ToolCallLimitMiddleware": "limits",
    "RateLimitMiddleware": "rate_limit",
    "InMemoryBucketStore": "rate_limit",
    "RedisBucketStore": "rate_limit",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(name)
