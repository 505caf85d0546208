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
    "ApprovalConfig",
    "Approve",
    "BudgetMiddleware",
    "CacheStore",
    "CallLimitExceeded",
    "ConcatSummarizer",
    "ConcurrencyLimitMiddleware",
    "ContextCompressionMiddleware",
    "Edit",
    "ExtensionPoint",
    "FinalAnswerFilterMiddleware",
    "HumanApprovalMiddleware",
    "InMemoryBucketStore",
    "InMemoryBudgetStore",
    "InMemoryCacheStore",
    "LLMToolSelectorMiddleware",
    "LoggingMiddleware",
    "MessageTrimMiddleware",
    "MiddlewareBase",
    "ModelCallInput",
    "ModelCallLimitMiddleware",
    "ModelFallbackMiddleware",
    "ModelPrice",
    "ModelSummarizer",
    "Next",
    "OtelTracingMiddleware",
    "PromptCacheGuardMiddleware",
    "RateLimitMiddleware",
    "ReasoningInput",
    "RedisBucketStore",
    "RedisBudgetStore",
    "RedisCacheStore",
    "Reject",
    "Respond",
    "ResponseCacheMiddleware",
    "RetryMiddleware",
    "SqliteCacheStore",
    "StopOnAllDeniedMiddleware",
    "Summarizer",
    "SummaryRecord",
    "TaskReminderMiddleware",
    "TimeoutMiddleware",
    "ToolCallLimitMiddleware",
    "ToolPolicyMiddleware",
    "ToolResultCacheMiddleware",
    "ToolRetryMiddleware",
    "ToolSelectorMiddleware",
    "UsageAccountingMiddleware",
    "approval_message",
    "internal_model_call",
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
    # caching and budgets (issue 17)
    "ResponseCacheMiddleware": "cache",
    "ToolResultCacheMiddleware": "cache",
    "CacheStore": "cache_stores",
    "InMemoryCacheStore": "cache_stores",
    "SqliteCacheStore": "cache_stores",
    "RedisCacheStore": "cache_stores",
    "BudgetMiddleware": "budget",
    "ModelPrice": "budget",
    "InMemoryBudgetStore": "budget",
    "RedisBudgetStore": "budget",
    # tool policy and context (issue 18, part 1)
    "internal_model_call": "_internal",
    "ToolPolicyMiddleware": "tool_policy",
    "ToolSelectorMiddleware": "tool_selection",
    "LLMToolSelectorMiddleware": "tool_selection",
    "HumanApprovalMiddleware": "approval",
    "ApprovalConfig": "approval",
    "Approve": "approval",
    "Edit": "approval",
    "Reject": "approval",
    "Respond": "approval",
    "approval_message": "approval",
    "MessageTrimMiddleware": "trim",
    "ContextCompressionMiddleware": "compression",
    "Summarizer": "compression",
    "ConcatSummarizer": "compression",
    "ModelSummarizer": "compression",
    "SummaryRecord": "compression",  # (defined in agentscope_py.agent.state)
    "PromptCacheGuardMiddleware": "prompt_cache",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(name)
