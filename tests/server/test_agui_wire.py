"""The lifecycle events the mapper writes without their models (`_agui_wire`) are, byte for byte,
the official encoder's frames of those models (``model_dump_json(by_alias=True)``), for every kind
and for the strings JSON writers differ on; `to_model` gives back the very model; and a run's
frames from `AguiMapper.encode*` (the per-token path included) are each the official frame of the
event they parse to."""

from __future__ import annotations

import json
from typing import Any

import pytest
from ag_ui.core import (
    BaseEvent,
    Event,
    ReasoningEndEvent,
    ReasoningMessageContentEvent,
    ReasoningMessageEndEvent,
    ReasoningMessageStartEvent,
    ReasoningStartEvent,
    RunErrorEvent,
    RunFinishedCancelledOutcome,
    RunFinishedEvent,
    RunFinishedSuccessOutcome,
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
from ag_ui.encoder import EventEncoder
from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError

from agentscope_py import events as ev
from agentscope_py.message import ChatUsage, GenerateReason, Msg, ToolUseBlock
from agentscope_py.server._agui import encode as _agui_encode
from agentscope_py.server._agui import wire
from agentscope_py.server._agui.content import attribute
from agentscope_py.server._agui.encode import FrameEncoder
from agentscope_py.server.agui import AguiMapper

ODD = ["plain", "naïve ☃ 😀 日本", 'quote " backslash \\ slash /', "line\nbreak\ttab\r\x00\x1f\x7f",
       "\u2028\u2029\u0085 form\x0c feed", "<script>&amp;</script>", "</", ""]

U = ("m", 10, 5, 15, None, None, None)
U_ALL = (None, 0, 0, 0, 3, 2, 7)


def _usage(model: str | None, i: int, o: int, t: int, r: int | None, c: int | None, w: int | None) -> TokenUsage:
    return TokenUsage(model=model, input_tokens=i, output_tokens=o, total_tokens=t, reasoning_tokens=r,
                      cached_input_tokens=c, cache_write_input_tokens=w)


def _pairs(s: str) -> list[tuple[dict[str, Any], BaseEvent]]:
    """Each wire event with the model the mapper used to build for it."""
    x = s or "x"  # AG-UI requires non-empty deltas
    return [
        (wire.run_started(s, s), RunStartedEvent(thread_id=s, run_id=s)),
        (wire.step_started(f"model:{s}"), StepStartedEvent(step_name=f"model:{s}")),
        (wire.step_finished(s), StepFinishedEvent(step_name=s)),
        (wire.text_start(s), TextMessageStartEvent(message_id=s, role="assistant")),
        (wire.text_content(s, x), TextMessageContentEvent(message_id=s, delta=x)),
        (wire.text_end(s), TextMessageEndEvent(message_id=s)),
        (wire.reasoning_start(s), ReasoningStartEvent(message_id=s)),
        (wire.reasoning_message_start(s), ReasoningMessageStartEvent(message_id=s, role="reasoning")),
        (wire.reasoning_content(s, x), ReasoningMessageContentEvent(message_id=s, delta=x)),
        (wire.reasoning_message_end(s), ReasoningMessageEndEvent(message_id=s)),
        (wire.reasoning_end(s), ReasoningEndEvent(message_id=s)),
        (wire.tool_call_start(s, s, s), ToolCallStartEvent(tool_call_id=s, tool_call_name=s, parent_message_id=s)),
        (wire.tool_call_args(s, x), ToolCallArgsEvent(tool_call_id=s, delta=x)),
        (wire.tool_call_end(s), ToolCallEndEvent(tool_call_id=s)),
        (wire.tool_call_result(s, s, s, "error"), ToolCallResultEvent(
            message_id=s, tool_call_id=s, content=s, role="tool", metadata={"state": "error"})),
        (wire.run_finished(s, s, wire.success(), None),
         RunFinishedEvent(thread_id=s, run_id=s, outcome=RunFinishedSuccessOutcome())),
        (wire.run_finished(s, s, wire.success([s, "c2"]), [wire.token_usage(*U), wire.token_usage(*U_ALL)]),
         RunFinishedEvent(thread_id=s, run_id=s, outcome=RunFinishedSuccessOutcome(pending_tool_call_ids=[s, "c2"]),
                          usage=[_usage(*U), _usage(*U_ALL)])),
        (wire.run_finished(s, s, wire.cancelled(), [wire.token_usage(s, 1, 2, 3, None, 4, None)]),
         RunFinishedEvent(thread_id=s, run_id=s, outcome=RunFinishedCancelledOutcome(),
                          usage=[_usage(s, 1, 2, 3, None, 4, None)])),
        (wire.run_error(s, s), RunErrorEvent(message=s, code=s)),
        (wire.run_error(s, "E", [wire.token_usage(*U_ALL)]), RunErrorEvent(message=s, code="E", usage=[_usage(*U_ALL)])),
    ]


PAIRS = [p for s in ODD for p in _pairs(s)]


def _id(pair: tuple[dict[str, Any], BaseEvent]) -> str:
    return str(pair[0]["type"])


@pytest.mark.parametrize("pair", PAIRS, ids=_id)
def test_a_wire_event_is_its_models_official_frame(pair: tuple[dict[str, Any], BaseEvent]) -> None:
    data, model = pair
    assert FrameEncoder().frame(data) == EventEncoder().encode(model).encode()
    assert wire.to_model(data) == model


def test_every_kind_the_mapper_writes_is_covered() -> None:
    kinds = {data["type"] for data, _ in PAIRS}
    assert kinds == set(wire._CLASSES)


@pytest.mark.parametrize("pair", _pairs("naïve \"q\"\n\u2028"), ids=_id)
def test_a_sub_agents_wire_event_is_its_models_official_frame(pair: tuple[dict[str, Any], BaseEvent]) -> None:
    data, model = pair
    if "subagent_run_id" not in type(model).model_fields:
        return  # not an attributable event: a sub-agent never sends it
    attribute([data], "sub_1")
    attribute([model], "sub_1")
    assert FrameEncoder().frame(data) == EventEncoder().encode(model).encode()
    assert wire.to_model(data) == model


def test_without_orjson_the_official_encoder_writes_the_wire_events(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_agui_encode, "_dumps", None)
    for data, model in PAIRS:
        assert FrameEncoder().frame(data) == EventEncoder().encode(model).encode()


def test_a_count_past_the_models_bounds_is_refused_as_the_model_refuses_it() -> None:
    for count in (2**53, -1):
        with pytest.raises(ValidationError):
            _usage("m", count, 0, 0, None, None, None)
        with pytest.raises(ValidationError):
            wire.token_usage("m", 0, 0, 0, None, count, None)


def test_a_string_orjson_refuses_fails_as_the_official_encoder_fails() -> None:
    lone = "\ud800"  # a lone surrogate: not UTF-8
    with pytest.raises(PydanticSerializationError):
        EventEncoder().encode(RunStartedEvent(thread_id=lone, run_id="r"))
    with pytest.raises(PydanticSerializationError):
        FrameEncoder().frame(wire.run_started(lone, "r"))


_EVENT: TypeAdapter[Any] = TypeAdapter(Event)


def _official(frames: bytes) -> None:
    """Each frame is the official encoder's frame of the event it parses to."""
    assert frames.endswith(b"\n\n")
    for part in frames.split(b"\n\n")[:-1]:
        assert part.startswith(b"data: ")
        event = _EVENT.validate_python(json.loads(part[6:]))
        assert part + b"\n\n" == EventEncoder().encode(event).encode()


def test_a_runs_frames_are_the_official_frames_of_what_they_say() -> None:
    mapper = AguiMapper("thread ☃", 'run "1"')
    frames = [mapper.encode_start()]
    r = {"reply_id": "r1"}
    stream: list[Any] = [ev.AgentStart(name="a", **r), ev.ModelCallStart(model="gpt\u2028x", **r)]
    stream += [ev.TextBlockStart(block_id="b1", **r)]
    stream += [ev.TextBlockDelta(block_id="b1", delta=s, **r) for s in ODD]  # the per-token path ("" maps to nothing)
    stream += [ev.TextBlockEnd(block_id="b1", **r), ev.ThinkingBlockStart(block_id="k1", **r),
               ev.ThinkingBlockDelta(block_id="k1", delta="hm\n", **r), ev.ThinkingBlockEnd(block_id="k1", **r),
               ev.ToolCallStart(tool_call_id="c1", tool_name="look up", **r),
               ev.ToolCallDelta(tool_call_id="c1", tool_name="look up", delta='{"q": "\u2028"}', **r),
               ev.ToolCallEnd(tool_call_id="c1", tool_name="look up", **r),
               ev.ModelCallEnd(usage=ChatUsage(input_tokens=3, output_tokens=4), **r),
               ev.AgentResult(result=Msg.assistant("done"))]
    for event in stream:
        frames.append(mapper.encode(event))
    frames.append(mapper.encode_finish())
    joined = b"".join(frames)
    _official(joined)
    assert joined.count(b'"TEXT_MESSAGE_CONTENT"') == len(ODD) - 1
    assert b'"usage":[{"model":"gpt\xe2\x80\xa8x","inputTokens":3,"outputTokens":4,"totalTokens":7}]' in joined


def test_a_failed_runs_error_frame_carries_the_message_it_is_given() -> None:
    mapper = AguiMapper("t", "r")
    mapper.encode_start()
    mapper.encode(ev.ModelCallStart(model="m", reply_id="r1"))
    mapper.encode(ev.TextBlockStart(block_id="b1", reply_id="r1"))
    frames = mapper.encode_fail(ValueError("secret internals"), message='safe "message"\n', code="Oops")
    _official(frames)
    assert b"secret" not in frames
    last = json.loads(frames.split(b"\n\n")[-2][6:])
    assert last == {"type": "RUN_ERROR", "message": 'safe "message"\n', "code": "Oops"}
    assert [json.loads(p[6:])["type"] for p in frames.split(b"\n\n")[:-1]] == [
        "TEXT_MESSAGE_END", "STEP_FINISHED", "RUN_ERROR"]


def test_the_public_methods_hand_out_models() -> None:
    mapper = AguiMapper("t", "r")
    assert mapper.start() == [RunStartedEvent(thread_id="t", run_id="r")]
    mapper.map(ev.ModelCallStart(model="m", reply_id="r1"))
    out = mapper.map(ev.TextBlockDelta(block_id="b1", delta="hi", reply_id="r1"))  # opens the message
    assert [type(e) for e in out] == [TextMessageStartEvent, TextMessageContentEvent]
    finished = mapper.finish()
    assert all(isinstance(e, BaseEvent) for e in finished)
    assert isinstance(finished[-1], RunFinishedEvent)
    assert isinstance(finished[-1].outcome, RunFinishedSuccessOutcome)


def _finished(frames: bytes) -> dict[str, Any]:
    _official(frames)
    last: dict[str, Any] = json.loads(frames.split(b"\n\n")[-2][6:])
    assert last["type"] == "RUN_FINISHED"
    return last


def test_a_result_and_pending_calls_finish_the_run_as_before() -> None:
    call = ToolUseBlock(id="c1", name="ask", input={"q": 0.5})
    mapper = AguiMapper("t", "r")
    mapper.encode(ev.RequireExternalExecution(reply_id="r1", tool_calls=[call]))
    reply = Msg.assistant("done").model_copy(update={"metadata": {"structured_output": {"score": 0.25, "ok": True}}})
    mapper.encode(ev.AgentResult(result=reply))
    last = _finished(mapper.encode_finish())
    assert last["result"] == {"score": 0.25, "ok": True}  # a float: the model's own JSON writes it
    assert last["outcome"] == {"type": "success", "pendingToolCallIds": ["c1"]}

    mapper = AguiMapper("t", "r")
    mapper.encode(ev.RequireExternalExecution(reply_id="r1", tool_calls=[call]))
    assert _finished(mapper.encode_finish())["outcome"] == {"type": "success", "pendingToolCallIds": ["c1"]}


def test_an_interrupted_reply_finishes_cancelled_with_what_was_open_closed() -> None:
    mapper = AguiMapper("t", "r")
    mapper.encode(ev.ModelCallStart(model="m", reply_id="r1"))
    mapper.encode(ev.TextBlockDelta(block_id="b1", delta="par", reply_id="r1"))
    mapper.encode(ev.ThinkingBlockDelta(block_id="k1", delta="hm", reply_id="r1"))
    mapper.encode(ev.ToolCallDelta(tool_call_id="c1", tool_name="t", delta="{", reply_id="r1"))
    reply = Msg.assistant("par").model_copy(update={"generate_reason": GenerateReason.INTERRUPTED})
    mapper.encode(ev.AgentResult(result=reply))
    frames = mapper.encode_finish()
    assert _finished(frames)["outcome"] == {"type": "cancelled"}
    assert [json.loads(p[6:])["type"] for p in frames.split(b"\n\n")[:-1]] == [
        "REASONING_MESSAGE_END", "REASONING_END", "TEXT_MESSAGE_END", "TOOL_CALL_END", "STEP_FINISHED",
        "RUN_FINISHED"]
