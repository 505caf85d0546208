"""Every event type and message block round-trips through JSON."""

from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError

from agentscope_py import events as ev
from agentscope_py.message import (
    ChatUsage,
    DataBlock,
    GenerateReason,
    Msg,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolResultState,
    ToolUseBlock,
)

CALL = ToolUseBlock(id="c1", name="echo", input={"text": "hi", "n": [1, 2]})
RESULT = ToolResultBlock(id="c1", name="echo", output=[TextBlock(text="a"), DataBlock(media_type="image/png", data="AA==")],
                         state=ToolResultState.ERROR)
MSG = Msg(role="assistant", name="bot", content=[TextBlock(text="t"), ThinkingBlock(thinking="x", signature="sig"), CALL,
                                                  RESULT, DataBlock(media_type="image/png", url="http://x/y.png")],
          metadata={"k": 1}, generate_reason=GenerateReason.TOOL_CALLS, usage=ChatUsage(input_tokens=3, output_tokens=4))

SAMPLES: list[ev.EventBase] = [
    ev.AgentStart(reply_id="r", name="a", session_id="s"),
    ev.AgentEnd(reply_id="r"),
    ev.AgentResult(result=MSG),
    ev.ModelCallStart(reply_id="r", model="m"),
    ev.ModelCallEnd(reply_id="r", usage=ChatUsage(input_tokens=1, output_tokens=2, cache_read_tokens=3), finish_reason="stop"),
    ev.TextBlockStart(reply_id="r", block_id="b"),
    ev.TextBlockDelta(reply_id="r", block_id="b", delta="hé"),
    ev.TextBlockEnd(reply_id="r", block_id="b"),
    ev.ThinkingBlockStart(reply_id="r", block_id="b"),
    ev.ThinkingBlockDelta(reply_id="r", block_id="b", delta="hmm"),
    ev.ThinkingBlockEnd(reply_id="r", block_id="b", signature="sig"),
    ev.DataBlockStart(reply_id="r", block_id="b", media_type="image/png"),
    ev.DataBlockDelta(reply_id="r", block_id="b", delta="AAA="),
    ev.DataBlockEnd(reply_id="r", block_id="b"),
    ev.ToolCallStart(reply_id="r", tool_call_id="c", tool_name="t"),
    ev.ToolCallDelta(reply_id="r", tool_call_id="c", tool_name="t", delta='{"a":'),
    ev.ToolCallEnd(reply_id="r", tool_call_id="c", tool_name="t"),
    ev.ToolResultStart(reply_id="r", tool_call_id="c", tool_name="t"),
    ev.ToolResultTextDelta(reply_id="r", tool_call_id="c", tool_name="t", delta="out"),
    ev.ToolResultDataDelta(reply_id="r", tool_call_id="c", tool_name="t", data=DataBlock(media_type="a/b", data="AA")),
    ev.ToolResultEnd(reply_id="r", tool_call_id="c", tool_name="t", state=ToolResultState.DENIED),
    ev.ExceedMaxIters(reply_id="r", max_iters=3, current_iter=3),
    ev.RequireUserConfirm(reply_id="r", tool_calls=[CALL]),
    ev.UserConfirmResult(reply_id="r", confirm_results=[ev.ConfirmResult(tool_call_id="c1", confirmed=False, reason="no")]),
    ev.RequireExternalExecution(reply_id="r", tool_calls=[CALL]),
    ev.ExternalExecutionResult(reply_id="r", tool_results=[RESULT]),
    ev.RequestStop(reason="enough", generate_reason=GenerateReason.ALL_TOOLS_DENIED),
    ev.AllToolsDenied(reply_id="r", denied_tool_calls=[CALL]),
    ev.HintBlock(hint_source="mw", hint="try again"),
    ev.Custom(name="timing", value={"ms": 1.5, "nested": [1, None]}),
    ev.MiddlewareStarted(middleware="M", point="ON_AGENT"),
    ev.MiddlewareCompleted(middleware="M", point="ON_AGENT", duration_ms=0.5, error="ValueError: x"),
    ev.Compressed(removed_messages=4, kept_messages=2, summary="s"),
    ev.GuardrailTripped(guardrail="no_secrets", reason="a key", stage="stream"),
    ev.CacheLayoutChanged(changed=["system", "tools"], reply_id="r"),
]


def test_the_catalogue_is_complete() -> None:
    union = typing.get_args(typing.get_args(ev.AgentEvent)[0])
    assert {type(s) for s in SAMPLES} == set(union)
    assert len({s.type for s in SAMPLES}) == len(SAMPLES)  # every literal type is distinct


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: e.type)
def test_event_round_trips(event: ev.EventBase) -> None:
    event = event.model_copy(update={"source": "parent/child", "metadata": {"x": [1]}})
    text = event.model_dump_json()
    parsed = ev.parse_event(text)
    assert parsed == event
    assert type(parsed) is type(event)
    assert ev.parse_event(event.model_dump(mode="json")) == event


def test_events_are_immutable_and_have_ids() -> None:
    a, b = ev.AgentEnd(reply_id="r"), ev.AgentEnd(reply_id="r")
    assert a.id != b.id and a.created_at <= b.created_at and a.source is None
    with pytest.raises(ValidationError):
        a.reply_id = "other"  # type: ignore[misc]


def test_unknown_event_type_is_rejected() -> None:
    with pytest.raises(ValidationError):
        ev.parse_event('{"type": "nope"}')


def test_msg_helpers_and_round_trip() -> None:
    assert Msg.model_validate_json(MSG.model_dump_json()) == MSG
    assert MSG.text == "t" and MSG.thinking == "x"
    assert MSG.tool_calls == [CALL] and MSG.tool_results == [RESULT]
    user = Msg.user("hi", source="web")
    assert user.role == "user" and user.text == "hi" and user.metadata == {"source": "web"}
    assert RESULT.text == "a"
    assert (ChatUsage(input_tokens=1, output_tokens=2) + ChatUsage(input_tokens=3, reasoning_tokens=1)) == ChatUsage(
        input_tokens=4, output_tokens=2, reasoning_tokens=1)


# -- unvalidated construction (internal): the same objects as validation gives --------------------


def _same_object(made: typing.Any, validated: typing.Any) -> None:
    """Equal but for the fresh id and timestamp; the same fields set, slots and field order."""
    assert type(made) is type(validated)
    per_object = {"id", "created_at"}
    assert list(made.__dict__) == list(validated.__dict__)
    assert {k: v for k, v in made.__dict__.items() if k not in per_object} == \
        {k: v for k, v in validated.__dict__.items() if k not in per_object}
    assert made.model_fields_set == validated.model_fields_set
    assert made.__pydantic_extra__ is None and made.__pydantic_private__ is None
    assert type(made).model_validate_json(made.model_dump_json()) == made


def test_a_trusted_maker_gives_what_validation_gives() -> None:
    from agentscope_py.message import trusted_model

    made = trusted_model(ev.ToolCallDelta, "reply_id", "tool_call_id", "tool_name", "delta")
    a = made(reply_id="r", tool_call_id="c", tool_name="t", delta='{"x"')
    b = made(reply_id="r", tool_call_id="c", tool_name="t", delta='{"x"')
    _same_object(a, ev.ToolCallDelta(reply_id="r", tool_call_id="c", tool_name="t", delta='{"x"'))
    assert a.id != b.id and a.metadata is not b.metadata  # factories run per object
    # A model that is not frozen gets a fields set of its own per object.
    from pydantic import BaseModel

    class Open(BaseModel):
        text: str
        tags: list[str] = []
        n: int = 1

    make_open = trusted_model(Open, "text")
    o1, o2 = make_open(text="a"), make_open(text="b")
    assert list(o1.__dict__.items()) == list(Open(text="a").__dict__.items())
    assert o1.model_fields_set == {"text"} and o1.model_fields_set is not o2.model_fields_set
    # A mutable default that is not a factory's is left to validation (which copies it).
    assert trusted_model(Open, "text", "n") is Open


def test_a_trusted_binder_makes_objects_that_share_the_bound_fields() -> None:
    from agentscope_py.message import trusted_binder

    bind = trusted_binder(ev.TextBlockDelta, ("reply_id", "block_id"), ("delta",))
    maker = bind(reply_id="r", block_id="b")
    a, b = maker("one"), maker("two")
    _same_object(a, ev.TextBlockDelta(reply_id="r", block_id="b", delta="one"))
    _same_object(b, ev.TextBlockDelta(reply_id="r", block_id="b", delta="two"))
    assert a.id != b.id and a.metadata is not b.metadata and a.__dict__ is not b.__dict__
    assert bind(reply_id="r2", block_id="b2")("x").block_id == "b2" and maker("y").block_id == "b"


def test_a_model_with_a_validator_is_validated_by_its_trusted_makers() -> None:
    from pydantic import BaseModel, field_validator

    from agentscope_py.message import trusted_binder, trusted_model

    class Checked(BaseModel):
        a: str
        b: str

        @field_validator("b")
        @classmethod
        def no_empty(cls, v: str) -> str:
            if not v:
                raise ValueError("empty")
            return v

    assert trusted_model(Checked, "a", "b") is Checked
    maker = trusted_binder(Checked, ("a",), ("b",))(a="x")
    assert maker("y") == Checked(a="x", b="y")
    with pytest.raises(ValidationError):
        maker("")
