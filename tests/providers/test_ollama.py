"""Ollama /api/chat (NDJSON) against a byte-exact fake server."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import sys
from typing import Any

import aiohttp
import ollama
import pytest

from agentscope_py import ReActAgent
from agentscope_py.message import ChatUsage
from agentscope_py.model import (
    BadRequestError,
    MalformedStreamError,
    RateLimitError,
    ServerError,
    ToolSchema,
)
from agentscope_py.model import (
    ModelConnectionError as ConnectionError,
)
from agentscope_py.model import (
    ModelTimeoutError as TimeoutError,
)
from agentscope_py.model import ollama as ollama_model
from agentscope_py.model.ollama import OllamaChatModel
from agentscope_py.model.registry import resolve_model

from .fakes import (
    FakeServer,
    Reply,
    ask,
    calls_of,
    collect,
    get_weather,
    give_up,
    ndjson,
    ol_done,
    ol_line,
    ol_text,
    text_of,
    thinking_of,
)

pytestmark = pytest.mark.timeout(15)


def weather_call(city: str) -> dict[str, Any]:
    return {"function": {"name": "get_weather", "arguments": {"city": city}}}


async def test_thinking_text_usage_and_options(server: FakeServer, make_ollama: Any) -> None:
    server.queue(ndjson([ol_line(thinking="Hmm, "), ol_line(thinking="easy."), ol_line("Hello"),
                         ol_line(" there"), ol_done("stop", prompt=12, output=6)]))
    model = make_ollama(think=True, temperature=0.3, keep_alive="5m")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chunks = await collect(model.stream(ask(options={"max_tokens": 64, "num_ctx": 4096},
                                            structured_output=schema)))
    assert thinking_of(chunks) == "Hmm, easy."
    assert text_of(chunks) == "Hello there"
    (last,) = [c for c in chunks if c.usage]
    assert last.usage == ChatUsage(input_tokens=12, output_tokens=6)
    assert last.finish_reason == "stop" and last.model == "llama-fake"

    (request,) = server.requests
    assert request.path == "/api/chat"
    assert request.body == {
        "model": "llama-fake", "messages": [{"role": "user", "content": "hi"}], "stream": True,  # no empty tools array
        "think": True, "keep_alive": "5m", "format": schema,
        "options": {"temperature": 0.3, "num_predict": 64, "num_ctx": 4096},
    }


async def test_whole_tool_calls_get_ids_and_json_arguments(server: FakeServer, make_ollama: Any) -> None:
    server.queue(ndjson([ol_line(tool_calls=[weather_call("Paris"), weather_call("Oslo")]), ol_done()]))
    tools = [ToolSchema("get_weather", "The weather", {"type": "object", "properties": {}})]
    chunks = await collect(make_ollama().stream(ask(tools=tools)))
    calls = calls_of(chunks)
    assert [(name, json.loads(args)) for _, name, args in calls.values()] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    ids = [call_id for call_id, _, _ in calls.values()]
    assert all(ids) and len(set(ids)) == 2
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["tool_calls"]  # Ollama said "stop"
    assert server.bodies[0]["tools"] == [t.to_openai() for t in tools]


@pytest.mark.parametrize(("reason", "ours"), [("stop", "stop"), ("length", "length"), ("unload", "unload")])
async def test_done_reasons(server: FakeServer, make_ollama: Any, reason: str, ours: str) -> None:
    server.queue(ndjson([ol_line("x"), ol_done(reason)]))
    chunks = await collect(make_ollama().stream(ask()))
    assert [c.finish_reason for c in chunks if c.finish_reason] == [ours]


async def test_react_agent_tool_round_then_answer(server: FakeServer, make_ollama: Any) -> None:
    server.queue(
        ndjson([ol_line(thinking="Need weather."), ol_line(tool_calls=[weather_call("Paris")]), ol_done()]),
        ndjson(ol_text("Sunny ", "in Paris.")),
    )
    agent = ReActAgent.builder().sys_prompt("Be brief.").model(make_ollama()).tools(get_weather).build()
    events = [ev async for ev in agent.stream("Weather in Paris?")]
    assert events[-2].result.text == "Sunny in Paris."  # type: ignore[union-attr]
    kinds = [e.type for e in events]
    assert kinds.count("tool_result_end") == 1 and kinds.count("model_call_end") == 2
    assert server.bodies[1]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "thinking": "Need weather.", "tool_calls": [weather_call("Paris")]},
        {"role": "tool", "content": "sunny in Paris", "tool_name": "get_weather"},
    ]


async def test_retry_after_on_429_then_success(server: FakeServer, make_ollama: Any) -> None:
    server.queue(Reply.json_error(429, {"error": "too many requests"}, retry_after="0"),
                 ndjson(ol_text("ok")))
    agent = ReActAgent.builder().model(make_ollama()).max_retries(1).build()
    assert (await agent.call("hi")).text == "ok"
    assert len(server.requests) == 2


@pytest.mark.parametrize(("reply", "error", "retry_after"), [
    (Reply.json_error(429, {"error": "too many requests"}, retry_after="3"), RateLimitError, 3.0),
    (Reply.json_error(404, {"error": "model 'llama-fake' not found"}), BadRequestError, None),
    (Reply.json_error(500, {"error": "llama runner process has terminated"}), ServerError, None),
])
async def test_http_errors(server: FakeServer, make_ollama: Any, reply: Reply, error: type[Exception],
                           retry_after: float | None) -> None:
    server.queue(reply)
    with pytest.raises(error) as info:
        await collect(make_ollama().stream(ask()))
    exc = info.value
    assert type(exc) is error and exc.status_code == reply.status  # type: ignore[attr-defined]
    assert exc.retry_after == retry_after and exc.provider == "ollama"  # type: ignore[attr-defined]
    assert json.loads(reply.parts[0])["error"] in str(exc)  # type: ignore[arg-type]


async def test_error_line_mid_stream(server: FakeServer, make_ollama: Any) -> None:
    server.queue(ndjson([ol_line("par"), b'{"error": "an error was encountered while running the model"}\n']))
    with pytest.raises(ServerError, match="while running the model"):
        await collect(make_ollama().stream(ask()))


@pytest.mark.parametrize(("parts", "kw", "match"), [
    ([ol_line("looks "), ol_line("complete")], {}, "done line"),
    ([ol_line("a"), b"garbage that is not json\n", ol_done()], {}, "not JSON"),
    ([ol_line("a"), ol_done()[:30]], {"chunked": False}, "not JSON"),  # cut mid-JSON, clean close
    ([ol_line("a"), ol_done()[:30]], {"end": "cut"}, "closed before"),  # cut mid-JSON, dropped
    ([b'{"done": false}\n', ol_done()], {}, "not a chat response .message"),
])
async def test_malformed_streams(server: FakeServer, make_ollama: Any, parts: list[bytes | float],
                                 kw: dict[str, Any], match: str) -> None:
    server.queue(ndjson(parts, **kw))
    with pytest.raises(MalformedStreamError, match=match):
        await collect(make_ollama().stream(ask()))


async def test_stalled_stream_times_out(server: FakeServer, make_ollama: Any) -> None:
    server.queue(ndjson([ol_line("Hi")], end="stall"))
    with pytest.raises(TimeoutError):
        await collect(make_ollama(timeout=0.3).stream(ask()))
    await asyncio.wait_for(server.hung_up.wait(), 2)


async def test_connection_refused() -> None:
    srv = FakeServer()
    await srv.start()
    url = srv.url
    await srv.stop()
    model = OllamaChatModel("m", host=url, timeout=2)
    try:
        with pytest.raises(ConnectionError):
            await collect(model.stream(ask()))
    finally:
        await model.aclose()


async def test_host_from_env_and_resolve_model(server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OLLAMA_HOST", server.url)
    server.queue(ndjson(ol_text("from env")))
    model = resolve_model("ollama:llama-fake")
    assert isinstance(model, OllamaChatModel) and model.provider == "ollama"
    try:
        assert text_of(await collect(model.stream(ask()))) == "from env"
    finally:
        await model.aclose()


async def test_closing_the_stream_closes_the_connection(
    server: FakeServer, make_ollama: Any, open_connections: Any
) -> None:
    server.queue(ndjson([ol_line("first")], end="stall"))
    model = make_ollama()
    stream = model.stream(ask())
    async with contextlib.aclosing(stream):
        assert (await anext(stream)).text == "first"
    await asyncio.wait_for(server.hung_up.wait(), 2)
    assert await open_connections(server, 0) == 0


@pytest.mark.parametrize("how", ["aclose", "cancel"])
async def test_giving_up_a_stream_closes_its_connection(
    server: FakeServer, make_ollama: Any, open_connections: Any, how: str
) -> None:
    server.queue(ndjson([ol_line("first")], end="stall"))
    stream = make_ollama().stream(ask())
    await give_up(stream, how)
    await asyncio.wait_for(server.hung_up.wait(), 2)  # the server saw the close, not a pooled idle
    assert server.hangups == 1 and await open_connections(server, 0) == 0


async def test_a_finished_stream_leaves_its_connection_to_the_next(server: FakeServer, make_ollama: Any) -> None:
    server.queue(ndjson(ol_text("one")), ndjson(ol_text("two")))
    model = make_ollama()
    assert [text_of(await collect(model.stream(ask()))) for _ in range(2)] == ["one", "two"]
    first, second = server.requests
    assert first.connection == second.connection and server.hangups == 0


async def test_an_html_error_page_is_a_typed_error_quoting_it(server: FakeServer, make_ollama: Any) -> None:
    server.queue(Reply([b"<html>bad gateway</html>"], status=502, content_type="text/html", chunked=False))
    with pytest.raises(ServerError, match="bad gateway") as info:
        await collect(make_ollama().stream(ask()))
    assert info.value.status_code == 502 and info.value.provider == "ollama"


async def test_the_default_path_touches_no_private_member_of_the_ollama_client(
        server: FakeServer, closing: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every attribute of the ollama client the model reads from our code, recorded: by default
    none is private (the client's own code may use its own)."""
    touched: list[str] = []

    class Spy(ollama.AsyncClient):
        def __getattribute__(self, attr: str) -> Any:
            if attr.startswith("_") and not attr.startswith("__"):
                caller = sys._getframe(1).f_code.co_filename
                if os.sep + "agentscope_py" + os.sep in caller:
                    touched.append(attr)
            return super().__getattribute__(attr)

    monkeypatch.setattr(ollama, "AsyncClient", Spy)
    server.queue(ndjson(ol_text("ok")))
    model = OllamaChatModel("llama-fake", host=server.url, timeout=5)
    closing.append(model)
    assert text_of(await collect(model.stream(ask()))) == "ok"
    assert isinstance(model.client, Spy) and touched == []
    model.http_client  # noqa: B018 - the recording hook reaches the client's HTTP client, a private member
    assert touched == ["_client"]


async def test_a_users_client_sends_every_request(server: FakeServer, closing: list[Any]) -> None:
    server.queue(ndjson(ol_text("mine")))
    model = OllamaChatModel("llama-fake", client=ollama.AsyncClient(host=server.url, headers={"x-mine": "1"}))
    closing.append(model)
    assert text_of(await collect(model.stream(ask()))) == "mine"
    assert server.requests[0].headers["x-mine"] == "1"  # its own headers: the client sent it


async def test_the_key_and_json_headers_go_out_over_aiohttp(
        server: FakeServer, make_ollama: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OLLAMA_API_KEY", "ol-key")
    server.queue(ndjson(ol_text("ok")))
    assert text_of(await collect(make_ollama().stream(ask()))) == "ok"
    headers = server.requests[0].headers
    assert headers["authorization"] == "Bearer ol-key"
    assert headers["content-type"] == headers["accept"] == "application/json"
    assert "aiohttp" in headers["user-agent"].lower()


async def test_a_given_http_session_carries_the_request(server: FakeServer, closing: list[Any]) -> None:
    server.queue(ndjson(ol_text("ok")))
    async with aiohttp.ClientSession(headers={"x-session": "given"}) as session:
        model = OllamaChatModel("llama-fake", host=server.url, http_session=session, timeout=5)
        closing.append(model)
        assert text_of(await collect(model.stream(ask()))) == "ok"
        await model.aclose()
        assert not session.closed  # the session is its owner's
    assert server.requests[0].headers["x-session"] == "given"


async def test_ollama_host_without_a_scheme_is_honoured(server: FakeServer, monkeypatch: pytest.MonkeyPatch,
                                                        closing: list[Any]) -> None:
    monkeypatch.setenv("OLLAMA_HOST", server.url.removeprefix("http://") + "/")
    server.queue(ndjson(ol_text("from env")))
    model = OllamaChatModel("llama-fake", timeout=5)
    closing.append(model)
    assert text_of(await collect(model.stream(ask()))) == "from env"
    assert server.requests[0].path == "/api/chat"


@pytest.mark.parametrize("host", [
    None, "", "1.2.3.4", ":56789", "1.2.3.4:56789", "http://1.2.3.4", "https://1.2.3.4",
    "https://example.com:56789", "example.com/", "example.com:56789/path/", "https://example.com:56789/path",
    "[0001:002:003:0004::1]", "http://[0001:002:003:0004::1]", "[0001:002:003:0004::1]:56789/path/",
])
def test_the_host_resolves_as_the_ollama_client_resolves_it(host: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our reading of ``host`` / ``OLLAMA_HOST`` against the ollama client's own (a private
    function of it: this fails when its resolution moves, so ours can follow)."""
    # (the package's default client, named ``_client`` too, hides the module as an attribute)
    parse_host = importlib.import_module("ollama._client")._parse_host
    monkeypatch.delenv("OLLAMA_HOST", raising=False)
    assert ollama_model._resolve_host(host) == parse_host(host)
    if host:
        monkeypatch.setenv("OLLAMA_HOST", host)
        assert ollama_model._resolve_host(None) == parse_host(os.environ["OLLAMA_HOST"])


async def test_an_option_that_is_no_json_value_is_a_clear_error(server: FakeServer, make_ollama: Any) -> None:
    with pytest.raises(TypeError, match=r"an option is not a JSON value \(Object of type object"):
        await collect(make_ollama(seed=object()).stream(ask()))
    assert server.requests == []
