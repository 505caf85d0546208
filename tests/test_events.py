"""Every event type and message block round-trips through JSON."""

from __future__ import annotations

import os
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
    new_id,
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
    ev.ToolInDoubt(reply_id="r", tool_call_id="c", tool_name="t", arguments={"a": 1}, idempotency_key="idem_k",
                   policy="ask", outcome="asked"),
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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="a platform that cannot fork")
def test_a_forked_process_names_its_messages_and_events_apart_from_its_parent() -> None:
    """A process forked after the import (a pre-fork server, gunicorn's ``--preload``) inherits the
    id counter: with the parent's prefix too, two processes sharing a session store would save two
    messages under one id (tests/server/test_kills_random.py found it)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        made = [Msg.user("x").id, ev.AgentEnd(reply_id="r").id, new_id("k_")]
        os.write(write, " ".join(made).encode())
        os._exit(0)
    os.close(write)
    mine = [Msg.user("x").id, ev.AgentEnd(reply_id="r").id, new_id("k_")]
    with os.fdopen(read) as pipe:
        theirs = pipe.read().split()
    os.waitpid(pid, 0)
    assert len(theirs) == 3 and not set(mine) & set(theirs), (mine, theirs)
    # Not only other serials: another prefix (the counter is the parent's, forked).
    assert not {i.rsplit("_", 2)[-2] for i in theirs} & {i.rsplit("_", 2)[-2] for i in mine}


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


# -- the per-token delta constructors (internal): the same objects as validation gives -------------


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


@pytest.mark.parametrize(("cls", "ids"), [
    (ev.TextBlockDelta, {"reply_id": "r", "block_id": "b"}),
    (ev.ThinkingBlockDelta, {"reply_id": "r", "block_id": "b"}),
    (ev.ToolCallDelta, {"reply_id": "r", "tool_call_id": "c", "tool_name": "t"}),
    (ev.ToolResultTextDelta, {"reply_id": "r", "tool_call_id": "c", "tool_name": "t"}),
])
@pytest.mark.parametrize("form", ["delta_maker", "delta_shape"])
def test_a_delta_maker_gives_what_validation_gives(cls: typing.Any, ids: dict[str, str], form: str) -> None:
    from agentscope_py._trusted import delta_maker, delta_shape

    make = delta_maker(cls, **ids) if form == "delta_maker" else delta_shape(cls).maker(**ids)
    a, b = make("one"), make('{"x"')
    _same_object(a, cls(**ids, delta="one"))
    _same_object(b, cls(**ids, delta='{"x"'))
    assert a.id != b.id and a.id.startswith("ev_") and a.metadata is not b.metadata  # fresh per event
    assert a.model_copy(update={"delta": "z"}).model_fields_set == a.model_fields_set  # copies work as ever
    with pytest.raises(ValidationError):  # frozen like any event
        a.delta = "no"  # type: ignore[misc]


def test_with_source_gives_what_model_copy_gives() -> None:
    from agentscope_py._trusted import with_source

    for original in (ev.TextBlockDelta(reply_id="r", block_id="b", delta="hi"),
                     ev.ModelCallEnd(reply_id="r", finish_reason="stop", metadata={"k": 1})):
        made, copied = with_source(original, "boss/child"), original.model_copy(update={"source": "boss/child"})
        assert made == copied and made.id == original.id and made.source == "boss/child"
        assert list(made.__dict__) == list(copied.__dict__)
        assert made.model_fields_set == copied.model_fields_set
        assert original.source is None  # the forwarded event is a copy


def test_a_delta_maker_validates_what_is_not_a_plain_str_and_refuses_wrong_fields() -> None:
    from agentscope_py._parts import delta_maker

    class Name(str):
        pass

    made = delta_maker(ev.ToolCallDelta, reply_id="r", tool_call_id="c", tool_name=Name("t"))("{}")
    assert type(made.tool_name) is str and made == ev.ToolCallDelta(
        id=made.id, created_at=made.created_at, reply_id="r", tool_call_id="c", tool_name="t", delta="{}")
    with pytest.raises(ValidationError):
        delta_maker(ev.ToolCallDelta, reply_id="r", tool_call_id="c", tool_name=3)("{}")
    with pytest.raises(TypeError, match="reply_id, block_id"):
        delta_maker(ev.TextBlockDelta, reply_id="r")


def test_a_delta_shapes_maker_refuses_ids_that_are_not_its_fields() -> None:
    from agentscope_py._trusted import delta_shape

    text = delta_shape(ev.TextBlockDelta)
    with pytest.raises(TypeError, match="takes reply_id, block_id"):
        text.maker(reply_id="r")  # one missing
    with pytest.raises(TypeError, match="takes reply_id, block_id"):
        text.maker(reply_id="r", block="b")  # one misspelt
    with pytest.raises(TypeError, match="takes reply_id, block_id"):
        text.maker(reply_id="r", block_id="b", tool_name="t")  # one too many
    with pytest.raises(TypeError, match="no delta field"):
        delta_shape(ev.TextBlockStart)


def _nested(levels: int) -> typing.Any:
    value: typing.Any = 1
    for i in range(levels):
        value = {"a": value} if i % 2 else [value]
    return value


@pytest.mark.parametrize("levels", [ev.MAX_EVENT_DEPTH, 4_000, 100_000])
def test_an_event_nested_too_deep_is_refused_with_a_validation_error_as_json_or_dict(levels: int) -> None:
    data = {"type": "custom", "name": "deep", "value": _nested(levels)}
    with pytest.raises(ValidationError, match=f"nests deeper than {ev.MAX_EVENT_DEPTH} levels"):
        ev.parse_event(data)
    text = '{"type":"custom","name":"deep","value":' + '{"a":' * levels + "1" + "}" * levels + "}"
    with pytest.raises(ValidationError):
        ev.parse_event(text)


def test_an_event_at_the_depth_limit_parses_and_round_trips() -> None:
    data = {"type": "custom", "name": "deep", "value": _nested(ev.MAX_EVENT_DEPTH - 1)}
    event = ev.parse_event(data)
    assert ev.parse_event(event.model_dump_json()) == event == ev.parse_event(event.model_dump())
