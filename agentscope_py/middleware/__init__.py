"""Middleware: the built-in library, grouped by concern, and the contract it is written to.

The contract (`MiddlewareBase`, `ExtensionPoint`, the input records, `AgentView`) is defined in
`agentscope_py.extension`, below the agent, and re-exported here. The built-ins sit above the
agent, one subpackage per concern: ``resilience``, ``limits`` (call limits, rate limits, budgets),
``caching``, ``context``, ``safety`` (guardrails, PII, approval), ``policy``, ``observability``
(tracing, audit, observe, evaluation) and ``shapes`` (lifecycle, stage, observer).

Every name in ``__all__`` is importable from here; each built-in loads from its module on first
use, so importing the contract does not load the whole library (`OtelTracingMiddleware` needs the
``otel`` extra only when it is used).
"""

from typing import Any

from ..extension.base import (
    ActingInput,
    AgentInput,
    AgentRun,
    AgentView,
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
    "AgentView",
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
    "HedgeMiddleware",
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

# Each built-in's module (relative to this package), imported on first use (see the module docstring).
_LAZY = {
    "OtelTracingMiddleware": ".observability.tracing",
    "FinalAnswerFilterMiddleware": ".policy.final_answer",
    "TaskReminderMiddleware": "..agent.task_reminder",
    "StopOnAllDeniedMiddleware": ".policy.tool_policy",
    "LoggingMiddleware": ".observability.observe",
    "UsageAccountingMiddleware": ".observability.observe",
    "RetryMiddleware": ".resilience.retry",
    "ToolRetryMiddleware": ".resilience.retry",
    "TimeoutMiddleware": ".resilience.retry",
    "ModelFallbackMiddleware": ".resilience.retry",
    "HedgeMiddleware": ".resilience.hedge",
    # limits and rate limits
    "CallLimitExceeded": ".limits.calls",  # (defined in agentscope_py.errors)
    "ConcurrencyLimitMiddleware": ".limits.calls",
    "ModelCallLimitMiddleware": ".limits.calls",
    "ToolCallLimitMiddleware": ".limits.calls",
    "RateLimitMiddleware": ".limits.rate_limit",
    "InMemoryBucketStore": ".limits.rate_limit",
    "RedisBucketStore": ".limits.rate_limit",
    # caching and budgets
    "ResponseCacheMiddleware": ".caching.cache",
    "ToolResultCacheMiddleware": ".caching.cache",
    "CacheStore": ".caching.cache_stores",
    "InMemoryCacheStore": ".caching.cache_stores",
    "SqliteCacheStore": ".caching.cache_stores",
    "RedisCacheStore": ".caching.cache_stores",
    "BudgetMiddleware": ".limits.budget",
    "ModelPrice": ".limits.budget",
    "InMemoryBudgetStore": ".limits.budget",
    "RedisBudgetStore": ".limits.budget",
    # safety, observe and the other middleware shapes
    "PIIRedactionMiddleware": ".safety.pii",
    "PIIDetector": ".safety.pii_detectors",
    "GuardrailMiddleware": ".safety.guardrail",
    "Guardrail": ".safety.guardrail_checks",
    "GuardrailCheck": ".safety.guardrail_checks",
    "GuardrailResult": ".safety.guardrail_checks",
    "StructuredOutputValidationMiddleware": ".policy.structured",
    "AuditLogMiddleware": ".observability.audit",
    "DynamicPromptMiddleware": ".observability.observe",
    "LifecycleMiddleware": ".shapes.lifecycle",
    "StageMiddleware": ".shapes.stage",
    "MiddlewareContext": ".shapes.stage",
    "MiddlewareStage": ".shapes.stage",
    "ObserverMiddleware": ".shapes.observer",
    # tool policy and context
    "internal_model_call": "._internal",
    "ToolPolicyMiddleware": ".policy.tool_policy",
    "ToolSelectorMiddleware": ".context.tool_selection",
    "LLMToolSelectorMiddleware": ".context.tool_selection",
    "HumanApprovalMiddleware": ".safety.approval",
    "ApprovalConfig": ".safety.approval",
    "Approve": ".safety.approval",
    "Edit": ".safety.approval",
    "Reject": ".safety.approval",
    "Respond": ".safety.approval",
    "approval_message": ".safety.approval",
    "MessageTrimMiddleware": ".context.trim",
    "ContextCompressionMiddleware": ".context.compression",
    "Summarizer": ".context.compression",
    "ConcatSummarizer": ".context.compression",
    "ModelSummarizer": ".context.compression",
    "SummaryRecord": ".context.compression",  # (defined in agentscope_py.agent.state)
    "PromptCacheGuardMiddleware": ".context.prompt_cache",
    "EvalMiddleware": ".observability.evaluation",
    "OnlineResult": ".observability.evaluation",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
