"""The SSE reader feeding its consumer (`stream_chunks`, ``asend(feed)``): the model call's read
sends it the parts manager's feed after the first chunk, and the reader hands every later chunk
to it and yields none, letting the loop run within a long burst; over real HTTP, the agent's
reply is the same either way."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest

from agentscope_py import ReActAgent
from agentscope_py.model import ChatChunk, MalformedStreamError
from agentscope_py.model._convert import FED_TURN, stream_chunks
from agentscope_py.model.openai import _ChunkReader

from .fakes import DONE, FakeServer, Reply, oa_chunk

pytestmark = pytest.mark.timeout(15)


def _text(content: str) -> bytes:
    body = {"choices": [{"index": 0, "delta": {"content": content}}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _body(pieces: list[bytes]) -> AsyncIterator[bytes]:
    for piece in pieces:
        await asyncio.sleep(0)
        yield piece


def _reader(pieces: list[bytes]) -> Any:
    response = httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=_body(pieces))
    return stream_chunks(lambda: contextlib.nullcontext(response), _ChunkReader(), provider="openai",
                         terminator="[DONE]", timeout_errors=httpx2.TimeoutException,
                         transport_errors=httpx2.TransportError)


async def test_a_reader_sent_a_feed_hands_it_every_later_chunk() -> None:
    words = [f"w{k} " for k in range(6)]
    it = _reader([_text(w) for w in words] + [b'data: {"choices": [{"index": 0, "delta": {}, '
                                               b'"finish_reason": "stop"}]}\n\n', b"data: [DONE]\n\n"])
    first = await it.__anext__()
    fed: list[ChatChunk] = []
    with pytest.raises(StopAsyncIteration):  # it yields nothing more: every chunk went to the feed
        await it.asend(fed.append)
    assert [first.text] + [c.text for c in fed if c.text] == words
    assert fed[-1].finish_reason == "stop"


async def test_a_fed_burst_lets_the_loop_run() -> None:
    # A whole reply in one piece of the body: fed in runs of at most FED_TURN chunks, the loop
    # running between them (a server far ahead of its reader does not hold the loop).
    n = 3 * FED_TURN + 5
    it = _reader([_text("a"), b"".join(_text(f"{k}") for k in range(n)) + b"data: [DONE]\n\n"])
    await it.__anext__()
    ticks = 0
    running = True

    def tick() -> None:
        nonlocal ticks
        ticks += 1
        if running:
            asyncio.get_running_loop().call_soon(tick)

    asyncio.get_running_loop().call_soon(tick)
    at: list[int] = []
    with pytest.raises(StopAsyncIteration):
        await it.asend(lambda chunk: at.append(ticks))
    running = False
    assert len(at) == n
    per_turn = [at.count(t) for t in sorted(set(at))]
    assert max(per_turn) <= FED_TURN
    assert len(per_turn) >= n // FED_TURN


async def test_a_fed_reader_still_refuses_a_bad_payload() -> None:
    it = _reader([_text("a"), _text("b") + b"data: {not json\n\n"])
    await it.__anext__()
    fed: list[ChatChunk] = []
    with pytest.raises(MalformedStreamError):
        await it.asend(fed.append)
    assert [c.text for c in fed] == ["b"]


async def test_an_agent_reads_a_streamed_reply_through_the_feed(server: FakeServer, make_openai: Any) -> None:
    # Over real HTTP, a reply of many pieces and one burst: the deltas the caller sees, in order,
    # and the reply memory keeps are the provider's text, whichever way each chunk came.
    words = [f"t{k} " for k in range(40)]
    parts: list[bytes | float] = [_text(w) for w in words[:20]]
    parts += [0.01, b"".join(_text(w) for w in words[20:]), oa_chunk({}, "stop"), DONE]
    server.queue(Reply(parts))
    agent = ReActAgent.builder().model(make_openai()).build()
    events = await agent.stream("hi").to_list()
    assert "".join(e.delta for e in events if e.type == "text_block_delta") == "".join(words)
    assert [e.type for e in events].count("text_block_end") == 1
    assert events[-2].result.text == "".join(words)


async def test_a_users_generator_model_is_never_sent_a_value() -> None:
    # A user's model whose `stream` is an async generator reading what its `yield` receives gets
    # what `async for` sends (None) at every chunk: only the providers' own reader takes the feed.
    received: list[object] = []

    class Echo:
        name = "echo"

        async def stream(self, request: Any) -> AsyncIterator[ChatChunk]:
            for word in ("a", "b", "c"):
                received.append((yield ChatChunk(text=word)))
            yield ChatChunk(finish_reason="stop")

    agent = ReActAgent.builder().model(Echo()).build()
    reply = await agent.call("hi")
    assert reply.text == "abc"
    assert received == [None, None, None]
