"""`encode_sse`: orjson for flat events with no metadata, pydantic for everything else; the same
frame either way."""

from __future__ import annotations

import typing

import pytest

from agentscope_py import events as ev
from agentscope_py._parts import delta_maker
from agentscope_py.events import parse_event
from agentscope_py.server import encode_sse
from agentscope_py.server import sse as sse_module
from agentscope_py.server.sse import flat_event_types
from tests.test_events import SAMPLES


def pydantic_frame(event: ev.EventBase) -> bytes:
    return b"data: " + event.model_dump_json().encode() + b"\n\n"


def test_orjson_takes_the_flat_events_and_only_those() -> None:
    flat = flat_event_types()
    union = set(typing.get_args(typing.get_args(ev.AgentEvent)[0]))
    assert flat < union
    # Every delta and block boundary the model call emits is flat; events holding models are not.
    assert {ev.TextBlockDelta, ev.ThinkingBlockDelta, ev.ToolCallDelta, ev.TextBlockStart, ev.ToolResultEnd,
            ev.RequestStop, ev.ExceedMaxIters} <= flat
    assert not flat & {ev.AgentResult, ev.ModelCallEnd, ev.RequireUserConfirm, ev.Custom, ev.ToolResultDataDelta}


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: e.type)
def test_every_event_gives_pydantics_frame(event: ev.EventBase) -> None:
    for variant in (event, event.model_copy(update={"source": "parent/child"}),
                    event.model_copy(update={"metadata": {"k": [1, "é"]}})):
        frame = encode_sse(variant)  # type: ignore[arg-type]
        assert frame == pydantic_frame(variant)
        assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
        assert parse_event(frame[6:-2]) == variant


def test_the_runtimes_deltas_give_pydantics_frame() -> None:
    start = ev.TextBlockStart(reply_id="r", block_id="b")
    for text in ("plain", 'quote " and \\ backslash', "line\nbreak\ttab\x00nul", "é 漢字 🙂", ""):
        made = delta_maker(ev.TextBlockDelta, reply_id=start.reply_id, block_id=start.block_id)(text)
        assert encode_sse(made) == pydantic_frame(made)
        assert parse_event(encode_sse(made)[6:-2]) == made


def test_values_orjson_refuses_fall_back_to_pydantic() -> None:
    huge = ev.ExceedMaxIters(reply_id="r", max_iters=2**70, current_iter=1)  # beyond 64 bits
    assert encode_sse(huge) == pydantic_frame(huge)
    assert parse_event(encode_sse(huge)[6:-2]) == huge
    lone = ev.TextBlockDelta(reply_id="r", block_id="b", delta="\ud800")  # a lone surrogate
    with pytest.raises(Exception) as pydantic_error:
        lone.model_dump_json()
    with pytest.raises(type(pydantic_error.value)):  # pydantic's own error, as without orjson
        encode_sse(lone)


def test_without_orjson_pydantic_encodes_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse_module, "_FLAT", frozenset())
    delta = ev.TextBlockDelta(reply_id="r", block_id="b", delta="x")
    assert encode_sse(delta) == pydantic_frame(delta)


def test_an_event_missing_a_field_in_its_dict_is_left_to_pydantic() -> None:
    delta = ev.TextBlockDelta(reply_id="r", block_id="b", delta="x")
    del delta.__dict__["metadata"]  # what no constructor gives; pydantic decides what it means
    assert encode_sse(delta) == pydantic_frame(delta)  # (it leaves the field out)
