"""The ReAct agent, its context, state and state stores."""

from typing import Any

from ..errors import (
    AgentInterrupted,
    PendingToolCallsError,
    ResumeError,
    StateConflictError,
    StateStoreError,
    StructuredOutputError,
)
from .context import RuntimeContext
from .react import Builder, ReActAgent, confirm_message
from .state import AgentState, TodoItem
from .store import AgentStateStore, InMemoryStateStore

__all__ = [
    "AgentInterrupted",
    "AgentState",
    "AgentStateStore",
    "Builder",
    "InMemoryStateStore",
    "PendingToolCallsError",
    "ReActAgent",
    "RedisStateStore",
    "ResumeError",
    "RuntimeContext",
    "SqliteStateStore",
    "StateConflictError",
    "StateStoreError",
    "StructuredOutputError",
    "TodoItem",
    "confirm_message",
]

_LAZY = {"SqliteStateStore": "sqlite_store", "RedisStateStore": "redis_store"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(name)
