"""agentscope-py: ReAct agents as cold streams of typed events, shaped by middleware."""

from typing import Any

from .agent import (
    AgentInterrupted,
    AgentState,
    InMemoryStateStore,
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
    MiddlewareBase,
    ModelCallInput,
    ReasoningInput,
)
from .model import ChatModel, ModelError, ModelStep, ScriptedModel
from .render import Renderer, render
from .stream import EventStream
from .tool import PermissionDecision, Tool, Toolkit, tool

__version__ = "0.1.0"

__all__ = [
    "ActingInput",
    "AgentEvent",
    "AgentInput",
    "AgentInterrupted",
    "AgentRun",
    "AgentScopeError",
    "AgentState",
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


def __getattr__(name: str) -> Any:
    from . import middleware

    if name in middleware._LAZY:
        return getattr(middleware, name)
    raise AttributeError(name)
