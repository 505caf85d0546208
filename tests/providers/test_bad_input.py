"""Servers that misbehave get a typed `ModelError` quoting what they sent, through the real SDKs.

Each case here was a raw exception (or an error without the server's words) before: retry and
fallback act on `ModelError` alone, and a user needs to see what the server said.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentscope_py import ReActAgent
from agentscope_py.model import MalformedStreamError, ModelError, ServerError

from .fakes import DONE, FakeServer, Reply, an_event, an_start, collect, ndjson, oa_chunk, ol_line, sse
from .test_usage import ask

pytestmark = pytest.mark.timeout(15)


def _nested_past_the_parser() -> str:
    """A JSON array nested deeper than this interpreter's JSON parser reads: its limit follows
    CPython's C recursion limit (about 1,000 levels on 3.11, 1,500 on 3.12, 10,000 on 3.13)."""
    for depth in (5_000, 50_000, 500_000):
        nested = "[" * depth + "]" * depth
        try:
            json.loads(nested)
        except RecursionError:
            return nested
    raise AssertionError("json.loads read an array nested 500,000 deep")


DEEP = _nested_past_the_parser()
HTML = ("<!DOCTYPE html><html><head><title>502 Bad Gateway</title></head><body><h1>Bad Gateway</h1>"
        "<p>The upstream model server did not answer.</p>" + "<!-- padding -->" * 60 + "</body></html>")


async def fails(model: Any, match: str) -> MalformedStreamError:
    with pytest.raises(MalformedStreamError, match=match) as info:
        await collect(model.stream(ask()))
    return info.value


# -- OpenAI-compatible -------------------------------------------------------------------------


async def test_openai_infinite_tool_call_index(server: FakeServer, make_openai: Any) -> None:
    frame = b'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": Infinity, "id": "c"}]}}]}\n\n'
    server.queue(Reply([oa_chunk({"content": "a"}), frame, DONE]))
    error = await fails(make_openai(), "unexpected event")
    assert '"index": Infinity' in str(error) and "OverflowError" in str(error)


async def test_openai_deeply_nested_json(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply([sse(f'{{"choices": {DEEP}}}'), DONE]))
    error = await fails(make_openai(), "invalid JSON")
    assert "[[[[" in str(error) and len(str(error)) < 700  # quoted, but only the first 500 characters


@pytest.mark.parametrize("content_type", ["text/html; charset=utf-8", "text/plain"])
async def test_openai_html_page_with_status_200(server: FakeServer, make_openai: Any, content_type: str) -> None:
    server.queue(Reply([HTML.encode()], content_type=content_type, chunked=False))
    error = await fails(make_openai(), "expected an event stream")
    assert "502 Bad Gateway" in str(error) and "upstream model server did not answer" in str(error)
    assert HTML[:500] in str(error) and HTML[:520] not in str(error)


async def test_openai_invalid_json_in_data_lines(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply([oa_chunk({"content": "a"}), b"data: {'content': 'single quotes are not JSON'}\n\n", DONE]))
    await fails(make_openai(), "invalid JSON in event data: .*single quotes are not JSON")


async def test_openai_never_sends_done(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply([oa_chunk({"content": "looks complete"}), oa_chunk({}, "stop")]))
    await fails(make_openai(), r"without \[DONE\]")


async def test_html_page_keeps_the_user_message(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply([HTML.encode()], content_type="text/html", chunked=False))
    agent = ReActAgent.builder().model(make_openai()).build()
    with pytest.raises(ModelError, match="502 Bad Gateway"):
        await agent.call("Is anyone there?")
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and [m.text for m in state.context] == ["Is anyone there?"]


# -- Anthropic ---------------------------------------------------------------------------------


async def test_anthropic_infinite_block_index(server: FakeServer, make_anthropic: Any) -> None:
    frame = b'event: content_block_start\ndata: {"type": "content_block_start", "index": Infinity, ' \
            b'"content_block": {"type": "text", "text": "hi"}}\n\n'
    server.queue(Reply([an_start(), frame, an_event({"type": "message_stop"})]))
    error = await fails(make_anthropic(), "unexpected event")
    assert "Infinity" in str(error)


async def test_anthropic_deeply_nested_json(server: FakeServer, make_anthropic: Any) -> None:
    server.queue(Reply([an_start(), f"event: content_block_delta\ndata: {DEEP}\n\n".encode()]))
    await fails(make_anthropic(), "invalid JSON")


async def test_anthropic_html_page(server: FakeServer, make_anthropic: Any) -> None:
    server.queue(Reply([HTML.encode()], content_type="text/html", chunked=False))
    await fails(make_anthropic(), "expected an event stream, got text/html: .*502 Bad Gateway")


# -- Ollama ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("line", "match"), [
    (b'["not", "an", "object"]\n', r"not a JSON object: .*\[\"not\""),
    (b'"just a string"\n', "not a JSON object"),
    (b'{"error": 42}\n', "error is not a text: .*42"),
    (b'{"error": ["a", "list"]}\n', "error is not a text"),
    (DEEP.encode() + b"\n", r"nested too deeply.*\[\[\["),
    (b'{"model": "m", "message": {"role": "assistant", "content": ""}, "done": true, "eval_count": "many"}\n',
     "not a chat response .eval_count.*many"),
])
async def test_ollama_lines_of_the_wrong_shape(server: FakeServer, make_ollama: Any, line: bytes, match: str) -> None:
    server.queue(ndjson([ol_line("a"), line, ol_line(done=True)]))
    await fails(make_ollama(), match)


async def test_ollama_error_object_is_an_error(server: FakeServer, make_ollama: Any) -> None:
    line = json.dumps({"error": {"message": "model runner crashed", "type": "server_error"}}).encode() + b"\n"
    server.queue(ndjson([ol_line("a"), line]))
    with pytest.raises(ServerError, match="model runner crashed"):
        await collect(make_ollama().stream(ask()))


async def test_ollama_html_error_page(server: FakeServer, make_ollama: Any) -> None:
    server.queue(Reply([HTML.encode()], status=502, content_type="text/html", chunked=False))
    with pytest.raises(ServerError, match="502 Bad Gateway") as info:
        await collect(make_ollama().stream(ask()))
    assert info.value.status_code == 502
