"""`AgentState`: what one (user, session) remembers between calls. Serialises to JSON and back.

Below `tool/` and `agent/` (the todo tools and the loop both use it); `agentscope_py.agent.state`
re-exports it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from ._effects import ToolIntent
from .message import Msg

__all__ = ["AgentState", "SummaryRecord", "TodoItem"]


class TodoItem(BaseModel):
    id: str
    content: str
    status: Literal["pending", "in_progress", "completed"] = "pending"
    priority: Literal["high", "medium", "low"] = "medium"


class SummaryRecord(BaseModel):
    """One compression of the context (`ContextCompressionMiddleware`): the summary that replaced
    ``removed_messages`` older messages (ids ``first_id`` … ``last_id``), ``kept_messages`` kept
    verbatim, by which ``summarizer``, when (epoch seconds), and the estimated tokens before and
    after."""

    summary: str
    removed_messages: int
    kept_messages: int
    first_id: str | None = None
    last_id: str | None = None
    summary_id: str | None = None
    """The id of the summary message put into the context."""
    summarizer: str = ""
    created_at: float = 0.0
    tokens_before: int = 0
    tokens_after: int = 0


class AgentState(BaseModel):
    """The session's memory and bookkeeping.

    ``context`` is the list of remembered messages (the conversation the model sees after the
    system prompt); ``tasks`` the todo list; ``pending_tool_calls`` the ids of calls that wait for
    a user's confirmation or an external result; ``cur_iter`` the ReAct round of the last call.
    """

    user_id: str = "default"
    session_id: str = "default"
    context: list[Msg] = Field(default_factory=list)
    tasks: list[TodoItem] = Field(default_factory=list)
    pending_tool_calls: list[str] = Field(default_factory=list)
    cur_iter: int = 0
    summary: str = ""
    summaries: list[SummaryRecord] = Field(default_factory=list)
    """The context's compressions, oldest first (empty until one happens)."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    tool_journal: dict[str, ToolIntent] = Field(default_factory=dict)
    """The journaled tool calls (`ToolIntent`) of the last reply that have no result in
    ``context`` yet, by call id: an entry without a result after a restart is a call in doubt."""

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, data: str | bytes) -> AgentState:
        return cls.model_validate_json(data)
