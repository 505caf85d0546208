"""The content of one AG-UI run: which text message, reasoning message and tool call is open, and
the tool results being gathered — the bookkeeping behind `AguiMapper`, kept apart from the run's
lifecycle (steps, usage, outcome), which the mapper owns.

One assistant message per model call: text blocks and tool calls of a call share its id (a second
text block open at the same time gets its own). Every id a client will see is added to
``emitted_ids``, so the server tells them apart from new input later.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any, cast

from ag_ui.core import CustomEvent

from ...events import AgentEvent, TextBlockDelta, ThinkingBlockDelta, ToolCallDelta
from ...message import new_id
from .. import sse
from . import wire
from .wire import AguiEvent

__all__ = ["CONTENT_HANDLERS", "OpenContent", "attribute", "end_step", "jsonable", "start_step"]


class OpenContent:
    """The open messages and tool calls of one run. Each ``on_*`` method appends the AG-UI
    events for one of our events to ``out``."""

    __slots__ = ("_frame", "assistant_id", "call_messages", "calls", "emitted_ids", "reasoning", "results",
                 "running", "text_prefixes", "texts")

    def __init__(self, emitted_ids: set[str], subagent_run_id: str | None = None) -> None:
        self.emitted_ids = emitted_ids
        self.assistant_id: str | None = None  # the message of the current model call
        self.texts: dict[str, str] = {}  # open text block id -> message id
        # Open text block id -> its TEXT_MESSAGE_CONTENT frame up to the delta's JSON string (the
        # top level's only): `AguiMapper.encode` writes a token as this head, the string and `}`.
        self.text_prefixes: dict[str, bytes] = {}
        # Dicts as ordered sets: they close in opening order.
        self.reasoning: dict[str, None] = {}  # open reasoning message ids (= thinking block ids)
        self.calls: dict[str, None] = {}  # open tool call ids (arguments still streaming)
        self.results: dict[str, list[str]] = {}  # tool call id -> result text so far
        # For sub-agents (`_agui.subagents`): the tools running now (call id -> tool name, in
        # start order) and the assistant message that carried each call.
        self.running: dict[str, str] = {}
        self.call_messages: dict[str, str] = {}
        # A sub-agent's content frames carry its subagentRunId; the top level's stay as they were.
        self._frame = _frame if subagent_run_id is None else partial(_sub_frame, subagent_run_id)

    def new_model_call(self) -> None:
        # The runtime closes every block of a model call before the next starts (its closing
        # guarantee): this follows its End events and closes nothing on its own here.
        self.assistant_id = new_id("msg_")

    def delta_frame(self, event: AgentEvent) -> bytes | None:
        """The SSE frame of a delta into something open, built straight from a dict (by orjson,
        or by pydantic-core, the serializer ``EventEncoder`` ends in: the same bytes, a test holds
        them equal, at a fraction of the cost of building the model); None for anything else."""
        if isinstance(event, TextBlockDelta):
            message_id = self.texts.get(event.block_id)
            if message_id is not None and event.delta:
                return self._frame("TEXT_MESSAGE_CONTENT", "messageId", message_id, event.delta)
        elif isinstance(event, ThinkingBlockDelta):
            if event.block_id in self.reasoning and event.delta:
                return self._frame("REASONING_MESSAGE_CONTENT", "messageId", event.block_id, event.delta)
        elif isinstance(event, ToolCallDelta) and event.tool_call_id in self.calls and event.delta:
            return self._frame("TOOL_CALL_ARGS", "toolCallId", event.tool_call_id, event.delta)
        return None

    def close(self) -> list[AguiEvent]:
        """End events for everything still open (before a terminal event)."""
        out: list[AguiEvent] = []
        for block_id in list(self.reasoning):
            out.append(wire.reasoning_message_end(block_id))
            out.append(wire.reasoning_end(block_id))
        self.reasoning.clear()
        out.extend(wire.text_end(m) for m in self.texts.values())
        self.texts.clear()
        self.text_prefixes.clear()
        out.extend(wire.tool_call_end(c) for c in self.calls)
        self.calls.clear()
        return out

    def _assistant(self) -> str:
        if self.assistant_id is None:  # content outside a model call (a middleware's own text)
            self.assistant_id = new_id("msg_")
        return self.assistant_id

    # -- text and reasoning ----------------------------------------------------------------------

    def on_text_start(self, ev: Any, out: list[AguiEvent]) -> None:
        self._open_text(ev.block_id, out)

    def _open_text(self, block_id: str, out: list[AguiEvent]) -> str:
        message_id = self._assistant()
        if message_id in self.texts.values():  # two text blocks open at once: keep them apart
            message_id = new_id("msg_")
        self.texts[block_id] = message_id
        if self._frame is _frame:  # the top level's
            head = _frame("TEXT_MESSAGE_CONTENT", "messageId", message_id, "")
            self.text_prefixes[block_id] = head[:head.rindex(b'""}')]
        self.emitted_ids.add(message_id)
        out.append(wire.text_start(message_id))
        return message_id

    def on_text_delta(self, ev: Any, out: list[AguiEvent]) -> None:
        if not ev.delta:  # AG-UI rejects empty deltas
            return
        message_id = self.texts.get(ev.block_id) or self._open_text(ev.block_id, out)
        out.append(wire.text_content(message_id, ev.delta))

    def on_text_end(self, ev: Any, out: list[AguiEvent]) -> None:
        message_id = self.texts.pop(ev.block_id, None)
        self.text_prefixes.pop(ev.block_id, None)
        if message_id is not None:
            out.append(wire.text_end(message_id))

    def on_thinking_start(self, ev: Any, out: list[AguiEvent]) -> None:
        self._open_reasoning(ev.block_id, out)

    def _open_reasoning(self, block_id: str, out: list[AguiEvent]) -> None:
        self.reasoning[block_id] = None
        self.emitted_ids.add(block_id)
        out.append(wire.reasoning_start(block_id))
        out.append(wire.reasoning_message_start(block_id))

    def on_thinking_delta(self, ev: Any, out: list[AguiEvent]) -> None:
        if not ev.delta:
            return
        if ev.block_id not in self.reasoning:
            self._open_reasoning(ev.block_id, out)
        out.append(wire.reasoning_content(ev.block_id, ev.delta))

    def on_thinking_end(self, ev: Any, out: list[AguiEvent]) -> None:
        if ev.block_id in self.reasoning:
            del self.reasoning[ev.block_id]
            out.append(wire.reasoning_message_end(ev.block_id))
            out.append(wire.reasoning_end(ev.block_id))

    # -- tool calls and results ------------------------------------------------------------------

    def on_call_start(self, ev: Any, out: list[AguiEvent]) -> None:
        self._open_call(ev.tool_call_id, ev.tool_name, out)

    def _open_call(self, call_id: str, name: str, out: list[AguiEvent]) -> None:
        parent = self._assistant()
        self.emitted_ids.add(parent)
        self.calls[call_id] = None
        self.call_messages[call_id] = parent
        out.append(wire.tool_call_start(call_id, name, parent))

    def on_call_delta(self, ev: Any, out: list[AguiEvent]) -> None:
        if ev.tool_call_id not in self.calls:
            self._open_call(ev.tool_call_id, ev.tool_name, out)
        if ev.delta:
            out.append(wire.tool_call_args(ev.tool_call_id, ev.delta))

    def on_call_end(self, ev: Any, out: list[AguiEvent]) -> None:
        if ev.tool_call_id in self.calls:
            del self.calls[ev.tool_call_id]
            out.append(wire.tool_call_end(ev.tool_call_id))

    def on_result_start(self, ev: Any, out: list[AguiEvent]) -> None:
        # The arguments are complete before the tool runs, whatever the producer did.
        self.on_call_end(ev, out)
        self.results[ev.tool_call_id] = []
        self.running[ev.tool_call_id] = ev.tool_name

    def on_result_delta(self, ev: Any, out: list[AguiEvent]) -> None:
        self.results.setdefault(ev.tool_call_id, []).append(ev.delta)

    def on_result_end(self, ev: Any, out: list[AguiEvent]) -> None:
        self.on_call_end(ev, out)
        self.running.pop(ev.tool_call_id, None)
        self.call_messages.pop(ev.tool_call_id, None)
        text = "".join(self.results.pop(ev.tool_call_id, ()))
        message_id = new_id("toolmsg_")
        self.emitted_ids.add(message_id)
        # AG-UI has no error flag on results; the page reads ``metadata.state``.
        out.append(wire.tool_call_result(message_id, ev.tool_call_id, text, ev.state.value))


def _frame(event_type: str, id_key: str, id_value: str, delta: str) -> bytes:
    return b"data: %b\n\n" % sse.plain_json({"type": event_type, id_key: id_value, "delta": delta})


def _sub_frame(subagent_run_id: str, event_type: str, id_key: str, id_value: str, delta: str) -> bytes:
    # The key order of the official encoder: subagentRunId comes before the event's own fields.
    data = {"type": event_type, "subagentRunId": subagent_run_id, id_key: id_value, "delta": delta}
    return b"data: %b\n\n" % sse.plain_json(data)


# -- model calls as steps (the top level's and each sub-agent's) ------------------------------------


def start_step(open_step: str | None, model: str, content: OpenContent, out: list[AguiEvent]) -> str:
    """STEP_STARTED for a model call (after closing ``open_step``); returns the new step name."""
    if open_step is not None:
        out.append(wire.step_finished(open_step))
    step = f"model:{model}"
    content.new_model_call()
    out.append(wire.step_started(step))
    return step


def end_step(open_step: str | None, ev: Any, content: OpenContent, out: list[AguiEvent]) -> None:
    """The end of a model call: a discarded attempt is reported, then its step finishes."""
    assistant_id = content.assistant_id
    if ev.discarded and assistant_id is not None:
        # A failed attempt that a retry or fallback replaced (or a run that failed): a client
        # can strike out what it showed of it.
        # Only the error's type: its text may carry internals (server/_errors keeps those in the log).
        error = ev.error.split(":", 1)[0] if ev.error else None
        out.append(CustomEvent(name="model_call_discarded", value={"messageId": assistant_id, "error": error}))
    if open_step is not None:
        out.append(wire.step_finished(open_step))


def attribute(events: list[AguiEvent], subagent_run_id: str) -> None:
    """Marks ``events`` as a sub-agent's, in place: every event a sub-agent's content produces has
    the field (AG-UI's "attributable" events), `BaseEvent` itself does not declare it."""
    for e in events:
        if type(e) is dict:
            wire.attribute(e, subagent_run_id)
        else:
            cast(Any, e).subagent_run_id = subagent_run_id


def jsonable(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return json.loads(json.dumps(value, default=str))
    return value


CONTENT_HANDLERS: dict[str, Callable[[OpenContent, Any, list[AguiEvent]], None]] = {
    "text_block_start": OpenContent.on_text_start,
    "text_block_delta": OpenContent.on_text_delta,
    "text_block_end": OpenContent.on_text_end,
    "thinking_block_start": OpenContent.on_thinking_start,
    "thinking_block_delta": OpenContent.on_thinking_delta,
    "thinking_block_end": OpenContent.on_thinking_end,
    "tool_call_start": OpenContent.on_call_start,
    "tool_call_delta": OpenContent.on_call_delta,
    "tool_call_end": OpenContent.on_call_end,
    "tool_result_start": OpenContent.on_result_start,
    "tool_result_text_delta": OpenContent.on_result_delta,
}
"""Our content events, each handled by an `OpenContent` (the top level's, or a sub-agent
invocation's, `_agui.subagents`): one table for both, at module level."""
