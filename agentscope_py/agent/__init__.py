"""The ReAct agent, its context, state and state stores.

`RedisStateStore` loads on first use: it needs the ``redis`` extra.
"""

from typing import TYPE_CHECKING, Any

from ..errors import (
    AgentInterrupted,
    BusyError,
    PendingToolCallsError,
    ResumeError,
    StateConflictError,
    StateStoreError,
    StructuredOutputError,
)
from ._session import MultitaskStrategy
from ._structured import RESPONSE_TOOL
from .context import RuntimeContext
from .react import Builder, ReActAgent, confirm_message
from .sqlite_store import SqliteStateStore
from .state import AgentState, TodoItem
from .store import AgentStateStore, InMemoryStateStore

if TYPE_CHECKING:
    from .redis_store import RedisStateStore

__all__ = [
    "RESPONSE_TOOL",
    "AgentInterrupted",
    "AgentState",
    "AgentStateStore",
    "Builder",
    "BusyError",
    "InMemoryStateStore",
    "MultitaskStrategy",
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


def __getattr__(name: str) -> Any:
    if name == "RedisStateStore":  # imported on use: it needs the redis extra
        from .redis_store import RedisStateStore

        return RedisStateStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
