"""Middleware: the contract (`MiddlewareBase`, `ExtensionPoint`, input records) and built-ins.

Every name in ``__all__`` is importable from here. The contract is imported with the package;
each built-in loads from its module on first use, because the agent imports this package for
the contract while the built-ins import the agent's modules: loading them here would make the
agent depend on the whole library, and `OtelTracingMiddleware` would need the ``otel`` extra
just to import the agent.
"""

from typing import Any

from .base import (
    ActingInput,
    AgentInput,
    AgentRun,
    Deadline,
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
    "AuditLogMiddleware",
    "BudgetMiddleware",
    "CacheStore",
    "CallLimitExceeded",
    "ConcatSummarizer",
    "ConcurrencyLimitMiddleware",
    "ContextCompressionMiddleware",
    "Deadline",
    "DynamicPromptMiddleware",
    "Edit",
    "EvalMiddleware",
    "ExtensionPoint",
    "FinalAnswerFilterMiddleware",
    "Guardrail",
    "GuardrailCheck",
    "GuardrailMiddleware",
    "GuardrailResult",
    "HumanApprovalMiddleware",
    "InMemoryBucketStore",
    "InMemoryBudgetStore",
    "InMemoryCacheStore",
    "LLMToolSelectorMiddleware",
    "LifecycleMiddleware",
    "LoggingMiddleware",
    "MessageTrimMiddleware",
    "MiddlewareBase",
    "MiddlewareContext",
    "MiddlewareStage",
    "ModelCallInput",
    "ModelCallLimitMiddleware",
    "ModelFallbackMiddleware",
    "ModelPrice",
    "ModelSummarizer",
    "Next",
    "ObserverMiddleware",
    "OnlineResult",
    "OtelTracingMiddleware",
    "PIIDetector",
    "PIIRedactionMiddleware",
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
    "StageMiddleware",
    "StopOnAllDeniedMiddleware",
    "StructuredOutputValidationMiddleware",
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

# Each built-in's module, imported on first use (see the module docstring).
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
    # limits and rate limits
    "CallLimitExceeded": "limits",  # (defined in agentscope_py.errors)
    "ConcurrencyLimitMiddleware": "limits",
    "ModelCallLimitMiddleware": "limits",
    "ToolCallLimitMiddleware": "limits",
    "RateLimitMiddleware": "rate_limit",
    "InMemoryBucketStore": "rate_limit",
    "RedisBucketStore": "rate_limit",
    # caching and budgets
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
    # safety, observe and the other middleware shapes
    "PIIRedactionMiddleware": "pii",
    "PIIDetector": "pii_detectors",
    "GuardrailMiddleware": "guardrail",
    "Guardrail": "guardrail_checks",
    "GuardrailCheck": "guardrail_checks",
    "GuardrailResult": "guardrail_checks",
    "StructuredOutputValidationMiddleware": "structured",
    "AuditLogMiddleware": "audit",
    "DynamicPromptMiddleware": "observe",
    "LifecycleMiddleware": "shapes_lifecycle",
    "StageMiddleware": "shapes_stage",
    "MiddlewareContext": "shapes_stage",
    "MiddlewareStage": "shapes_stage",
    "ObserverMiddleware": "shapes_observer",
    # tool policy and context
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
    "EvalMiddleware": "evaluation",
    "OnlineResult": "evaluation",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
