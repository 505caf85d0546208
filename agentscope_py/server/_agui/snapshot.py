"""What an AG-UI client hears when it resumes a run whose log is gone (expired, or kept by a process
that no longer exists): the thread as the session remembers it, as one MESSAGES_SNAPSHOT between
RUN_STARTED and RUN_FINISHED, so the client's transcript ends right either way."""

from __future__ import annotations

import json

from ag_ui.core import (
    AssistantMessage,
    FunctionCall,
    Message,
    MessagesSnapshotEvent,
    RunFinishedEvent,
    RunStartedEvent,
    ToolCall,
    ToolMessage,
    UserMessage,
)

from ...message import Msg, ToolResultState
from ..agui import encode

__all__ = ["snapshot_frames", "to_agui_messages"]


def to_agui_messages(context: list[Msg]) -> list[Message]:
    """The session's messages as AG-UI messages: user text, assistant text with its tool calls,
    one tool message per result (system messages are the server's, not shown)."""
    out: list[Message] = []
    for msg in context:
        if msg.role == "user":
            out.append(UserMessage(id=msg.id, content=msg.text))
        elif msg.role == "assistant":
            calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=json.dumps(c.input)))
                     for c in msg.tool_calls]
            out.append(AssistantMessage(id=msg.id, content=msg.text or None, tool_calls=calls or None))
        if msg.role in ("assistant", "tool"):
            for r in msg.tool_results:
                error = r.text if r.state is ToolResultState.ERROR else None
                out.append(ToolMessage(id=f"{msg.id}:{r.id}", content=r.text, tool_call_id=r.id, error=error))
    return out


def snapshot_frames(thread_id: str, run_id: str, context: list[Msg]) -> bytes:
    return encode([
        RunStartedEvent(thread_id=thread_id, run_id=run_id),
        MessagesSnapshotEvent(messages=to_agui_messages(context)),
        RunFinishedEvent(thread_id=thread_id, run_id=run_id),
    ])
