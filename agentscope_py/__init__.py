"""agentscope-py: ReAct agents as cold streams of typed events, shaped by middleware.

The names here are the ones most programs need; every subpackage (`agentscope_py.middleware`,
`agentscope_py.model`, `agentscope_py.server`, …) lists its own in ``__all__``. The API reference
and ``tests/api_snapshot.txt`` show the whole surface.

`OtelTracingMiddleware` loads on first use: it imports OpenTelemetry (the ``otel`` extra).
"""

import warnings
from typing import TYPE_CHECKING, Any

from .agent import (
    AgentInterrupted,
    AgentState,
    BusyError,
    InMemoryStateStore,
    MultitaskStrategy,
    PendingToolCallsError,
    ReActAgent,
    ResumeError,
    RuntimeContext,
    StateConflictError,
    StateStoreError,
    StructuredOutputError,
    confirm_message,
)
from .errors import AgentScopeError, InputError, MiddlewareError
from .events import AgentEvent, ConfirmResult, parse_event
from .message import (
    ChatUsage,
    DataBlock,
    GenerateReason,
    Msg,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolResultState,
    ToolUseBlock,
)
from .middleware import (
    ActingInput,
    AgentInput,
    AgentRun,
    ExtensionPoint,
    FinalAnswerFilterMiddleware,
    LoggingMiddleware,
    MiddlewareBase,
    ModelCallInput,
    ReasoningInput,
    StopOnAllDeniedMiddleware,
    TaskReminderMiddleware,
    UsageAccountingMiddleware,
)
from .model import ChatModel, ModelError, ModelStep, ScriptedModel
from .render import Renderer, render
from .stream import EventStream
from .tool import PermissionDecision, Tool, Toolkit, tool

if TYPE_CHECKING:
    from .middleware import OtelTracingMiddleware

__version__ = "0.1.0"

__all__ = [
    "ActingInput",
    "AgentEvent",
    "AgentInput",
    "AgentInterrupted",
    "AgentRun",
    "AgentScopeError",
    "AgentState",
    "BusyError",
    "ChatModel",
    "ChatUsage",
    "ConfirmResult",
    "DataBlock",
    "EventStream",
    "ExtensionPoint",
    "FinalAnswerFilterMiddleware",
    "GenerateReason",
    "InMemoryStateStore",
    "InputError",
    "LoggingMiddleware",
    "MiddlewareBase",
    "MiddlewareError",
    "ModelCallInput",
    "ModelError",
    "ModelStep",
    "Msg",
    "MultitaskStrategy",
    "OtelTracingMiddleware",
    "PendingToolCallsError",
    "PermissionDecision",
    "ReActAgent",
    "ReasoningInput",
    "Renderer",
    "ResumeError",
    "RuntimeContext",
    "ScriptedModel",
    "StateConflictError",
    "StateStoreError",
    "StopOnAllDeniedMiddleware",
    "StructuredOutputError",
    "TaskReminderMiddleware",
    "TextBlock",
    "ThinkingBlock",
    "Tool",
    "ToolResultBlock",
    "ToolResultState",
    "ToolUseBlock",
    "Toolkit",
    "UsageAccountingMiddleware",
    "confirm_message",
    "parse_event",
    "render",
    "tool",
]


# The other built-in middleware, once served from here unlisted: they live in
# `agentscope_py.middleware`, and reading them here warns until the aliases go.
_MOVED_TO_MIDDLEWARE = frozenset({
    "ApprovalConfig", "Approve", "AuditLogMiddleware", "BudgetMiddleware", "CacheStore", "CallLimitExceeded",
    "ConcatSummarizer", "ConcurrencyLimitMiddleware", "ContextCompressionMiddleware", "DynamicPromptMiddleware",
    "Edit", "Guardrail", "GuardrailCheck", "GuardrailMiddleware", "GuardrailResult", "HumanApprovalMiddleware",
    "InMemoryBucketStore", "InMemoryBudgetStore", "InMemoryCacheStore", "LLMToolSelectorMiddleware",
    "LifecycleMiddleware", "MessageTrimMiddleware", "MiddlewareContext", "MiddlewareStage",
    "ModelCallLimitMiddleware", "ModelFallbackMiddleware", "ModelPrice", "ModelSummarizer", "ObserverMiddleware",
    "PIIDetector", "PIIRedactionMiddleware", "PromptCacheGuardMiddleware", "RateLimitMiddleware",
    "RedisBucketStore", "RedisBudgetStore", "RedisCacheStore", "Reject", "Respond", "ResponseCacheMiddleware",
    "RetryMiddleware", "SqliteCacheStore", "StageMiddleware", "StructuredOutputValidationMiddleware",
    "Summarizer", "SummaryRecord", "TimeoutMiddleware", "ToolCallLimitMiddleware", "ToolPolicyMiddleware",
    "ToolResultCacheMiddleware", "ToolRetryMiddleware", "ToolSelectorMiddleware", "approval_message",
    "internal_model_call",
})


def __getattr__(name: str) -> Any:
    # `OtelTracingMiddleware` needs the otel extra, so it is imported only when asked for.
    if name == "OtelTracingMiddleware" or name in _MOVED_TO_MIDDLEWARE:
        from . import middleware

        if name != "OtelTracingMiddleware":
            warnings.warn(f"agentscope_py.{name} is deprecated: import it from agentscope_py.middleware",
                          DeprecationWarning, stacklevel=2)
        return getattr(middleware, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
