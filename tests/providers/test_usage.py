"""Usage a server does not report is unknown (None), never zero.

llama.cpp's server ignores ``stream_options.include_usage`` and sends no usage; a run against it
showed ``0 in · 0 out``. Each provider must leave ``usage`` None then, in its chunks and so in
``ModelCallEnd.usage``.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentscope_py import Msg, ReActAgent
from agentscope_py.message import ChatUsage
from agentscope_py.model import ModelRequest

from .fakes import (
    DONE,
    FakeServer,
    Reply,
    an_end,
    an_event,
    an_text_block,
    collect,
    ndjson,
    oa_chunk,
    ol_line,
    text_of,
)

pytestmark = pytest.mark.timeout(15)


def ask() -> ModelRequest:
    return ModelRequest(messages=[Msg.user("hi")])


def usages(chunks: list[Any]) -> list[Any]:
    return [c.usage for c in chunks if c.usage is not None]


LLAMA_CPP_STYLE = [oa_chunk({"role": "assistant", "content": ""}), oa_chunk({"content": "Hello"}),
                   oa_chunk({}, "stop"), DONE]  # no usage chunk although include_usage was asked for


async def test_openai_without_usage_chunk(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply(LLAMA_CPP_STYLE), Reply(LLAMA_CPP_STYLE))
    chunks = await collect(make_openai().stream(ask()))
    assert text_of(chunks) == "Hello" and usages(chunks) == []
    agent = ReActAgent.builder().model(make_openai()).build()
    events = [ev async for ev in agent.stream("hi")]
    (end,) = [e for e in events if e.type == "model_call_end"]
    assert end.usage is None  # type: ignore[attr-defined]


@pytest.mark.parametrize("usage", [{}, {"total_tokens": None}, {"prompt_tokens": None, "completion_tokens": None}])
async def test_openai_usage_without_counts(server: FakeServer, make_openai: Any, usage: dict[str, Any]) -> None:
    server.queue(Reply([oa_chunk({"content": "Hi"}), oa_chunk({}, "stop"), oa_chunk(choices=False, usage=usage), DONE]))
    assert usages(await collect(make_openai().stream(ask()))) == []


async def test_openai_partial_counts_are_kept(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply([oa_chunk({"content": "Hi"}), oa_chunk({}, "stop"),
                        oa_chunk(choices=False, usage={"prompt_tokens": 7, "completion_tokens_details": None}), DONE]))
    assert usages(await collect(make_openai().stream(ask()))) == [ChatUsage(input_tokens=7, output_tokens=0)]


async def test_anthropic_without_usage(server: FakeServer, make_anthropic: Any) -> None:
    start = an_event({"type": "message_start", "message": {"id": "m", "type": "message", "role": "assistant",
                                                           "content": [], "model": "claude-fake"}})
    end = [an_event({"type": "message_delta", "delta": {"stop_reason": "end_turn"}}), an_event({"type": "message_stop"})]
    server.queue(Reply([start, *an_text_block(0, "Hi"), *end]))
    chunks = await collect(make_anthropic().stream(ask()))
    assert text_of(chunks) == "Hi" and usages(chunks) == []
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"]


async def test_anthropic_with_usage_still_reports_it(server: FakeServer, make_anthropic: Any) -> None:
    start = an_event({"type": "message_start", "message": {"id": "m", "type": "message", "role": "assistant",
                                                           "content": [], "model": "c", "usage": {"input_tokens": 3}}})
    server.queue(Reply([start, *an_text_block(0, "Hi"), *an_end("end_turn", 2)]))
    assert usages(await collect(make_anthropic().stream(ask()))) == [ChatUsage(input_tokens=3, output_tokens=2)]


async def test_ollama_done_line_without_counts(server: FakeServer, make_ollama: Any) -> None:
    server.queue(ndjson([ol_line("Hi"), ol_line(done=True, done_reason="stop")]))
    chunks = await collect(make_ollama().stream(ask()))
    assert text_of(chunks) == "Hi" and usages(chunks) == []
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"]
