"""The typed events an agent run emits.

Every run is a stream of `AgentEvent`s, a discriminated union on the literal ``type``. Every event
carries ``id``, ``created_at`` (epoch seconds), ``source`` (``None`` at top level; a
``"parent/child"`` path for events forwarded from a sub-agent) and ``metadata``. Events are
immutable and round-trip through JSON: ``parse_event(e.model_dump_json()) == e``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError

from .message import (
    ChatUsage,
    DataBlock,
    GenerateReason,
    Msg,
    ToolResultBlock,
    ToolResultState,
    ToolUseBlock,
    id_factory,
)

__all__ = [
    "AgentEnd", "AgentEvent", "AgentResult", "AgentStart", "AllToolsDenied", "CacheLayoutChanged",
    "ChatUsage", "Compressed", "ConfirmResult", "Custom", "DataBlockDelta", "DataBlockEnd", "DataBlockStart",
    "EventBase", "ExceedMaxIters", "ExternalExecutionResult", "GenerateReason", "GuardrailTripped",
    "HintBlock", "MiddlewareCompleted", "MiddlewareStarted", "ModelCallEnd", "ModelCallStart", "RequestStop",
    "RequireExternalExecution", "RequireUserConfirm", "TextBlockDelta", "TextBlockEnd", "TextBlockStart",
    "ThinkingBlockDelta", "ThinkingBlockEnd", "ThinkingBlockStart", "ToolCallDelta", "ToolCallEnd",
    "ToolCallStart", "ToolInDoubt", "ToolResultDataDelta", "ToolResultEnd", "ToolResultStart", "ToolResultState",
    "ToolResultTextDelta", "UserConfirmResult", "parse_event",
]


_event_id = id_factory("ev_")


class EventBase(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str = Field(default_factory=_event_id)
    created_at: float = Field(default_factory=time.time)
    source: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


# -- run lifecycle -------------------------------------------------------------------------------


class AgentStart(EventBase):
    type: Literal["agent_start"] = "agent_start"
    reply_id: str
    name: str
    session_id: str | None = None


class AgentEnd(EventBase):
    """The run's last event. ``error`` names the exception a failed run raises right after it
    (``"TypeName: message"``); None when the run ended with its `AgentResult`."""

    type: Literal["agent_end"] = "agent_end"
    reply_id: str
    error: str | None = None


class AgentResult(EventBase):
    type: Literal["agent_result"] = "agent_result"
    result: Msg


class ModelCallStart(EventBase):
    type: Literal["model_call_start"] = "model_call_start"
    reply_id: str
    model: str


class ModelCallEnd(EventBase):
    """The end of one model call. ``usage`` is None when the provider reported none (unknown, not
    zero). ``error`` is set (``"Type: message"``) when the call failed, was interrupted or was cut
    short; ``discarded`` is true when its partial reply was not remembered (a failed attempt that a
    retry or fallback replaced, or a run that ended in that error): a UI can strike it out.
    ``model`` names the model that served the call (its ``ModelCallStart.model``), so whoever
    prices ``usage`` prices that model whatever layer switched it; None when no model call made
    the event (a middleware's own reply, a bracket closed for a call cut short)."""

    type: Literal["model_call_end"] = "model_call_end"
    reply_id: str
    usage: ChatUsage | None = None
    finish_reason: str | None = None
    error: str | None = None
    discarded: bool = False
    model: str | None = None


# -- content blocks ------------------------------------------------------------------------------


class TextBlockStart(EventBase):
    type: Literal["text_block_start"] = "text_block_start"
    reply_id: str
    block_id: str


class TextBlockDelta(EventBase):
    type: Literal["text_block_delta"] = "text_block_delta"
    reply_id: str
    block_id: str
    delta: str


class TextBlockEnd(EventBase):
    type: Literal["text_block_end"] = "text_block_end"
    reply_id: str
    block_id: str


class ThinkingBlockStart(EventBase):
    type: Literal["thinking_block_start"] = "thinking_block_start"
    reply_id: str
    block_id: str


class ThinkingBlockDelta(EventBase):
    type: Literal["thinking_block_delta"] = "thinking_block_delta"
    reply_id: str
    block_id: str
    delta: str


class ThinkingBlockEnd(EventBase):
    type: Literal["thinking_block_end"] = "thinking_block_end"
    reply_id: str
    block_id: str
    signature: str | None = None


class DataBlockStart(EventBase):
    type: Literal["data_block_start"] = "data_block_start"
    reply_id: str
    block_id: str
    media_type: str = "application/octet-stream"


class DataBlockDelta(EventBase):
    type: Literal["data_block_delta"] = "data_block_delta"
    reply_id: str
    block_id: str
    delta: str
    """A base64 fragment."""


class DataBlockEnd(EventBase):
    type: Literal["data_block_end"] = "data_block_end"
    reply_id: str
    block_id: str


# -- tool calls and results ----------------------------------------------------------------------


class ToolCallStart(EventBase):
    type: Literal["tool_call_start"] = "tool_call_start"
    reply_id: str
    tool_call_id: str
    tool_name: str


class ToolCallDelta(EventBase):
    type: Literal["tool_call_delta"] = "tool_call_delta"
    reply_id: str
    tool_call_id: str
    tool_name: str
    delta: str
    """A fragment of the argument JSON text."""


class ToolCallEnd(EventBase):
    type: Literal["tool_call_end"] = "tool_call_end"
    reply_id: str
    tool_call_id: str
    tool_name: str


class ToolResultStart(EventBase):
    type: Literal["tool_result_start"] = "tool_result_start"
    reply_id: str
    tool_call_id: str
    tool_name: str


class ToolResultTextDelta(EventBase):
    type: Literal["tool_result_text_delta"] = "tool_result_text_delta"
    reply_id: str
    tool_call_id: str
    tool_name: str
    delta: str


class ToolResultDataDelta(EventBase):
    type: Literal["tool_result_data_delta"] = "tool_result_data_delta"
    reply_id: str
    tool_call_id: str
    tool_name: str
    data: DataBlock


class ToolResultEnd(EventBase):
    type: Literal["tool_result_end"] = "tool_result_end"
    reply_id: str
    tool_call_id: str
    tool_name: str
    state: ToolResultState = ToolResultState.SUCCESS


# -- control flow --------------------------------------------------------------------------------


class ExceedMaxIters(EventBase):
    type: Literal["exceed_max_iters"] = "exceed_max_iters"
    reply_id: str
    max_iters: int
    current_iter: int


class ConfirmResult(BaseModel):
    """A user's answer to one asking tool call; ``input`` replaces the arguments when given;
    ``answer`` answers the question a running tool asked (`ToolInputRequired`: an MCP
    elicitation) when the call runs again."""

    model_config = ConfigDict(frozen=True)

    tool_call_id: str
    confirmed: bool
    input: dict[str, Any] | None = None
    reason: str | None = None
    answer: dict[str, Any] | None = None


class RequireUserConfirm(EventBase):
    type: Literal["require_user_confirm"] = "require_user_confirm"
    reply_id: str
    tool_calls: list[ToolUseBlock]


class UserConfirmResult(EventBase):
    type: Literal["user_confirm_result"] = "user_confirm_result"
    reply_id: str
    confirm_results: list[ConfirmResult]


class ToolInDoubt(EventBase):
    """A resumed run found a tool call in doubt: its intent was recorded, its result never was (the
    process died while it ran), so it may or may not have happened. ``policy`` is what decided,
    ``outcome`` what it decided (`agentscope_py.tool.InDoubtPolicy`: ``"asked"`` — a
    RequireUserConfirm follows and the run pauses —, ``"done"``, ``"not_done"``, ``"retried"``,
    ``"skipped"``, ``"failed"`` — a `ToolInDoubtError` follows); ``idempotency_key`` is the key
    the call ran with (`agentscope_py.tool.IdempotencyKey`)."""

    type: Literal["tool_in_doubt"] = "tool_in_doubt"
    reply_id: str
    tool_call_id: str
    tool_name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    idempotency_key: str
    policy: Literal["ask", "reconcile", "retry"]
    outcome: Literal["asked", "done", "not_done", "retried", "skipped", "failed"]


class RequireExternalExecution(EventBase):
    type: Literal["require_external_execution"] = "require_external_execution"
    reply_id: str
    tool_calls: list[ToolUseBlock]


class ExternalExecutionResult(EventBase):
    type: Literal["external_execution_result"] = "external_execution_result"
    reply_id: str
    tool_results: list[ToolResultBlock]


class RequestStop(EventBase):
    """Asks the loop to stop after the current step; acted on wherever it appears."""

    type: Literal["request_stop"] = "request_stop"
    reason: str = ""
    generate_reason: GenerateReason = GenerateReason.MIDDLEWARE_STOP_REQUESTED


class AllToolsDenied(EventBase):
    type: Literal["all_tools_denied"] = "all_tools_denied"
    reply_id: str
    denied_tool_calls: list[ToolUseBlock]


class HintBlock(EventBase):
    type: Literal["hint_block"] = "hint_block"
    hint_source: str
    hint: str


class Custom(EventBase):
    type: Literal["custom"] = "custom"
    name: str
    value: Any = None


# -- beyond AgentScope Java ----------------------------------------------------------------------


class MiddlewareStarted(EventBase):
    type: Literal["middleware_started"] = "middleware_started"
    middleware: str
    point: str


class MiddlewareCompleted(EventBase):
    type: Literal["middleware_completed"] = "middleware_completed"
    middleware: str
    point: str
    duration_ms: float
    error: str | None = None


class Compressed(EventBase):
    """Older context was condensed into a summary (context-compression middleware)."""

    type: Literal["compressed"] = "compressed"
    removed_messages: int
    kept_messages: int
    summary: str = ""


class CacheLayoutChanged(EventBase):
    """A request's cacheable prefix differs from the session's previous one (``changed``: parts)."""

    type: Literal["cache_layout_changed"] = "cache_layout_changed"
    changed: list[str]
    reply_id: str | None = None


class GuardrailTripped(EventBase):
    """A guardrail stopped the run (`GuardrailMiddleware`, `PIIRedactionMiddleware`'s ``block``):
    ``guardrail`` names the check, ``reason`` says why. The exception of the same name
    (`agentscope_py.errors.GuardrailTripped`) is what a run that ends in error raises; this event
    is what the caller's stream carries either way."""

    type: Literal["guardrail_tripped"] = "guardrail_tripped"
    guardrail: str
    reason: str
    stage: str | None = None
    """``"input"``, ``"stream"`` or ``"output"`` for `GuardrailMiddleware`'s checks."""


AgentEvent = Annotated[
    AgentStart
    | AgentEnd
    | AgentResult
    | ModelCallStart
    | ModelCallEnd
    | TextBlockStart
    | TextBlockDelta
    | TextBlockEnd
    | ThinkingBlockStart
    | ThinkingBlockDelta
    | ThinkingBlockEnd
    | DataBlockStart
    | DataBlockDelta
    | DataBlockEnd
    | ToolCallStart
    | ToolCallDelta
    | ToolCallEnd
    | ToolResultStart
    | ToolResultTextDelta
    | ToolResultDataDelta
    | ToolResultEnd
    | ExceedMaxIters
    | RequireUserConfirm
    | UserConfirmResult
    | ToolInDoubt
    | RequireExternalExecution
    | ExternalExecutionResult
    | RequestStop
    | AllToolsDenied
    | HintBlock
    | Custom
    | MiddlewareStarted
    | MiddlewareCompleted
    | Compressed
    | CacheLayoutChanged
    | GuardrailTripped,
    Field(discriminator="type"),
]

_adapter: TypeAdapter[AgentEvent] = TypeAdapter(AgentEvent)


MAX_EVENT_DEPTH = 200
"""How deep an event may nest (the event itself is level 1): the limit pydantic's JSON parser
puts on event text, applied to a decoded dict too. A value nested deeper cannot be written back
as JSON (the serializer stops at 255) and breaks ``repr``/``copy.deepcopy`` with a
RecursionError, so it is refused where it enters."""


def parse_event(data: str | bytes | dict[str, Any]) -> AgentEvent:
    """Parse one event from its JSON text (or an already-decoded dict). Anything that is not an
    event, or nests deeper than `MAX_EVENT_DEPTH`, raises ``pydantic.ValidationError``."""
    if isinstance(data, dict):
        _check_depth(data)
        return _adapter.validate_python(data)
    return _adapter.validate_json(data)


def _check_depth(data: dict[str, Any]) -> None:
    # Level by level, without recursion: a dict nested any depth costs no Python stack, and a
    # flat event (every delta) costs one pass over its fields.
    level: list[Any] = [data]
    depth = 1
    while level:
        if depth > MAX_EVENT_DEPTH:
            raise ValidationError.from_exception_data("AgentEvent", [{
                "type": PydanticCustomError(
                    "too_deep", "the event nests deeper than {limit} levels: flatten the value (the "
                    "same limit applies to event JSON)", {"limit": MAX_EVENT_DEPTH}),
                "loc": (), "input": "...",
            }])
        below: list[Any] = []
        for value in level:
            for child in value.values() if isinstance(value, dict) else value:
                if isinstance(child, dict | list | tuple):
                    below.append(child)
        level = below
        depth += 1
