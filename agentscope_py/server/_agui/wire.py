"""AG-UI lifecycle events as the JSON objects they are on the wire, without building their models.

Why: a served run sends a dozen lifecycle events per model call (RUN_STARTED, STEP_STARTED /
FINISHED, TEXT_MESSAGE_START / END, RUN_FINISHED…); building each as its ``ag_ui.core`` model
(pydantic validation) and then reading the model back to encode it was about as much work per
request as relaying a dozen tokens. These functions make the dict the official encoder would write
(``model_dump_json(by_alias=True)``: keys by alias, in the model's field order, fields without a
value left out), which orjson writes as it is.

Only events whose every value is a ``str`` (or a list of plain ints and strs) are made here; an
event carrying a caller's value (CUSTOM, a RUN_FINISHED with a result or interrupts, SUBAGENT_*)
stays a model. `to_model` turns a wire event back into its model (`AguiMapper.map` hands out
models), and `FrameEncoder` writes a wire event through the official encoder whenever orjson
refuses a value. tests/server/test_agui_wire.py holds every kind byte for byte equal to its model's
official frame.
"""

from __future__ import annotations

from typing import Any

from ag_ui.core import (
    BaseEvent,
    ReasoningEndEvent,
    ReasoningMessageContentEvent,
    ReasoningMessageEndEvent,
    ReasoningMessageStartEvent,
    ReasoningStartEvent,
    RunErrorEvent,
    RunFinishedEvent,
    RunStartedEvent,
    StepFinishedEvent,
    StepStartedEvent,
    TextMessageContentEvent,
    TextMessageEndEvent,
    TextMessageStartEvent,
    TokenUsage,
    ToolCallArgsEvent,
    ToolCallEndEvent,
    ToolCallResultEvent,
    ToolCallStartEvent,
)

__all__ = ["AguiEvent", "WireEvent", "models", "to_model"]

WireEvent = dict[str, Any]
"""An AG-UI event as its JSON object: ``{"type": "RUN_STARTED", "threadId": …, …}``."""

AguiEvent = BaseEvent | WireEvent
"""What the mapper collects: a model, or (for the lifecycle events) its wire form."""

_MAX_COUNT = 2**53 - 1  # `TokenUsage`'s bound on each count (JSON's safe integers)

_CLASSES: dict[str, type[BaseEvent]] = {
    cls.model_fields["type"].default.value: cls
    for cls in (RunStartedEvent, RunFinishedEvent, RunErrorEvent, StepStartedEvent, StepFinishedEvent,
                TextMessageStartEvent, TextMessageContentEvent, TextMessageEndEvent, ReasoningStartEvent,
                ReasoningMessageStartEvent, ReasoningMessageContentEvent, ReasoningMessageEndEvent,
                ReasoningEndEvent, ToolCallStartEvent, ToolCallArgsEvent, ToolCallEndEvent, ToolCallResultEvent)
}


def to_model(event: AguiEvent) -> BaseEvent:
    """The ``ag_ui.core`` model of a wire event (a model is returned as it is)."""
    if type(event) is not dict:
        return event  # type: ignore[return-value]
    return _CLASSES[event["type"]].model_validate(event)


def models(events: list[AguiEvent]) -> list[BaseEvent]:
    return [to_model(e) for e in events]


# -- the events (each dict's keys in its model's field order, as the official encoder writes them) -


def run_started(thread_id: str, run_id: str) -> WireEvent:
    return {"type": "RUN_STARTED", "threadId": thread_id, "runId": run_id}


def run_finished(thread_id: str, run_id: str, outcome: WireEvent, usage: list[WireEvent] | None) -> WireEvent:
    """RUN_FINISHED without a result (a result goes after ``runId``, and is the caller's value:
    that event stays a model)."""
    event: WireEvent = {"type": "RUN_FINISHED", "threadId": thread_id, "runId": run_id, "outcome": outcome}
    if usage is not None:
        event["usage"] = usage
    return event


def success(pending_tool_call_ids: list[str] | None = None) -> WireEvent:
    if pending_tool_call_ids is None:
        return {"type": "success"}
    return {"type": "success", "pendingToolCallIds": pending_tool_call_ids}


def cancelled() -> WireEvent:
    return {"type": "cancelled"}


def run_error(message: str, code: str, usage: list[WireEvent] | None = None) -> WireEvent:
    event: WireEvent = {"type": "RUN_ERROR", "message": message, "code": code}
    if usage is not None:
        event["usage"] = usage
    return event


def token_usage(model: str | None, input_tokens: int, output_tokens: int, total_tokens: int,
                reasoning_tokens: int | None, cached_input_tokens: int | None,
                cache_write_input_tokens: int | None) -> WireEvent:
    counts = (input_tokens, output_tokens, total_tokens, reasoning_tokens, cached_input_tokens,
              cache_write_input_tokens)
    if not all(c is None or 0 <= c <= _MAX_COUNT for c in counts):
        # The model's bounds: building it raises its ValidationError, as the model always did.
        TokenUsage(model=model, input_tokens=input_tokens, output_tokens=output_tokens,
                   total_tokens=total_tokens, reasoning_tokens=reasoning_tokens,
                   cached_input_tokens=cached_input_tokens, cache_write_input_tokens=cache_write_input_tokens)
    usage: WireEvent = {} if model is None else {"model": model}
    usage["inputTokens"] = input_tokens
    usage["outputTokens"] = output_tokens
    usage["totalTokens"] = total_tokens
    if reasoning_tokens is not None:
        usage["reasoningTokens"] = reasoning_tokens
    if cached_input_tokens is not None:
        usage["cachedInputTokens"] = cached_input_tokens
    if cache_write_input_tokens is not None:
        usage["cacheWriteInputTokens"] = cache_write_input_tokens
    return usage


def step_started(step_name: str) -> WireEvent:
    return {"type": "STEP_STARTED", "stepName": step_name}


def step_finished(step_name: str) -> WireEvent:
    return {"type": "STEP_FINISHED", "stepName": step_name}


def text_start(message_id: str) -> WireEvent:
    return {"type": "TEXT_MESSAGE_START", "messageId": message_id, "role": "assistant"}


def text_content(message_id: str, delta: str) -> WireEvent:
    return {"type": "TEXT_MESSAGE_CONTENT", "messageId": message_id, "delta": delta}


def text_end(message_id: str) -> WireEvent:
    return {"type": "TEXT_MESSAGE_END", "messageId": message_id}


def reasoning_start(message_id: str) -> WireEvent:
    return {"type": "REASONING_START", "messageId": message_id}


def reasoning_message_start(message_id: str) -> WireEvent:
    return {"type": "REASONING_MESSAGE_START", "messageId": message_id, "role": "reasoning"}


def reasoning_content(message_id: str, delta: str) -> WireEvent:
    return {"type": "REASONING_MESSAGE_CONTENT", "messageId": message_id, "delta": delta}


def reasoning_message_end(message_id: str) -> WireEvent:
    return {"type": "REASONING_MESSAGE_END", "messageId": message_id}


def reasoning_end(message_id: str) -> WireEvent:
    return {"type": "REASONING_END", "messageId": message_id}


def tool_call_start(tool_call_id: str, tool_call_name: str, parent_message_id: str) -> WireEvent:
    return {"type": "TOOL_CALL_START", "toolCallId": tool_call_id, "toolCallName": tool_call_name,
            "parentMessageId": parent_message_id}


def tool_call_args(tool_call_id: str, delta: str) -> WireEvent:
    return {"type": "TOOL_CALL_ARGS", "toolCallId": tool_call_id, "delta": delta}


def tool_call_end(tool_call_id: str) -> WireEvent:
    return {"type": "TOOL_CALL_END", "toolCallId": tool_call_id}


def tool_call_result(message_id: str, tool_call_id: str, content: str, state: str) -> WireEvent:
    # ``metadata`` is declared on the base event, before the event's own fields.
    return {"type": "TOOL_CALL_RESULT", "metadata": {"state": state}, "messageId": message_id,
            "toolCallId": tool_call_id, "content": content, "role": "tool"}


def attribute(event: WireEvent, subagent_run_id: str) -> None:
    """Marks a wire event as a sub-agent's, in place: ``subagentRunId`` is declared right after
    the base event's fields, before the event's own (``metadata`` stays first, as declared)."""
    rest = list(event.items())
    event.clear()
    event["type"] = rest[0][1]
    if rest[1][0] == "metadata":
        event["metadata"] = rest.pop(1)[1]
    event["subagentRunId"] = subagent_run_id
    event.update(rest[1:])
