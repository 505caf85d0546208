"""`FrameEncoder` writes the official ``ag_ui`` encoder's bytes, event for event: for every kind
of AG-UI event the server sends, with the values that make JSON writers differ (unicode, control
characters, separators, nested models, omitted and kept nulls, extra fields), and for the values
it hands back to the official encoder (floats, ints past 64 bits, tuples)."""

from __future__ import annotations

from typing import Any

import pytest
from ag_ui.core import (
    AssistantMessage,
    BaseEvent,
    CustomEvent,
    FunctionCall,
    Interrupt,
    MessagesSnapshotEvent,
    ReasoningEndEvent,
    ReasoningMessageContentEvent,
    ReasoningMessageEndEvent,
    ReasoningMessageStartEvent,
    ReasoningStartEvent,
    RunAgentInput,
    RunErrorEvent,
    RunFinishedCancelledOutcome,
    RunFinishedEvent,
    RunFinishedInterruptOutcome,
    RunFinishedSuccessOutcome,
    RunStartedEvent,
    StepFinishedEvent,
    StepStartedEvent,
    TextMessageContentEvent,
    TextMessageEndEvent,
    TextMessageStartEvent,
    TokenUsage,
    ToolCall,
    ToolCallArgsEvent,
    ToolCallEndEvent,
    ToolCallResultEvent,
    ToolCallStartEvent,
    ToolMessage,
    UserMessage,
)
from ag_ui.encoder import EventEncoder

from agentscope_py.server._agui.content import attribute
from agentscope_py.server._agui.encode import FrameEncoder

TEXTS = ["plain", "naïve ☃ 😀", 'quote " backslash \\ slash /', "line\nbreak\ttab\r\x00\x1f\x7f",
         "\u2028\u2029\u0085 form\x0c feed", "<script>&amp;</script>", ""]

USAGE = [TokenUsage(model="m", input_tokens=10, output_tokens=5, total_tokens=15),
         TokenUsage(model=None, input_tokens=0, output_tokens=0, total_tokens=0, reasoning_tokens=3,
                    cached_input_tokens=2, cache_write_input_tokens=None)]


def _events() -> list[BaseEvent]:
    events: list[BaseEvent] = []
    for text in TEXTS:
        events += [
            RunStartedEvent(thread_id=text or "t", run_id="r"),
            StepStartedEvent(step_name=f"model:{text}"),
            TextMessageStartEvent(message_id="msg_1", role="assistant"),
            TextMessageContentEvent(message_id="msg_1", delta=text or "x"),
            TextMessageEndEvent(message_id="msg_1"),
            ReasoningStartEvent(message_id="blk_1"),
            ReasoningMessageStartEvent(message_id="blk_1", role="reasoning"),
            ReasoningMessageContentEvent(message_id="blk_1", delta=text or "x"),
            ReasoningMessageEndEvent(message_id="blk_1"),
            ReasoningEndEvent(message_id="blk_1"),
            ToolCallStartEvent(tool_call_id="call_1", tool_call_name="lookup", parent_message_id="msg_1"),
            ToolCallArgsEvent(tool_call_id="call_1", delta='{"q": "' + text + '"}'),
            ToolCallEndEvent(tool_call_id="call_1"),
            ToolCallResultEvent(message_id="toolmsg_1", tool_call_id="call_1", content=text, role="tool",
                                metadata={"state": "success", "note": text, "none": None, "n": [1, True, None]}),
            StepFinishedEvent(step_name="model:m"),
            CustomEvent(name="model_call_discarded", value={"messageId": "msg_1", "error": text or None}),
            RunErrorEvent(message=text or "boom", code="ValueError", usage=USAGE),
            RunFinishedEvent(thread_id="t", run_id="r", outcome=RunFinishedSuccessOutcome(), usage=USAGE,
                             result={"answer": text, "items": [1, 2], "nested": {"ok": True, "none": None}}),
        ]
    events += [
        RunStartedEvent(thread_id="t", run_id="r", parent_run_id="p", protocol_version="1.0"),
        RunStartedEvent(thread_id="t", run_id="r", input=RunAgentInput.model_validate({
            "threadId": "t", "runId": "r", "state": {}, "tools": [], "context": [], "forwardedProps": {},
            "messages": [{"id": "u1", "role": "user", "content": "hi"}]})),
        RunFinishedEvent(thread_id="t", run_id="r", outcome=RunFinishedCancelledOutcome()),
        RunFinishedEvent(thread_id="t", run_id="r", outcome=RunFinishedSuccessOutcome(pending_tool_call_ids=["c1"])),
        RunFinishedEvent(thread_id="t", run_id="r", outcome=RunFinishedInterruptOutcome(interrupts=[Interrupt(
            id="c1", reason="tool_call_confirmation", tool_call_id="c1", message="Allow lookup({})?",
            response_schema={"type": "object", "required": ["approved"]},
            metadata={"toolName": "lookup", "arguments": {"q": "x", "n": None}})])),
        RunFinishedEvent(thread_id="t", run_id="r"),
        MessagesSnapshotEvent(messages=[
            UserMessage(id="u1", content="hi ☃"),
            AssistantMessage(id="a1", content=None, tool_calls=[
                ToolCall(id="c1", function=FunctionCall(name="lookup", arguments='{"q":"x"}'))]),
            ToolMessage(id="t1", content="found", tool_call_id="c1"),
        ]),
        StepStartedEvent(step_name="s", timestamp=1_700_000_000_000, metadata={"k": "v"}),
    ]
    sub = [TextMessageStartEvent(message_id="m", role="assistant"), ToolCallEndEvent(tool_call_id="c")]
    attribute(sub, "sub_1")  # a sub-agent's events carry its run id
    events += sub
    return events


# Values the fast path hands to the official encoder; the bytes must still be the official ones.
REFUSED: list[BaseEvent] = [
    CustomEvent(name="floats", value={"x": 0.1, "big": 1e300, "neg": -0.0}),
    CustomEvent(name="big int", value={"n": 2**70}),
    CustomEvent(name="tuple", value=(1, 2)),
]


@pytest.mark.parametrize("event", _events() + REFUSED, ids=lambda e: type(e).__name__)
def test_the_official_encoders_bytes(event: BaseEvent) -> None:
    assert FrameEncoder().frame(event) == EventEncoder().encode(event).encode()


def test_many_events_join_in_order() -> None:
    events = _events()
    assert FrameEncoder().encode(events) == "".join(EventEncoder().encode(e) for e in events).encode()


class _NoOfficial(FrameEncoder):
    def __init__(self) -> None:
        super().__init__()
        self._official = None  # type: ignore[assignment]  # any fallback raises


def test_the_lifecycle_frames_do_not_go_through_pydantic() -> None:
    encoder = _NoOfficial()
    for event in _events():  # every event the server sends while a run goes well
        assert encoder.frame(event).startswith(b"data: {")


def test_a_refused_value_goes_through_the_official_encoder() -> None:
    encoder = _NoOfficial()
    for event in REFUSED:
        with pytest.raises(AttributeError):  # it reached for the official encoder
            encoder.frame(event)


def test_an_unknown_model_in_a_value_is_refused() -> None:
    class Odd:
        pass

    value: Any = {"odd": Odd()}
    with pytest.raises(AttributeError):
        _NoOfficial().frame(CustomEvent.model_construct(name="odd", value=value))


def test_a_model_built_without_a_required_field_is_the_official_encoders_to_judge() -> None:
    event = TextMessageContentEvent.model_construct(delta="x")  # no message_id
    with pytest.raises(AttributeError):  # the fast path gave up; the official encoder decides
        _NoOfficial().frame(event)
