"""AG-UI input as our messages: which of a client's messages are new to the session, what they
become (``to_msgs``; client system messages by `SystemPolicy`), and resume entries as confirm
results. `agui` re-exports these names."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from ag_ui.core import (
    AssistantMessage,
    DeveloperMessage,
    Message,
    ResumeEntry,
    SystemMessage,
    ToolMessage,
    UserMessage,
)

from ..._trusted import shape
from ...events import ConfirmResult
from ...message import Block, DataBlock, Msg, TextBlock, ToolResultBlock, ToolResultState, ToolUseBlock

__all__ = ["AguiInputError", "SystemPolicy", "apply_system_policy", "confirm_results", "select_new_messages", "to_msgs"]


SystemPolicy = Literal["drop", "user", "system"]
"""What becomes of system and developer messages a client sends: dropped (the default: a client
must not outrank the developer's instructions), kept as ``user`` messages, or trusted as
``system`` ones."""


_USER = shape(Msg, "id", "role", "name", "content")
_TEXT = shape(TextBlock, "text")
"""A user's text message, built from what `RunAgentInput` validated (exact ``str`` values) without
validating it again: one per run."""


class AguiInputError(ValueError):
    """A RunAgentInput that validates against the schema but cannot be run (the server answers 422)."""


def select_new_messages(
    messages: Sequence[Message], remembered: Sequence[Msg], emitted_ids: set[str]
) -> list[Message]:
    """The messages of a RunAgentInput the session has not seen yet.

    AG-UI clients resend the whole conversation every run; the thread's memory already holds it.
    A message counts as seen when its id is a remembered message id or one this server emitted, a
    tool message answers a call whose result is remembered, or an assistant message carries
    remembered tool calls or a remembered reply's text (so a restarted server with a persistent
    store still recognises its own replies). Everything up to the last seen message is old;
    what follows is new. Reasoning and activity messages are never input, nor a sub-agent's.
    """
    remembered_ids = {m.id for m in remembered}
    result_ids = {b.id for m in remembered for b in m.tool_results}
    call_ids = {c.id for m in remembered for c in m.tool_calls}
    texts = {m.text for m in remembered if m.role == "assistant" and m.text}

    def seen(m: Message) -> bool:
        if m.id in remembered_ids or m.id in emitted_ids:
            return True
        if isinstance(m, ToolMessage):
            return m.tool_call_id in result_ids
        if isinstance(m, AssistantMessage):
            if any(tc.id in call_ids for tc in m.tool_calls or ()):
                return True
            return bool(m.content) and m.content in texts
        return False

    last_seen = -1
    for i, m in enumerate(messages):
        if seen(m):
            last_seen = i
    # A sub-agent's messages (``subagentRunId``, see `_agui.subagents`) are its session's, never
    # the parent's input, even when the parent's memory is gone and the history is all there is.
    return [m for m in messages[last_seen + 1:]
            if m.role not in ("reasoning", "activity") and m.subagent_run_id is None]


def to_msgs(messages: Sequence[Message], history: Sequence[Message] = (), *,
            system: SystemPolicy = "drop") -> list[Msg]:
    """Our messages for AG-UI ones (ids kept). ``history`` is searched for the names of the tools
    that tool messages answer; ``system`` says what becomes of system and developer messages.
    Raises `AguiInputError` for content we cannot represent."""
    names = {tc.id: tc.function.name for m in history if isinstance(m, AssistantMessage)
             for tc in m.tool_calls or ()}
    out: list[Msg] = []
    for m in messages:
        if isinstance(m, UserMessage):
            if type(m.content) is str and type(m.id) is str and (m.name is None or type(m.name) is str):
                out.append(_USER.build(id=m.id, role="user", name=m.name, content=[_TEXT.build(text=m.content)]))
            else:
                out.append(Msg(id=m.id, role="user", name=m.name, content=_user_content(m)))
        elif isinstance(m, SystemMessage | DeveloperMessage):
            if system != "drop":
                out.append(Msg(id=m.id, role=system, content=[TextBlock(text=m.content)]))
        elif isinstance(m, AssistantMessage):
            content: list[Block] = [TextBlock(text=m.content)] if m.content else []
            content.extend(tool_use_block(tc.id, tc.function.name, tc.function.arguments) for tc in m.tool_calls or ())
            out.append(Msg(id=m.id, role="assistant", name=m.name, content=content))
        elif isinstance(m, ToolMessage):
            text = m.content if isinstance(m.content, str) else _parts_text(m.content)
            state = ToolResultState.ERROR if m.error else ToolResultState.SUCCESS
            output = f"{text}\n{m.error}".strip() if m.error else text
            block = ToolResultBlock(id=m.tool_call_id, name=names.get(m.tool_call_id, ""), output=output, state=state)
            out.append(Msg(id=m.id, role="tool", content=[block]))
    return out


def apply_system_policy(msgs: Sequence[Msg], system: SystemPolicy) -> list[Msg]:
    """``msgs`` with their system messages dropped or made user messages, as ``system`` says."""
    if system == "system":
        return list(msgs)
    return [m if m.role != "system" else m.model_copy(update={"role": "user"})
            for m in msgs if m.role != "system" or system == "user"]


def confirm_results(resume: Sequence[ResumeEntry]) -> list[ConfirmResult]:
    """Answers to approval interrupts: ``status="resolved"`` with ``payload.approved`` (default
    true) and optional ``payload.input`` (replacement arguments); ``"cancelled"`` denies. An
    in-doubt interrupt's ``payload.done`` (and ``payload.result``) says whether the call took
    effect."""
    out: list[ConfirmResult] = []
    for entry in resume:
        payload = entry.payload if isinstance(entry.payload, dict) else {}
        approved = entry.status == "resolved" and payload.get("approved", True) is not False
        new_input = payload.get("input")
        if new_input is not None and not isinstance(new_input, dict):
            raise AguiInputError(f"resume[{entry.interrupt_id}].payload.input must be an object")
        reason = payload.get("reason")
        done = payload.get("done")
        if done is not None and not isinstance(done, bool):
            raise AguiInputError(f"resume[{entry.interrupt_id}].payload.done must be true or false")
        out.append(ConfirmResult(
            tool_call_id=entry.interrupt_id, confirmed=approved, input=new_input if approved else None,
            reason=reason if isinstance(reason, str) else None,
            answer=None if done is None else {"done": done, "result": payload.get("result")},
        ))
    return out


def tool_use_block(call_id: str, name: str, arguments: str) -> ToolUseBlock:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        value = None
    if isinstance(value, dict):
        return ToolUseBlock(id=call_id, name=name, input=value)
    return ToolUseBlock(id=call_id, name=name, input={}, raw_input=arguments)


def _user_content(m: UserMessage) -> list[Block]:
    if isinstance(m.content, str):
        return [TextBlock(text=m.content)]
    blocks: list[Block] = []
    for part in m.content:
        kind = getattr(part, "type", None)
        if kind == "text":
            blocks.append(TextBlock(text=part.text))  # type: ignore[union-attr]
            continue
        source = getattr(part, "source", None)
        if source is None:
            raise AguiInputError(f"message {m.id}: unsupported content part {kind!r}")
        media_type = getattr(source, "mime_type", None) or "application/octet-stream"
        if source.type == "data":
            blocks.append(DataBlock(media_type=media_type, data=source.value))
        elif source.type == "url":
            blocks.append(DataBlock(media_type=media_type, url=source.value))
        else:
            raise AguiInputError(f"message {m.id}: {kind} parts with a {source.type!r} source are not supported")
    return blocks


def _parts_text(parts: Sequence[Any]) -> str:
    return "".join(getattr(p, "text", "") for p in parts)
