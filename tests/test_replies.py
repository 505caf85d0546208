"""`ReplyBuilder` and `ToolResultCollector`: the reply and the tool results rebuilt from events."""

from __future__ import annotations

import pytest

from agentscope_py import events as ev
from agentscope_py._replies import ReplyBuilder, ToolResultCollector
from agentscope_py.errors import MiddlewareError
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

R = "r1"


def _call(builder: ReplyBuilder, *events: ev.AgentEvent, usage: ChatUsage | None = None,
          discarded: bool = False) -> None:
    builder.add(ev.ModelCallStart(reply_id=R, model="m"))
    for e in events:
        builder.add(e)
    builder.add(ev.ModelCallEnd(reply_id=R, usage=usage, finish_reason="stop", discarded=discarded))


def test_the_reply_holds_each_block_in_the_order_it_started() -> None:
    builder = ReplyBuilder()
    assert not builder.produced
    _call(
        builder,
        ev.ThinkingBlockStart(reply_id=R, block_id="t"),
        ev.ThinkingBlockDelta(reply_id=R, block_id="t", delta="hm"),
        ev.ThinkingBlockDelta(reply_id=R, block_id="t", delta="m"),
        ev.ThinkingBlockEnd(reply_id=R, block_id="t", signature="sig"),
        ev.TextBlockStart(reply_id=R, block_id="b"),
        ev.TextBlockDelta(reply_id=R, block_id="b", delta="Hel"),
        ev.TextBlockDelta(reply_id=R, block_id="b", delta="lo"),
        ev.TextBlockEnd(reply_id=R, block_id="b"),
        ev.ToolCallStart(reply_id=R, tool_call_id="c", tool_name="echo"),
        ev.ToolCallDelta(reply_id=R, tool_call_id="c", tool_name="echo", delta='{"x": '),
        ev.ToolCallDelta(reply_id=R, tool_call_id="c", tool_name="echo", delta="1}"),
        ev.ToolCallEnd(reply_id=R, tool_call_id="c", tool_name="echo"),
        usage=ChatUsage(input_tokens=3, output_tokens=4),
    )
    assert builder.produced and builder.calls_tools and builder.finish_reason == "stop"
    msg = builder.build("m1", "agent", GenerateReason.TOOL_CALLS)
    expected = Msg(id="m1", name="agent", role="assistant", generate_reason=GenerateReason.TOOL_CALLS,
                   usage=ChatUsage(input_tokens=3, output_tokens=4),
                   content=[ThinkingBlock(thinking="hmm", signature="sig"), TextBlock(text="Hello"),
                            ToolUseBlock(id="c", name="echo", input={"x": 1})])
    assert msg.model_dump(exclude={"metadata"}) == expected.model_dump(exclude={"metadata"})
    assert msg.model_fields_set == expected.model_fields_set | {"content", "id"}


def test_each_model_call_starts_over_and_a_discarded_one_leaves_nothing() -> None:
    builder = ReplyBuilder()
    _call(builder, ev.TextBlockDelta(reply_id=R, block_id="a", delta="first"), usage=ChatUsage(input_tokens=1))
    _call(builder, ev.TextBlockDelta(reply_id=R, block_id="b", delta="second"), usage=ChatUsage(output_tokens=2))
    assert builder.build("m", None).text == "second"
    assert builder.calls_made == 2
    assert builder.usage == ChatUsage(output_tokens=2)
    assert builder.usage_total == ChatUsage(input_tokens=1, output_tokens=2)
    _call(builder, ev.ToolCallDelta(reply_id=R, tool_call_id="c", tool_name="t", delta="{}"), discarded=True)
    assert builder.build("m", None).content == [] and not builder.calls_tools
    assert builder.usage is None and builder.usage_total == ChatUsage(input_tokens=1, output_tokens=2)


def test_events_that_do_not_shape_the_reply_change_nothing() -> None:
    builder = ReplyBuilder()
    builder.add(ev.TextBlockStart(reply_id=R, block_id="b"))
    builder.add(ev.ToolCallEnd(reply_id=R, tool_call_id="c", tool_name="t"))
    builder.add(ev.AgentEnd(reply_id=R))
    assert not builder.produced


def test_a_delta_a_middleware_made_of_another_type_is_a_clear_error() -> None:
    builder = ReplyBuilder()
    bad = ev.TextBlockDelta(reply_id=R, block_id="b", delta="x").model_copy(update={"delta": 5})
    builder.add(bad)
    with pytest.raises(MiddlewareError, match="text block delta is int"):
        builder.build("m", None)


def test_tool_results_join_their_text_and_keep_their_data() -> None:
    collector = ToolResultCollector()
    image = DataBlock(media_type="image/png", data="AA==")
    for e in (
        ev.ToolResultStart(reply_id=R, tool_call_id="c", tool_name="t"),
        ev.ToolResultTextDelta(reply_id=R, tool_call_id="c", tool_name="t", delta="a"),
        ev.ToolResultTextDelta(reply_id=R, tool_call_id="c", tool_name="t", delta="b"),
        ev.ToolResultDataDelta(reply_id=R, tool_call_id="c", tool_name="t", data=image),
        ev.ToolResultTextDelta(reply_id=R, tool_call_id="c", tool_name="t", delta="c"),
        ev.ToolResultEnd(reply_id=R, tool_call_id="c", tool_name="t"),
        ev.ToolResultTextDelta(reply_id=R, tool_call_id="d", tool_name="u", delta="only text"),
        ev.ToolResultEnd(reply_id=R, tool_call_id="d", tool_name="u", state=ToolResultState.ERROR),
    ):
        collector.add(e)
    assert collector.results == {
        "c": ToolResultBlock(id="c", name="t", output=[TextBlock(text="ab"), image, TextBlock(text="c")]),
        "d": ToolResultBlock(id="d", name="u", output="only text", state=ToolResultState.ERROR),
    }
