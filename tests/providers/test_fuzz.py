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

from agentscope_py.model import ChatChunk, ModelError
from agentscope_py.model._convert import stream_chunks
from agentscope_py.model.anthropic import _EventReader
from agentscope_py.model.ollama import read_ndjson
from agentscope_py.model.openai import _ChunkReader

pytestmark = pytest.mark.timeout(60)

# Cases per reader and strategy: 3 readers x 2 strategies x 300 = 1,800 in CI; FUZZ_EXAMPLES=4000
# runs 24,000 (the size of the run that found the raw exceptions).
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

# Frames of each wire format with holes (§) for hostile values.
OPENAI_FRAMES = [
    'data: {"model": §, "choices": [{"index": 0, "delta": {"content": §, "reasoning_content": §}}]}\n\n',
    'data: {"choices": [{"index": §, "delta": {"tool_calls": [{"index": §, "id": §, '
    '"function": {"name": §, "arguments": §}}]}, "finish_reason": §}]}\n\n',
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
OLLAMA_FRAMES = [
    '{"model": §, "created_at": §, "message": {"role": "assistant", "content": §, "thinking": §}, "done": false}\n',
    '{"model": "m", "message": {"role": "assistant", "content": "", "tool_calls": [{"function": '
    '{"name": §, "arguments": §}}]}, "done": false}\n',
    '{"model": "m", "message": {"role": "assistant", "content": ""}, "done": true, "done_reason": §, '
    '"prompt_eval_count": §, "eval_count": §}\n',
    '{"error": §}\n', "§\n", "\n",
]


def frames(templates: list[str]) -> st.SearchStrategy[bytes]:
    def fill(template: str, values: list[str]) -> str:
        holes = template.split("§")
        return "".join(h + v for h, v in zip(holes, [*values[: len(holes) - 1], ""], strict=True))

    frame = st.tuples(st.sampled_from(templates), st.lists(VALUE, min_size=6, max_size=6)).map(lambda t: fill(*t))
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
}


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


def only_typed_errors(loop: asyncio.AbstractEventLoop, name: str, data: bytes, cuts: list[int]) -> None:
    read = READERS[name][0]

    async def run() -> None:
        try:
            async with contextlib.aclosing(read(split(data, cuts))) as chunks:
                async for chunk in chunks:
                    assert isinstance(chunk, ChatChunk)
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
