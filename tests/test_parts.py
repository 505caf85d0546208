"""`PartsManager`: a model's chunks into the block events of its reply, as the model call's
consumer sees them (`model_call_stream`): which chunk opens, feeds and ends which block, and what
a failure in the middle leaves (every block closed, then a ModelCallEnd that says why)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from agentscope_py._model_call import RetryPolicy, model_call_stream
from agentscope_py.errors import MalformedStreamError
from agentscope_py.message import ChatUsage
from agentscope_py.model.base import ChatChunk, ModelRequest, ToolCallChunk

pytestmark = pytest.mark.timeout(30)


class Boom(Exception):
    pass


class Script:
    """A model that streams the given chunks, then raises ``fail`` if given."""

    name = "script"

    def __init__(self, chunks: Sequence[ChatChunk], fail: BaseException | None = None) -> None:
        self.chunks, self.fail = chunks, fail

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        for chunk in self.chunks:
            yield chunk
        if self.fail is not None:
            raise self.fail


async def events_of(model: Script) -> list[Any]:
    stream = model_call_stream([model], ModelRequest(messages=[]), "r1", RetryPolicy(), None, None)
    return await stream.to_list()


def shape(events: list[Any]) -> list[tuple[str, ...]]:
    """Each event as its type and what it carries (ids as the block they belong to)."""
    out: list[tuple[str, ...]] = []
    for e in events:
        if e.type.endswith("_delta"):
            out.append((e.type, e.delta))
        elif e.type in ("thinking_block_end",):
            out.append((e.type, e.signature or ""))
        elif e.type.startswith("tool_call"):
            out.append((e.type, e.tool_call_id, e.tool_name))
        else:
            out.append((e.type,))
    return out


async def test_chunks_open_feed_and_end_their_blocks_in_order() -> None:
    high, low = "\ud83d", "\ude00"  # one emoji, its surrogate pair split across two chunks
    model = Script([
        ChatChunk(thinking_signature="sig-"),  # a signature alone opens the thinking block
        ChatChunk(thinking="hmm"),
        ChatChunk(thinking_signature="1"),
        ChatChunk(text="Hi " + high),  # text ends the thinking block (with its whole signature)
        ChatChunk(text=low + "!"),
        ChatChunk(tool_call=ToolCallChunk(index=0, id="c1", name="a", arguments='{"x"')),  # ends the text
        ChatChunk(tool_call=ToolCallChunk(index=0, arguments=": 1}")),
        ChatChunk(tool_call=ToolCallChunk(index=0, id="c2", name="b")),  # the index reused: c1 ends
        ChatChunk(usage=ChatUsage(input_tokens=3, output_tokens=5), finish_reason="tool_calls"),
    ])
    events = await events_of(model)
    assert shape(events) == [
        ("model_call_start",),
        ("thinking_block_start",),
        ("thinking_block_delta", "hmm"),
        ("thinking_block_end", "sig-1"),
        ("text_block_start",),
        ("text_block_delta", "Hi "),
        ("text_block_delta", "\U0001f600!"),
        ("text_block_end",),
        ("tool_call_start", "c1", "a"),
        ("tool_call_delta", '{"x"'),
        ("tool_call_delta", ": 1}"),
        ("tool_call_end", "c1", "a"),
        ("tool_call_start", "c2", "b"),
        ("tool_call_end", "c2", "b"),
        ("model_call_end",),
    ]
    assert {(e.tool_call_id, e.tool_name) for e in events if e.type == "tool_call_delta"} == {("c1", "a")}
    assert len({e.block_id for e in events if e.type.startswith(("text_", "thinking_"))}) == 2
    assert all(e.reply_id == "r1" for e in events)
    end = events[-1]
    assert end.usage == ChatUsage(input_tokens=3, output_tokens=5) and end.finish_reason == "tool_calls"
    assert end.model == "script" and end.error is None


async def test_a_lone_half_of_a_pair_at_the_end_of_a_block_becomes_the_replacement_character() -> None:
    events = await events_of(Script([ChatChunk(text="a\ud83d"), ChatChunk(thinking="t")]))
    assert [e.delta for e in events if e.type == "text_block_delta"] == ["a", "\ufffd"]


async def test_ids_names_and_signatures_lose_their_lone_surrogates_and_a_call_keeps_its_id() -> None:
    # They go back to the provider with the reply: a lone surrogate there cannot be sent (UTF-8).
    events = await events_of(Script([
        ChatChunk(thinking="t", thinking_signature="s\udc00"),
        ChatChunk(tool_call=ToolCallChunk(index=0, id="c\ud800", name="n\ud800", arguments="{")),
        ChatChunk(tool_call=ToolCallChunk(index=0, id="c\ud800", arguments="}")),  # the same call
    ]))
    assert shape(events) == [
        ("model_call_start",), ("thinking_block_start",), ("thinking_block_delta", "t"),
        ("thinking_block_end", "s\ufffd"), ("tool_call_start", "c\ufffd", "n\ufffd"), ("tool_call_delta", "{"),
        ("tool_call_delta", "}"), ("tool_call_end", "c\ufffd", "n\ufffd"), ("model_call_end",),
    ]


async def test_a_call_id_the_reply_already_gave_another_call_is_a_malformed_stream() -> None:
    seen: list[Any] = []
    model = Script([ChatChunk(tool_call=ToolCallChunk(index=0, id="c1", name="a")),
                    ChatChunk(tool_call=ToolCallChunk(index=1, id="c2", name="b")),
                    ChatChunk(tool_call=ToolCallChunk(index=2, id="c1", name="a"))])
    stream = model_call_stream([model], ModelRequest(messages=[]), "r1", RetryPolicy(), None, None)
    with pytest.raises(MalformedStreamError, match="the tool call id 'c1' names a call this reply already made"):
        async for event in stream:
            seen.append(event)
    assert [(e.type, e.tool_call_id) for e in seen if e.type.startswith("tool_call")] == [
        ("tool_call_start", "c1"), ("tool_call_start", "c2"), ("tool_call_end", "c1"), ("tool_call_end", "c2")]


async def test_a_failure_mid_stream_closes_every_open_block_before_the_error() -> None:
    model = Script([
        ChatChunk(thinking="hmm", thinking_signature="s"),
        ChatChunk(tool_call=ToolCallChunk(index=0, id="c1", name="a")),
        ChatChunk(tool_call=ToolCallChunk(index=1, id="c2", name="b")),
        ChatChunk(text="partial"),
    ], fail=Boom("the provider broke"))
    seen: list[Any] = []
    with pytest.raises(Boom, match="the provider broke"):
        async for event in model_call_stream([model], ModelRequest(messages=[]), "r1", RetryPolicy(), None, None):
            seen.append(event)
    assert shape(seen) == [
        ("model_call_start",),
        ("thinking_block_start",),
        ("thinking_block_delta", "hmm"),
        ("thinking_block_end", "s"),
        ("tool_call_start", "c1", "a"),
        ("tool_call_start", "c2", "b"),
        ("text_block_start",),
        ("text_block_delta", "partial"),
        ("text_block_end",),
        ("tool_call_end", "c1", "a"),
        ("tool_call_end", "c2", "b"),
        ("model_call_end",),
    ]
    assert seen[-1].discarded is True and "the provider broke" in (seen[-1].error or "")


def _script_of(case: str) -> Script:
    high, low = "\ud83d", "\ude00"
    if case == "every_part":
        return Script([
            ChatChunk(thinking_signature="sig-"), ChatChunk(thinking="hm" + high), ChatChunk(thinking=low),
            ChatChunk(thinking_signature="1"), ChatChunk(text="Hi " + high), ChatChunk(text=low + "!"),
            ChatChunk(tool_call=ToolCallChunk(index=0, id="c1", name="a", arguments='{"x"')),
            ChatChunk(tool_call=ToolCallChunk(index=0, arguments=": 1}")),
            ChatChunk(tool_call=ToolCallChunk(index=0, id="c2", name="b", arguments="{}")),
            ChatChunk(tool_call=ToolCallChunk(index=1, id="c3", name="c", arguments='{"q": "\\ud800"}')),
            ChatChunk(usage=ChatUsage(input_tokens=3, output_tokens=5), finish_reason="tool_calls"),
        ])
    if case == "text_after_thinking_held":
        return Script([ChatChunk(thinking="t\ud83d"), ChatChunk(text="a" + high), ChatChunk(thinking="u")])
    if case == "failed":
        return Script([ChatChunk(thinking="hmm", thinking_signature="s"), ChatChunk(text="partial"),
                       ChatChunk(usage=ChatUsage(input_tokens=1, output_tokens=1))], fail=Boom("broke"))
    return Script([])


@pytest.mark.parametrize("case", ["every_part", "text_after_thinking_held", "failed", "empty"])
async def test_a_reply_handed_to_its_builder_is_the_one_its_events_build(case: str) -> None:
    from agentscope_py._model_call import model_call_events
    from agentscope_py._replies import ReplyBuilder

    request = ModelRequest(messages=[])
    from_events, direct = ReplyBuilder(), ReplyBuilder()
    failures: list[str] = []
    try:
        async for event in model_call_events([_script_of(case)], request, "r1", RetryPolicy(), None, None):
            from_events.add(event)
    except Boom as exc:
        failures.append(str(exc))
    made: list[Any] = []
    try:
        async for event in model_call_events([_script_of(case)], request, "r1", RetryPolicy(), None, None,
                                             reply=direct):
            made.append(event)
    except Boom as exc:
        failures.append(str(exc))
    assert made == []  # (the builder was the events' only reader: none is made)
    # Handed the reply and making the events too (a consumer that passes them on): the same events.
    both, passed = ReplyBuilder(), []
    try:
        async for event in model_call_events([_script_of(case)], request, "r1", RetryPolicy(), None, None,
                                             reply=both, events=True):
            passed.append(event)
    except Boom as exc:
        failures.append(str(exc))
    plain = [e async for e in _events_until_failure(_script_of(case), request)]
    assert shape(passed) == shape(plain) and len(passed) >= 2
    assert failures == (["broke", "broke", "broke"] if case == "failed" else [])
    for builder in (from_events, direct, both):
        assert builder.calls_made == 1
        assert (builder.usage, builder.usage_total, builder.finish_reason, builder.calls_tools, builder.produced) == (
            from_events.usage, from_events.usage_total, from_events.finish_reason, from_events.calls_tools,
            from_events.produced)
    built = [b.build("m1", "agent").model_dump(exclude={"metadata"}) for b in (from_events, direct, both)]
    assert built[0] == built[1] == built[2]
    assert built[0]["content"] or case in ("failed", "empty")


async def _events_until_failure(model: Script, request: ModelRequest) -> AsyncIterator[Any]:
    from agentscope_py._model_call import model_call_events

    try:
        async for event in model_call_events([model], request, "r1", RetryPolicy(), None, None):
            yield event
    except Boom:
        pass
