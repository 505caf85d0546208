"""`AgentState`: what one (user, session) remembers between calls. Serialises to JSON and back.

Below `tool/` and `agent/` (the todo tools and the loop both use it); `agentscope_py.agent.state`
re-exports it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from .message import Msg

__all__ = ["AgentState", "TodoItem"]


class TodoItem(BaseModel):
    id: str
    content: str
    status: Literal["pending", "in_progress", "completed"] = "pending"
    priority: Literal["high", "medium", "low"] = "medium"


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
    metadata: dict[str, Any] = Field(default_factory=dict)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, data: str | bytes) -> AgentState:
        return cls.model_validate_json(data)
