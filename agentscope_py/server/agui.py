"""AG-UI 1.0: our `AgentEvent`s of one run as AG-UI events, and AG-UI input as our messages.

`AguiMapper` holds the state of **one run** (which message, reasoning span, tool call and step is
open), so concurrent runs never share it. Feed it every event of the run, then call ``finish()``
(or ``fail(exc)``); it closes whatever is still open before the terminal event, the order the
official client verifies (RUN_STARTED first; RUN_FINISHED only when nothing is open; nothing after
RUN_ERROR). The mapper owns the run's lifecycle (steps, usage, outcome); the open messages and
tool calls are `_agui.content.OpenContent`'s, and the input side is `_agui.input`'s.

==========================  ==================================================================
our event                   AG-UI
==========================  ==================================================================
(run begins)                RUN_STARTED(threadId, runId)
ModelCallStart / End        STEP_STARTED / STEP_FINISHED (stepName ``model:<name>``)
TextBlock*                  TEXT_MESSAGE_START(role=assistant) / CONTENT / END; one messageId
                            per model call, so text and tool calls form one assistant message
ThinkingBlock*              REASONING_START, REASONING_MESSAGE_START / CONTENT / END,
                            REASONING_END (messageId = the block id)
ToolCall*                   TOOL_CALL_START(parentMessageId) / ARGS / END
ToolResult* (text joined)   TOOL_CALL_RESULT(role=tool, new messageId, metadata.state)
RequireUserConfirm          RUN_FINISHED outcome interrupt (one Interrupt per asking call; a call
                            in doubt's: reason ``tool_in_doubt``, its question, payload ``done``)
RequireExternalExecution    RUN_FINISHED outcome success with pendingToolCallIds
reply INTERRUPTED           RUN_FINISHED outcome cancelled
Custom(name, value)         CUSTOM(name, value)
a sub-agent's (``source``)  the same, inside SUBAGENT_STARTED / FINISHED (or ERROR), each event with
                            the invocation's subagentRunId (`_agui.subagents`)
anything else               CUSTOM(name=<event type>, value=<event JSON>)
(run ends / fails)          RUN_FINISHED(usage) / RUN_ERROR(message, code=exception class)
==========================  ==================================================================
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from ag_ui.core import (
    BaseEvent,
    CustomEvent,
    Interrupt,
    RunFinishedEvent,
    RunFinishedInterruptOutcome,
    TokenUsage,
)

from ..events import AgentEnd, AgentEvent, AgentStart, TextBlockDelta
from ..message import ChatUsage, GenerateReason, Msg, ToolResultState, ToolUseBlock
from ._agui import wire
from ._agui.content import CONTENT_HANDLERS, OpenContent, end_step, jsonable, start_step
from ._agui.encode import FrameEncoder
from ._agui.input import (
    AguiInputError,
    SystemPolicy,
    apply_system_policy,
    confirm_results,
    select_new_messages,
    to_msgs,
)
from ._agui.subagents import SUSPENDED, Subagents
from ._agui.wire import AguiEvent, WireEvent, models
from .sse import plain_json

__all__ = [
    "INTERRUPT_REASON",
    "IN_DOUBT_REASON",
    "AguiInputError",
    "AguiMapper",
    "SystemPolicy",
    "apply_system_policy",
    "confirm_results",
    "select_new_messages",
    "to_msgs",
]

INTERRUPT_REASON = "tool_call_confirmation"
"""``Interrupt.reason`` of a tool call waiting for the user's approval."""
IN_DOUBT_REASON = "tool_in_doubt"
"""``Interrupt.reason`` of a tool call in doubt: did it take effect? (docs/tools.md)"""

_ENCODER = FrameEncoder()

# The answer an approval interrupt expects in ``ResumeEntry.payload``.
_RESPONSE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "approved": {"type": "boolean"},
        "input": {"type": "object", "description": "replacement arguments (optional)"},
    },
    "required": ["approved"],
}
# The answer an in-doubt interrupt expects (``status="cancelled"`` skips the call).
_IN_DOUBT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "done": {"type": "boolean", "description": "whether the call took effect (false: run it)"},
        "result": {"description": "the call's result, when it took effect (optional)"},
    },
    "required": ["done"],
}


def encode(events: Iterable[AguiEvent]) -> bytes:
    """SSE frames (``data: <json>\\n\\n`` each) of AG-UI events (models, or the lifecycle
    events' wire dicts, `_agui.wire`): the official encoder's bytes (`FrameEncoder`)."""
    return _ENCODER.encode(events)


class AguiMapper:
    """Maps the events of one run to AG-UI events. Not shared between runs.

    >>> mapper = AguiMapper(thread_id="t1", run_id="r1")
    >>> frames = mapper.encode_start()           # RUN_STARTED
    >>> frames = mapper.encode(event)            # zero or more frames per AgentEvent (bytes)
    >>> frames = mapper.encode_finish()          # closes what is open, then RUN_FINISHED

    ``map(event)`` returns the AG-UI event objects instead of bytes. ``emitted_ids`` collects every
    message id the client will see, so the server can tell them apart from new input later.

    The ``encode*`` methods never build the lifecycle events' models: those are their wire dicts
    (`_agui.wire`), and the public ``start`` / ``map`` / ``finish`` / ``fail`` turn them into models.
    """

    def __init__(self, thread_id: str, run_id: str, *, emitted_ids: set[str] | None = None) -> None:
        self.thread_id = thread_id
        self.run_id = run_id
        self.emitted_ids: set[str] = emitted_ids if emitted_ids is not None else set()
        self.done = False
        self._content = content = OpenContent(self.emitted_ids)
        self._prefixes = content.text_prefixes  # `encode`'s per-token path reads it
        # Made at the first sub-agent event: most runs have none.
        self._subagents: Subagents | None = None
        self._step: str | None = None
        self._usage: dict[str, ChatUsage] = {}  # model name -> summed usage
        self._model = ""
        self._asking: tuple[ToolUseBlock, ...] = ()
        self._doubts: dict[str, dict[str, Any]] = {}  # asking calls in doubt: their question
        self._external: tuple[str, ...] = ()
        self._reason: GenerateReason | None = None
        self._result: Any = None
    # -- public API ------------------------------------------------------------------------------

    def start(self) -> list[BaseEvent]:
        return models(self._start())

    def map(self, event: AgentEvent) -> list[BaseEvent]:
        """The AG-UI events for one of ours (often one, sometimes none or several)."""
        return models(self._map(event))

    def finish(self) -> list[BaseEvent]:
        """Close what is open, then RUN_FINISHED with the outcome and the token usage."""
        return models(self._finish())

    def fail(self, error: BaseException) -> list[BaseEvent]:
        """Close what is open, then RUN_ERROR: the terminal event, nothing may follow it."""
        return models(self._fail(error))

    def encode_start(self) -> bytes:
        return encode(self._start())

    def encode(self, event: AgentEvent) -> bytes:
        """The SSE bytes for one of our events (``b""`` when it maps to nothing)."""
        if type(event) is TextBlockDelta:
            # The per-token path, almost every event of a run: a text delta into an open message
            # of the top level is its frame's constant head (made when the message opened,
            # `OpenContent.text_prefixes`) and the delta's JSON string, in this one call. Its
            # fields are read from its ``__dict__`` (a pydantic model keeps them there): an event
            # class has ``__getattr__``, so each attribute read is a lookup through it.
            fields = event.__dict__
            prefix = self._prefixes.get(fields["block_id"])
            delta = fields["delta"]
            if prefix is not None and delta and fields["source"] is None:
                return b"%b%b}\n\n" % (prefix, plain_json(delta))
        elif type(event) in _SILENT and event.source is None:  # a run's own start and end: no frame
            return b""
        # The other deltas take `OpenContent.delta_frame` (a dict straight to JSON).
        frame = self._content.delta_frame(event) if event.source is None else self._children().delta_frame(event)
        if frame is not None:
            return frame
        out = self._map(event)
        return encode(out) if out else b""

    def encode_finish(self) -> bytes:
        return encode(self._finish())

    def encode_fail(self, error: BaseException, *, message: str | None = None, code: str | None = None) -> bytes:
        """RUN_ERROR's frames (`fail`); ``message`` and ``code`` replace the error's own (the
        server sends a safe message instead of ``str(error)``)."""
        return encode(self._fail(error, message, code))

    # -- the events, as the encoder takes them ----------------------------------------------------

    def _start(self) -> list[AguiEvent]:
        return [wire.run_started(self.thread_id, self.run_id)]

    def _map(self, event: AgentEvent) -> list[AguiEvent]:
        out: list[AguiEvent] = []
        if event.source is not None:  # a sub-agent's event (`_agui.subagents`)
            self._children().map(event, out)
            return out
        kind = event.type
        on_content = CONTENT_HANDLERS.get(kind)
        if on_content is not None:
            on_content(self._content, event, out)
            return out
        handler = _HANDLERS.get(kind)
        if handler is None:
            out.append(CustomEvent(name=kind, value=event.model_dump(mode="json")))
        else:
            handler(self, event, out)
        return out

    def _finish(self) -> list[AguiEvent]:
        interrupted = self._reason is GenerateReason.INTERRUPTED
        out = self._close_all(("the run was interrupted", "interrupted") if interrupted else None)
        usage = self._token_usage()
        interrupts = self._interrupts()
        outcome = (wire.success(list(self._external)) if self._external
                   else wire.cancelled() if interrupted else wire.success())
        if interrupts or self._result is not None:
            # Interrupts or a result are values of the caller's: this event stays a model (the
            # outcome's wire dict validated into its class).
            out.append(RunFinishedEvent(
                thread_id=self.thread_id, run_id=self.run_id, result=self._result,
                outcome=RunFinishedInterruptOutcome(interrupts=interrupts) if interrupts else outcome,  # type: ignore[arg-type]
                usage=[TokenUsage.model_validate(u) for u in usage] if usage is not None else None,
            ))
        else:
            out.append(wire.run_finished(self.thread_id, self.run_id, outcome, usage))
        self.done = True
        return out

    def _fail(self, error: BaseException, message: str | None = None, code: str | None = None) -> list[AguiEvent]:
        # The sub-agents' errors name only the type: the server replaces RUN_ERROR's message with a
        # safe one, and these must not carry what it hides.
        out = self._close_all(("the run failed", type(error).__name__))
        if message is None:
            message = str(error) or type(error).__name__
        out.append(wire.run_error(message, code if code is not None else type(error).__name__, self._token_usage()))
        self.done = True
        return out

    # -- model calls ------------------------------------------------------------------------------

    def _on_model_start(self, ev: Any, out: list[AguiEvent]) -> None:
        self._model = ev.model
        self._step = start_step(self._step, ev.model, self._content, out)

    def _on_model_end(self, ev: Any, out: list[AguiEvent]) -> None:
        if ev.usage is not None:
            self._add_usage(self._model, ev.usage)
        end_step(self._step, ev, self._content, out)
        self._step = None

    def _children(self) -> Subagents:
        if self._subagents is None:
            self._subagents = Subagents(self._content, self.emitted_ids, self._add_usage)
        return self._subagents

    def _add_usage(self, model: str, usage: ChatUsage) -> None:
        before = self._usage.get(model)
        self._usage[model] = usage if before is None else before + usage

    # -- pauses, results, custom events ----------------------------------------------------------

    def _on_confirm(self, ev: Any, out: list[AguiEvent]) -> None:
        self._asking += tuple(ev.tool_calls)
        # A durable run asks about a call in doubt as a tool's question (its metadata's question).
        question = ev.metadata.get("question")
        doubt = ev.metadata if ev.metadata.get("in_doubt") else (
            question if isinstance(question, dict) and question.get("in_doubt") else None)
        if doubt is not None:
            self._doubts.update((c.id, doubt) for c in ev.tool_calls)

    def _on_external(self, ev: Any, out: list[AguiEvent]) -> None:
        self._external += tuple(c.id for c in ev.tool_calls)

    def _on_result(self, ev: Any, out: list[AguiEvent]) -> None:
        msg: Msg = ev.result
        self._reason = msg.generate_reason
        self._result = msg.metadata.get("structured_output")
        if self._result is not None and hasattr(self._result, "model_dump"):
            self._result = self._result.model_dump(mode="json")
        if msg.generate_reason is GenerateReason.TOOL_SUSPENDED and not self._external:
            # Resumed with some results: the calls still waiting are marked RUNNING in the reply.
            self._external = tuple(b.id for b in msg.tool_results if b.state is ToolResultState.RUNNING)

    def _on_custom(self, ev: Any, out: list[AguiEvent]) -> None:
        out.append(CustomEvent(name=ev.name, value=jsonable(ev.value)))

    def _on_result_end(self, ev: Any, out: list[AguiEvent]) -> None:
        children = self._subagents
        if children is not None and children.open:  # a child this call ran and sent no end closes first
            children.close_call(ev.tool_call_id, ev.state.value, out)
        self._content.on_result_end(ev, out)

    # -- closing ---------------------------------------------------------------------------------

    def _interrupts(self) -> list[Interrupt]:
        interrupts = [_interrupt(c, self._doubts.get(c.id)) for c in self._asking]
        if self._reason in SUSPENDED and self._subagents is not None:
            # A child's approval request is the run's when the run itself paused on it (the
            # parent waits for the child); a child that asked and then let its parent go on is
            # not waiting for anyone.
            seen = {c.id for c in self._asking}
            for call, run_id in self._subagents.asking:
                if call.id not in seen:
                    seen.add(call.id)
                    interrupts.append(_interrupt(call).model_copy(update={"subagent_run_id": run_id}))
        return interrupts

    def _close_all(self, error: tuple[str, str] | None = None) -> list[AguiEvent]:
        out: list[AguiEvent] = []
        children = self._subagents
        if children is not None and children.open:
            children.close_all(out, error)
        out.extend(self._content.close())
        if self._step is not None:
            out.append(wire.step_finished(self._step))
            self._step = None
        return out

    def _token_usage(self) -> list[WireEvent] | None:
        if not self._usage:
            return None
        return [
            wire.token_usage(model or None, u.input_tokens, u.output_tokens, u.total_tokens,
                             u.reasoning_tokens or None, u.cache_read_tokens or None, u.cache_write_tokens or None)
            for model, u in self._usage.items()
        ]


def _ignore(mapper: AguiMapper, ev: Any, out: list[AguiEvent]) -> None:
    return None


_SILENT = frozenset({AgentStart, AgentEnd})
"""The classes whose events (at the top level) map to nothing (`_ignore`): `AguiMapper.encode`
answers them first, as every run has one of each."""


# What each event type maps through: tables of plain functions, called with the mapper or its
# `OpenContent` (the content events' table is `_agui.content.CONTENT_HANDLERS`, the sub-agents' too).
_HANDLERS: dict[str, Callable[[AguiMapper, Any, list[AguiEvent]], None]] = {
    "agent_start": _ignore,
    "agent_end": _ignore,
    "agent_result": AguiMapper._on_result,
    "model_call_start": AguiMapper._on_model_start,
    "model_call_end": AguiMapper._on_model_end,
    "tool_result_end": AguiMapper._on_result_end,
    "require_user_confirm": AguiMapper._on_confirm,
    "require_external_execution": AguiMapper._on_external,
    "custom": AguiMapper._on_custom,
}


def _interrupt(call: ToolUseBlock, doubt: dict[str, Any] | None = None) -> Interrupt:
    if doubt is not None:
        return Interrupt(id=call.id, reason=IN_DOUBT_REASON, tool_call_id=call.id, message=str(doubt["question"]),
                         response_schema=_IN_DOUBT_SCHEMA, metadata={
                             "toolName": call.name, "arguments": call.input,
                             "idempotencyKey": doubt.get("idempotency_key")})
    args = json.dumps(call.input, ensure_ascii=False)
    return Interrupt(
        id=call.id,
        reason=INTERRUPT_REASON,
        tool_call_id=call.id,
        message=f"Allow {call.name}({args})?",
        response_schema=_RESPONSE_SCHEMA,
        metadata={"toolName": call.name, "arguments": call.input},
    )

