"""The stream readers, fed arbitrary byte streams split at arbitrary points, raise only `ModelError`s.

A raw ``OverflowError`` (``"index": Infinity``), ``AttributeError`` (an Ollama line that is no
object) or ``RecursionError`` (JSON nested thousands deep) escapes retry and fallback, which act
on `ModelError` alone. Each reader gets random bytes and near-valid frames with hostile values,
cut into random pieces, through the same httpx response objects the providers read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentscope_py import ReActAgent
from agentscope_py.events import ToolCallStart, ToolResultStart
from agentscope_py.message import ChatUsage
from agentscope_py.middleware import BudgetMiddleware, ModelPrice
from agentscope_py.model import ChatChunk, ModelError
from agentscope_py.model._aiohttp import body_bytes
from agentscope_py.model._convert import MAX_TOKENS, stream_chunks
from agentscope_py.model._sdk import SDKModel, wire_body
from agentscope_py.model.anthropic import AnthropicChatModel, _EventReader
from agentscope_py.model.ollama import read_ndjson
from agentscope_py.model.openai import OpenAIChatModel, _ChunkReader
from agentscope_py.model.openai_responses import OpenAIResponsesModel
from agentscope_py.model.openai_responses import _EventReader as _ResponsesReader

from .fakes import (
    an_block,
    an_end,
    an_start,
    an_text,
    an_text_block,
    an_tool_block,
    get_weather,
    oa_chunk,
    oa_text,
    oa_tool_calls,
    open_brackets,
)
from .responses_wire import ResponseStream

pytestmark = pytest.mark.timeout(60)

# Cases per property and reader or model: 4 readers x 2 byte strategies and 4 models' hostile
# replies, x 300 = 3,600 in CI; FUZZ_EXAMPLES=4000 runs 48,000 (the size of the runs that found
# the raw exceptions).
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=False)

# JSON value texts as a hostile server might write them (Python's json reads Infinity and NaN),
# by name, so that a failing case prints short.
HOSTILE_VALUES = {
    "inf": "Infinity", "-inf": "-Infinity", "nan": "NaN", "huge": "1e999", "null": "null", "true": "true",
    "list": "[]", "object": "{}", "empty": '""', "text": '"x"', "zero": "0", "minus": "-1", "float": "3.5",
    "long-int": "1" * 400, "deep-list": "[" * 3000 + "]" * 3000,
    "deep-object": '{"a": ' * 2000 + "1" + "}" * 2000, "surrogate": '"\\ud800"', "cut": "[1,", "nul": '"\\u0000"',
}
HOSTILE = st.sampled_from(sorted(HOSTILE_VALUES)).map(HOSTILE_VALUES.__getitem__)
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=4,
).map(json.dumps)
VALUE = HOSTILE | JSONISH
# Values a server means, so that a frame with one or two hostile values among them gets far into
# the agent: a call to a tool it has, with arguments it takes, a reasoning item it sends back.
MEANT = st.sampled_from(['"rs_1"', '"call_1"', '"get_weather"', '"{\\"city\\": \\"Paris\\"}"', '"hello"', "0", "1",
                         '"gAAAAB-opaque"', '{"type": "summary_text", "text": "hm"}'])

# Frames of each wire format with holes (§) for hostile values.
OPENAI_FRAMES = [
    'data: {"model": §, "choices": [{"index": 0, "delta": {"content": §, "reasoning_content": §}}]}\n\n',
    'data: {"choices": [{"index": §, "delta": {"tool_calls": [{"index": §, "id": §, '
    '"function": {"name": §, "arguments": §}}]}, "finish_reason": §}]}\n\n',
    'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": §, '
    '"function": {"name": §, "arguments": §}}, §]}, "finish_reason": §}]}\n\n',
    'data: {"choices": §, "usage": §}\n\n',
    'data: {"choices": [], "usage": {"prompt_tokens": §, "completion_tokens": §, "prompt_tokens_details": §}}\n\n',
    'data: {"error": §}\n\n', "event: error\ndata: §\n\n", "data: §\n\n", ": ping\n\n", "data: [DONE]\n\n",
]
ANTHROPIC_FRAMES = [
    'event: message_start\ndata: {"type": "message_start", "message": {"model": §, "usage": §}}\n\n',
    'event: content_block_start\ndata: {"type": "content_block_start", "index": §, '
    '"content_block": {"type": "tool_use", "id": §, "name": §, "input": §}}\n\n',
    'event: content_block_start\ndata: {"type": "content_block_start", "index": 0, '
    '"content_block": {"type": "text", "text": §}}\n\n',
    'event: content_block_delta\ndata: {"type": "content_block_delta", "index": §, '
    '"delta": {"type": "input_json_delta", "partial_json": §}}\n\n',
    'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, "delta": §}\n\n',
    'event: message_delta\ndata: {"type": "message_delta", "delta": {"stop_reason": §}, "usage": §}\n\n',
    'event: error\ndata: {"type": "error", "error": §}\n\n', "event: §\ndata: §\n\n",
    'event: message_stop\ndata: {"type": "message_stop"}\n\n',
]
RESPONSES_FRAMES = [
    'event: response.created\ndata: {"type": "response.created", "response": {"id": §, "model": §}}\n\n',
    'event: response.output_item.added\ndata: {"type": "response.output_item.added", "output_index": §, '
    '"item": {"id": §, "type": "function_call", "call_id": §, "name": §, "arguments": §}}\n\n',
    'event: response.output_item.added\ndata: {"type": "response.output_item.added", "output_index": §, "item": §}\n\n',
    'data: {"type": "response.function_call_arguments.delta", "item_id": §, "output_index": §, "delta": §}\n\n',
    'data: {"type": "response.function_call_arguments.done", "item_id": §, "output_index": §, "arguments": §}\n\n',
    'data: {"type": "response.output_text.delta", "item_id": §, "output_index": §, "delta": §}\n\n',
    'data: {"type": "response.output_text.done", "item_id": §, "output_index": §, "text": §}\n\n',
    'data: {"type": "response.refusal.done", "item_id": §, "refusal": §}\n\n',
    'data: {"type": "response.reasoning_summary_text.delta", "item_id": §, "output_index": §, '
    '"summary_index": §, "delta": §}\n\n',
    'data: {"type": "response.reasoning_text.delta", "item_id": §, "delta": §}\n\n',
    'data: {"type": "response.output_item.done", "output_index": §, "item": {"id": §, "type": "function_call", '
    '"call_id": §, "name": §, "arguments": §}}\n\n',
    'data: {"type": "response.output_item.done", "output_index": §, "item": {"id": "m", "type": "message", '
    '"content": [{"type": "output_text", "text": §}, §]}}\n\n',
    'data: {"type": "response.output_item.done", "output_index": §, "item": {"id": §, "type": "reasoning", '
    '"summary": [{"type": "summary_text", "text": §}, §], "content": §, "encrypted_content": §}}\n\n',
    'data: {"type": "response.output_item.done", "output_index": §, "item": {"id": §, "type": "reasoning", '
    '"summary": [§], "encrypted_content": §}}\n\n',
    'data: {"type": "response.output_item.done", "item": §}\n\n',
    'data: {"type": "response.completed", "response": {"id": §, "model": §, "output": [§, {"type": "function_call"}], '
    '"usage": {"input_tokens": §, "output_tokens": §, "input_tokens_details": §, "output_tokens_details": §}}}\n\n',
    'data: {"type": "response.completed", "response": §}\n\n',
    'data: {"type": "response.incomplete", "response": {"incomplete_details": §, "usage": §}}\n\n',
    'data: {"type": "response.failed", "response": {"error": §}}\n\n',
    'data: {"type": "response.failed", "response": §}\n\n',
    'event: error\ndata: {"type": "error", "code": §, "message": §, "param": §}\n\n',
    'data: {"type": §, "output_index": §, "item_id": §}\n\n', "event: §\ndata: §\n\n", "data: §\n\n",
]
OLLAMA_FRAMES = [
    '{"model": §, "created_at": §, "message": {"role": "assistant", "content": §, "thinking": §}, "done": false}\n',
    '{"model": "m", "message": {"role": "assistant", "content": "", "tool_calls": [{"function": '
    '{"name": §, "arguments": §}}]}, "done": false}\n',
    '{"model": "m", "message": {"role": "assistant", "content": ""}, "done": true, "done_reason": §, '
    '"prompt_eval_count": §, "eval_count": §}\n',
    '{"error": §}\n', "§\n", "\n",
]


def frames(templates: list[str], value: st.SearchStrategy[str] = VALUE) -> st.SearchStrategy[bytes]:
    def fill(template: str, values: list[str]) -> str:
        texts = template.split("§")
        return "".join(t + v for t, v in zip(texts, [*values[: len(texts) - 1], ""], strict=True))

    holes = max(template.count("§") for template in templates)
    frame = st.tuples(st.sampled_from(templates), st.lists(value, min_size=holes, max_size=holes)).map(lambda t: fill(*t))
    return st.lists(frame, max_size=5).map(lambda fs: "".join(fs).encode())


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for p in points:
        pieces.append(data[last:p])
        last = p
    pieces.append(data[last:])
    return [p for p in pieces if p]


async def _body(pieces: list[bytes]) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


def _sse(decoder: Callable[[], Any], provider: str, terminator: str) -> Callable[[list[bytes]], AsyncIterator[ChatChunk]]:
    def read(pieces: list[bytes]) -> AsyncIterator[ChatChunk]:
        response = httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=_body(pieces))
        return stream_chunks(lambda: contextlib.nullcontext(response), decoder(), provider=provider, terminator=terminator,
                             timeout_errors=httpx2.TimeoutException, transport_errors=httpx2.TransportError)
    return read


def _ollama(pieces: list[bytes]) -> AsyncIterator[ChatChunk]:
    return read_ndjson(httpx.Response(200, headers={"content-type": "application/x-ndjson"}, content=_body(pieces)))


READERS = {
    "openai": (_sse(_ChunkReader, "openai", "[DONE]"), OPENAI_FRAMES),
    "anthropic": (_sse(_EventReader, "anthropic", "message_stop"), ANTHROPIC_FRAMES),
    "ollama": (_ollama, OLLAMA_FRAMES),
    "responses": (_sse(_ResponsesReader, "openai", "response.completed"), RESPONSES_FRAMES),
}


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


def assert_typed(chunk: ChatChunk) -> None:
    """Every field holds its declared type: a provider's hostile value never rides a chunk into
    the agent, where it would fail later as a raw exception."""
    assert isinstance(chunk, ChatChunk)
    for name in ("text", "thinking", "thinking_signature", "finish_reason", "model"):
        assert isinstance(getattr(chunk, name), str | None), (name, chunk)
    assert isinstance(chunk.usage, ChatUsage | None), chunk
    if chunk.usage is not None:  # counts a call can have: a budget neither credited nor overflowed
        assert all(0 <= count < MAX_TOKENS for count in chunk.usage.model_dump().values()), chunk
    call = chunk.tool_call
    if call is not None:
        assert type(call.index) is int and isinstance(call.arguments, str), call
        assert isinstance(call.id, str | None) and isinstance(call.name, str | None), call


def only_typed_errors(loop: asyncio.AbstractEventLoop, name: str, data: bytes, cuts: list[int]) -> None:
    read = READERS[name][0]

    async def run() -> None:
        try:
            async with contextlib.aclosing(read(split(data, cuts))) as chunks:
                async for chunk in chunks:
                    assert_typed(chunk)
        except ModelError:
            pass  # typed: retry and fallback know what to do with it
    loop.run_until_complete(run())  # anything else propagates and fails the case


CUTS = st.lists(st.integers(min_value=0, max_value=1 << 16), max_size=6)


@pytest.mark.parametrize("name", sorted(READERS))
def test_random_bytes(loop: asyncio.AbstractEventLoop, name: str) -> None:
    @FUZZ
    @given(data=st.binary(max_size=400) | frames(READERS[name][1]).map(lambda b: b[: len(b) // 2]), cuts=CUTS)
    def case(data: bytes, cuts: list[int]) -> None:
        only_typed_errors(loop, name, data, cuts)
    case()


@pytest.mark.parametrize("name", sorted(READERS))
def test_near_valid_frames_with_hostile_values(loop: asyncio.AbstractEventLoop, name: str) -> None:
    @FUZZ
    @given(data=frames(READERS[name][1]), cuts=CUTS)
    def case(data: bytes, cuts: list[int]) -> None:
        only_typed_errors(loop, name, data, cuts)
    case()


# -- a hostile reply inside an agent's turn, and the turn after it -------------------------------
#
# The chunks the readers give go into the agent, and what it keeps of them goes back to the server
# on the next request. A hostile reply may fail its turn, with a `ModelError` alone, and leaves the
# session able to take its next turn: every block it opened closed, nothing kept that the next
# request cannot carry (a NaN, a lone surrogate). The replies are valid ones (reasoning, text, a
# tool call) with a few edits: a value anywhere in an event replaced by a hostile one, an event
# dropped (an item done that never started) or sent twice.

_CALL = ("call_1", "get_weather", '{"city": ', '"Paris"}')
VALID = {
    "openai": [oa_chunk({"role": "assistant", "reasoning_content": "hm"}), oa_chunk({"content": "hello"}),
               *oa_tool_calls((_CALL[0], _CALL[1], list(_CALL[2:])))],
    "anthropic": [an_start(), *an_block(0, {"type": "thinking", "thinking": "", "signature": ""},
                                        [{"type": "thinking_delta", "thinking": "hm"},
                                         {"type": "signature_delta", "signature": "sig=="}]),
                  *an_text_block(1, "hello"), *an_tool_block(2, *_CALL), *an_end("tool_use", 7)],
    "responses": ResponseStream().reasoning("hm").text("hello").call(*_CALL).completed(),
}
FINE = {
    "openai": oa_text("fine"),
    "anthropic": an_text("fine"),
    "responses": ResponseStream().text("fine").completed(),
}
MODELS: dict[str, Callable[[], SDKModel[Any]]] = {
    "openai": lambda: OpenAIChatModel("gpt-fake", base_url="http://127.0.0.1:9/v1", api_key="k"),
    "anthropic": lambda: AnthropicChatModel("claude-fake", base_url="http://127.0.0.1:9", api_key="k"),
    "responses": lambda: OpenAIResponsesModel("gpt-fake", base_url="http://127.0.0.1:9/v1", api_key="k"),
    # (the next request continues the response it read: its id goes back to the server)
    "responses-chained": lambda: OpenAIResponsesModel("gpt-fake", base_url="http://127.0.0.1:9/v1", api_key="k",
                                                      store=True, previous_response_id="auto"),
}
VALID["responses-chained"], FINE["responses-chained"] = VALID["responses"], FINE["responses"]
_HOLE = "\x00hole\x00"


def _slots(value: Any) -> Iterator[tuple[Any, Any]]:
    """Every (container, key) of a JSON value, the nested ones too."""
    keys = value.keys() if isinstance(value, dict) else range(len(value)) if isinstance(value, list) else ()
    for key in keys:
        yield value, key
        yield from _slots(value[key])


def _replace(part: bytes, pick: int, hostile: str) -> bytes:
    """``part`` (an SSE event) with the ``pick``-th value of its JSON replaced by ``hostile``."""
    head, sep, data = part.partition(b"data: ")
    try:
        payload = json.loads(data)
    except (ValueError, RecursionError):
        return part  # [DONE], or a value an earlier edit nested too deeply
    slots = list(_slots(payload))
    if not slots:
        return part
    container, key = slots[pick % len(slots)]
    container[key] = _HOLE
    return head + sep + json.dumps(payload).replace(json.dumps(_HOLE), hostile).encode() + b"\n\n"


def edited(parts: list[bytes | float], edits: list[tuple[int, str, int, str]]) -> bytes:
    out = [p for p in parts if isinstance(p, bytes)]
    for at, how, pick, hostile in edits:
        at %= len(out)
        if how == "value":
            out[at] = _replace(out[at], pick, hostile)
        elif how == "drop":
            del out[at]
        else:
            out.insert(at, out[at])
    return b"".join(out)


EDITS = st.lists(st.tuples(st.integers(0, 1 << 16), st.sampled_from(["value", "value", "drop", "repeat"]),
                           st.integers(0, 1 << 16), VALUE), min_size=1, max_size=3)


def scripted(name: str, first: list[bytes]) -> SDKModel[Any]:
    """The provider's model, its requests written as the aiohttp path writes them (`body_bytes`,
    which raises for a value it cannot write) and answered by ``first``, then by fine replies."""
    model = MODELS[name]()
    replies = [first]

    def answer(params: dict[str, Any]) -> contextlib.nullcontext[httpx2.Response]:
        assert body_bytes(wire_body(params)) is not None
        pieces = replies.pop() if replies else [p for p in FINE[name] if isinstance(p, bytes)]
        return contextlib.nullcontext(
            httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=_body(pieces)))

    model._open = answer  # type: ignore[method-assign]
    return model


PRICES = {name: ModelPrice(input=1.0, output=2.0) for name in ("gpt-fake", "claude-fake")}


def hostile_turn_then_next(loop: asyncio.AbstractEventLoop, name: str, data: bytes, cuts: list[int]) -> None:
    # (a budget prices each call's usage: a count past what a float holds would overflow it)
    agent = ReActAgent(model=scripted(name, split(data, cuts)), tools=[get_weather], max_iters=3,
                       middlewares=[BudgetMiddleware(run_cost=1e9, prices=PRICES)])

    async def run() -> None:
        events: list[Any] = []
        try:
            async for event in agent.stream("hi"):
                events.append(event)
        except ModelError:
            pass  # typed: retry and fallback know what to do with it
        assert not open_brackets(events), events
        reply = await agent.call("again")
        assert reply.text == "fine", reply
    loop.run_until_complete(run())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hostile_reply_fails_its_turn_alone(loop: asyncio.AbstractEventLoop, name: str) -> None:
    @FUZZ
    @given(edits=EDITS, cuts=CUTS)
    def case(edits: list[tuple[int, str, int, str]], cuts: list[int]) -> None:
        hostile_turn_then_next(loop, name, edited(VALID[name], edits), cuts)
    case()


# The smallest case of each way a hostile reply can break its turn or the next one, which the
# properties reach only now and then: a wrong-typed value riding a chunk into the agent (a raw
# AttributeError, a pydantic ValidationError), a value the next request cannot carry (every later
# turn a raw ValueError), one call id given to two calls (its tool run twice), a count a budget
# cannot price.
_FOUND = {
    "anthropic text not a text": ("anthropic", b'event: content_block_start\ndata: {"type": "content_block_start", '
                                  b'"index": 0, "content_block": {"type": "text", "text": 1}}\n\n'),
    "openai call name not a text": ("openai", b'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, '
                                    b'"id": "c", "function": {"name": -Infinity, "arguments": "{}"}}]}}]}\n\n'),
    "responses call id not a text": ("responses", b'data: {"type": "response.output_item.added", "output_index": 0, '
                                     b'"item": {"type": "function_call", "call_id": 5, "name": "get_weather"}}\n\n'),
    "responses reasoning item with NaN": (
        "responses", b'data: {"type": "response.output_item.done", "output_index": 0, "item": {"id": "rs_1", '
                     b'"type": "reasoning", "summary": [], "encrypted_content": NaN}}\n\n'
                     b'data: {"type": "response.output_text.delta", "output_index": 1, "delta": "hello"}\n\n'
                     b'data: {"type": "response.completed", "response": {}}\n\n'),
    "responses reasoning item with a lone surrogate": (
        "responses", b'data: {"type": "response.output_item.done", "output_index": 0, "item": {"id": "rs_1", '
                     b'"type": "reasoning", "summary": [], "encrypted_content": "\\ud800"}}\n\n'
                     b'data: {"type": "response.output_text.delta", "output_index": 1, "delta": "hello"}\n\n'
                     b'data: {"type": "response.completed", "response": {}}\n\n'),
    "openai call id with a lone surrogate": (
        "openai", b'data: {"choices": [{"index": 0, "delta": {"content": "hello", "tool_calls": [{"index": 0, '
                  b'"id": "\\udc00", "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"P\\"}"}}]}}]}\n\n'
                  b'data: [DONE]\n\n'),
    "responses-chained response id with a lone surrogate": (
        "responses-chained", b"".join(p for p in ResponseStream(response_id="\ud800").text("hello").completed()
                                      if isinstance(p, bytes))),
    "openai usage past what a float holds": (
        "openai", b'data: {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}], '
                  b'"usage": {"prompt_tokens": 1' + b"0" * 400 + b', "completion_tokens": 1}}\n\ndata: [DONE]\n\n'),
    "one call id at two indexes": (
        "openai", b'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c", '
                  b'"function": {"name": "get_weather", "arguments": "{\\"city\\": \\"P\\"}"}}]}}]}\n\n' * 2
                  + b'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "c", '
                    b'"function": {"name": "get_weather", "arguments": "{\\"city\\": \\"P\\"}"}}]}}]}\n\n'
                  + b'data: [DONE]\n\n'),
}


_COUNTS = {
    "openai": 'data: {"choices": [], "usage": {"prompt_tokens": §, "completion_tokens": §}}\n\ndata: [DONE]\n\n',
    "anthropic": 'event: message_delta\ndata: {"type": "message_delta", "delta": {}, "usage": {"input_tokens": §, '
                 '"output_tokens": §}}\n\nevent: message_stop\ndata: {"type": "message_stop"}\n\n',
    "responses": 'data: {"type": "response.completed", "response": {"usage": {"input_tokens": §, '
                 '"output_tokens": §}}}\n\n',
    "ollama": '{"model": "m", "message": {"role": "assistant", "content": ""}, "done": true, "prompt_eval_count": §, '
              '"eval_count": §}\n',
}


@pytest.mark.parametrize("name", sorted(_COUNTS))
@pytest.mark.parametrize("count", ["-5", "1" + "0" * 400])
def test_a_token_count_no_call_has_is_read_as_unknown(loop: asyncio.AbstractEventLoop, name: str, count: str) -> None:
    # A negative count would credit a budget; one past what a float holds overflows its price.
    async def usages() -> list[Any]:
        pieces = [_COUNTS[name].replace("§", count).encode()]
        async with contextlib.aclosing(READERS[name][0](pieces)) as chunks:
            return [chunk.usage async for chunk in chunks if chunk.usage is not None]
    assert loop.run_until_complete(usages()) == []


@pytest.mark.parametrize("case", sorted(_FOUND))
def test_found_cases(loop: asyncio.AbstractEventLoop, case: str) -> None:
    name, data = _FOUND[case]
    hostile_turn_then_next(loop, name, data, [])


async def test_one_call_id_twice_fails_the_reply_before_the_tool_runs() -> None:
    agent = ReActAgent(model=scripted("openai", [_FOUND["one call id at two indexes"][1]]), tools=[get_weather])
    events: list[Any] = []
    with pytest.raises(ModelError, match="the tool call id 'c' names a call this reply already made"):
        async for event in agent.stream("hi"):
            events.append(event)
    assert not open_brackets(events)
    assert [e.tool_call_id for e in events if isinstance(e, ToolCallStart)] == ["c"]
    assert not any(isinstance(e, ToolResultStart) for e in events)
