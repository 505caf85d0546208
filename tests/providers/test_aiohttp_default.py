"""The OpenAI and Anthropic models send over aiohttp by default (`agentscope_py.model._aiohttp`),
and through the SDK when given a client: the same typed errors either way, a connection closed
when a stream is given up, the environment's proxies honoured, a user's client honoured."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import gc
import json
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from agentscope_py.model import (
    AuthenticationError,
    ContextLengthError,
    ModelConnectionError,
    ModelTimeoutError,
    RateLimitError,
    ServerError,
)
from agentscope_py.model._aiohttp import AioHttpSender, body_bytes, client_timeout
from agentscope_py.model.anthropic import AnthropicChatModel
from agentscope_py.model.openai import OpenAIChatModel
from agentscope_py.model.openai_responses import OpenAIResponsesModel

from .fakes import FakeServer, Reply, an_text, ask, collect, give_up, oa_chunk, oa_text, text_of
from .responses_wire import text_reply

pytestmark = pytest.mark.timeout(20)


@dataclass
class _Point:
    x: int
    y: int


def _no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


def _sdk_model(server: FakeServer, closing: list[Any], **kw: Any) -> OpenAIChatModel:
    """The same model on a client of the user's own: the SDK sends."""
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="sk-test", timeout=5.0, **kw)
    model = OpenAIChatModel("gpt-fake", client=client)
    closing.append(model)
    return model


def _error_of(exc: BaseException) -> tuple[Any, ...]:
    return (type(exc), getattr(exc, "status_code", None), getattr(exc, "retry_after", None),
            getattr(exc, "retryable", None))


async def _raised(model: Any) -> BaseException:
    with pytest.raises(Exception) as info:
        await collect(model.stream(ask()))
    return info.value


def _json_error(status: int, message: str, kind: str, code: str | None = None, **headers: str) -> Reply:
    return Reply.json_error(status, {"error": {"message": message, "type": kind, "code": code}}, **headers)


@pytest.mark.parametrize(("reply", "expected"), [
    (_json_error(401, "bad key", "invalid_request_error", "invalid_api_key"), AuthenticationError),
    (_json_error(429, "slow down", "rate_limit_error", retry_after="7"), RateLimitError),
    (_json_error(429, "no credit", "insufficient_quota", "insufficient_quota"), RateLimitError),
    (_json_error(400, "maximum context length is 8192 tokens", "invalid_request_error",
                 "context_length_exceeded"), ContextLengthError),
    (_json_error(503, "busy", "server_error"), ServerError),
])
async def test_http_errors_are_typed_as_on_the_sdks_path(
        server: FakeServer, make_openai: Any, closing: list[Any], reply: Reply, expected: type) -> None:
    server.queue(reply, reply)
    ours, sdk = await _raised(make_openai()), await _raised(_sdk_model(server, closing))
    assert isinstance(ours, expected)
    assert _error_of(ours) == _error_of(sdk)
    assert str(ours) == str(sdk)  # the provider's own message


async def test_an_html_error_page_is_a_server_error_quoting_the_page(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply([b"<html>bad gateway</html>"], status=502, content_type="text/html", chunked=False))
    exc = await _raised(make_openai())
    assert isinstance(exc, ServerError) and exc.status_code == 502
    assert "Error code: 502" in str(exc) and "<html>bad gateway</html>" in str(exc)


async def test_connection_refused_is_a_connection_error(make_openai: Any, closing: list[Any]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens on it once closed
    model = OpenAIChatModel("gpt-fake", base_url=f"http://127.0.0.1:{port}/v1", api_key="sk", timeout=2)
    closing.append(model)
    assert isinstance(await _raised(model), ModelConnectionError)


async def test_a_stalled_reply_times_out_and_hangs_up(server: FakeServer, make_anthropic: Any) -> None:
    server.queue(Reply([b"event: ping\ndata: {\"type\": \"ping\"}\n\n"], end="stall"))
    assert isinstance(await _raised(make_anthropic(timeout=0.3)), ModelTimeoutError)
    await asyncio.wait_for(server.hung_up.wait(), 2)


async def test_a_streamed_reply_arms_no_timer_per_read(server: FakeServer, make_openai: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Each token its own read of the socket: a read timeout re-armed per read is a timer per token.
    pieces = [f"t{i} " for i in range(60)]
    parts: list[bytes | float] = [oa_chunk({"role": "assistant", "content": ""})]
    for piece in pieces:
        parts += [0.003, oa_chunk({"content": piece})]
    server.queue(Reply(parts + oa_text(completion=60)[-3:]))
    loop = asyncio.get_running_loop()
    timers: list[str] = []
    call_later = loop.call_later

    def counting(delay: float, callback: Any, *args: Any, **kw: Any) -> asyncio.TimerHandle:
        if not asyncio.iscoroutinefunction(callback) and "set_result_unless_cancelled" not in repr(callback):
            timers.append(repr(callback))  # (not the fake server's own sleeps)
        return call_later(delay, callback, *args, **kw)

    monkeypatch.setattr(loop, "call_later", counting)
    assert text_of(await collect(make_openai(timeout=5).stream(ask()))) == "".join(pieces)
    assert len(timers) <= 3, timers


async def test_a_streamed_reply_does_not_hold_its_requests_body(server: FakeServer, make_openai: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The body goes out once; held while the reply streams it is a conversation's bytes per stream
    # in flight, for as long as the reply takes.
    marker = b"body-marker-" + b"x" * 20_000
    sent: list[bytes] = []  # the body itself: this list is its one referrer the test adds
    open_ = AioHttpSender.open

    def recording(self: AioHttpSender, provider: str, url: str, headers: dict[str, str], body: bytes,
                  timeout: Any) -> Any:
        sent.append(body)
        return open_(self, provider, url, headers, body, timeout)

    monkeypatch.setattr(AioHttpSender, "open", recording)
    server.queue(Reply([oa_chunk({"content": "first"})], end="stall"))
    stream = make_openai(timeout=5).stream(ask(marker.decode()))
    async with contextlib.aclosing(stream):
        assert (await anext(stream)).text == "first"  # the reply is streaming
        assert len(sent) == 1 and marker in sent[0]
        gc.collect()
        # The body's referrers, not every object's referents: on CPython 3.12.0-3.12.5
        # gc.get_referents(_asyncio) lists the dead iterators on the module's free list, and letting
        # go of them frees them a second time (python/cpython#122695), after which the next full
        # collection loops forever.
        held = [type(owner).__name__ for owner in gc.get_referrers(sent[0]) if owner is not sent]
        assert held == []


async def test_a_server_that_never_answers_times_out(closing: list[Any]) -> None:
    # No headers ever: the wait for them is bounded too (the connect's bound plus the read's).
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass
        writer.close()

    listening = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    model = OpenAIChatModel("gpt-fake", base_url=f"http://127.0.0.1:{port}/v1", api_key="sk", timeout=0.2)
    closing.append(model)
    started = asyncio.get_running_loop().time()
    try:
        exc = await _raised(model)
    finally:
        listening.close()
    assert isinstance(exc, ModelTimeoutError)
    assert asyncio.get_running_loop().time() - started < 2


def test_timeouts_bound_the_connection_the_headers_and_each_read() -> None:
    bounds = client_timeout(5)
    assert (bounds.connect.connect, bounds.connect.sock_connect, bounds.connect.sock_read) == (5, 5, None)
    assert (bounds.headers, bounds.read) == (10, 5)  # the headers: the connect's bound plus the read's
    sdk = client_timeout(httpx2.Timeout(600, connect=5.0))  # the SDKs' default: pool 600, connect 5
    assert (sdk.connect.connect, sdk.connect.sock_connect, sdk.headers, sdk.read) == (605, 5, 1205, 600)
    for nothing in (None, 0):  # as in aiohttp's timeouts: no bound at all
        assert client_timeout(nothing)[1:] == (None, None) and client_timeout(nothing).connect.connect is None


async def test_a_slow_reader_is_no_stalled_server(server: FakeServer, make_openai: Any) -> None:
    # The read timeout bounds the waits for the server, not the time the reader spends elsewhere.
    server.queue(Reply(oa_text("a", "b", "c")))
    stream = make_openai(timeout=0.2).stream(ask())
    chunks = []
    async for chunk in stream:
        chunks.append(chunk)
        await asyncio.sleep(0.15)
    assert text_of(chunks) == "abc"


@pytest.mark.parametrize("how", ["aclose", "cancel"])
async def test_giving_up_a_stream_closes_its_connection(server: FakeServer, make_openai: Any, how: str) -> None:
    server.queue(Reply([oa_chunk({"content": "first"})], end="stall"))
    model = make_openai()
    stream = model.stream(ask())
    await give_up(stream, how)
    await asyncio.wait_for(server.hung_up.wait(), 2)  # the server saw the close, not a pooled idle
    assert server.hangups == 1


async def test_per_call_headers_query_and_timeout_are_sent(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply(oa_text("ok")), Reply([oa_chunk({"content": "x"})], end="stall"))
    model = make_openai()
    options = {"extra_headers": {"X-Trace": "t-1"}, "extra_query": {"api-version": "2"}}
    assert text_of(await collect(model.stream(ask(options=options)))) == "ok"
    request = server.requests[0]
    assert request.path == "/v1/chat/completions?api-version=2" and request.headers["x-trace"] == "t-1"
    assert "extra_headers" not in request.body and "timeout" not in request.body
    with pytest.raises(ModelTimeoutError):  # a per-call timeout shorter than the model's 5 s
        await collect(model.stream(ask(options={"timeout": 0.3})))


async def test_a_users_client_sends_every_request(server: FakeServer, closing: list[Any]) -> None:
    sent: list[str] = []

    async def hook(request: httpx2.Request) -> None:
        sent.append(str(request.url))

    http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [hook]})
    model = _sdk_model(server, closing, http_client=http, default_headers={"X-Mine": "yes"})
    server.queue(Reply(oa_text("one")), Reply(oa_text("two")))
    assert [text_of(await collect(model.stream(ask()))) for _ in range(2)] == ["one", "two"]
    assert sent == [f"{server.url}/v1/chat/completions"] * 2
    assert [r.headers["x-mine"] for r in server.requests] == ["yes", "yes"]


async def test_the_sdk_clients_url_and_headers_go_out_over_aiohttp(
        server: FakeServer, make_openai: Any, make_anthropic: Any, closing: list[Any]) -> None:
    server.queue(Reply(oa_text("one")), Reply(oa_text("two")), Reply(an_text("three")))
    model = make_openai()
    assert text_of(await collect(model.stream(ask()))) == "one"
    assert text_of(await collect(_sdk_model(server, closing).stream(ask()))) == "two"
    assert text_of(await collect(make_anthropic().stream(ask()))) == "three"
    ours, sdk, anthropic = server.requests
    assert ours.path == sdk.path == "/v1/chat/completions" and anthropic.path == "/v1/messages"
    assert ours.body == sdk.body
    for name in ("authorization", "user-agent", "x-stainless-lang", "content-type"):
        assert ours.headers[name] == sdk.headers[name]
    assert "x-stainless-retry-count" in sdk.headers and "x-stainless-retry-count" not in ours.headers
    assert anthropic.headers["anthropic-version"] and anthropic.headers["authorization"] == "Bearer sk-ant-test"


async def test_a_key_url_or_organization_set_on_the_client_is_what_the_next_request_uses(
        server: FakeServer, make_openai: Any, make_anthropic: Any) -> None:
    server.queue(*(Reply(oa_text(f"r{i}")) for i in range(4)), Reply(an_text("a1")), Reply(an_text("a2")))
    model = make_openai()
    for _ in range(2):  # the second request reuses what the first read
        await collect(model.stream(ask()))
    model.client.api_key = "sk-rotated"
    model.client.organization = "org-2"
    await collect(model.stream(ask()))
    model.client.base_url = f"{server.url}/v2"
    await collect(model.stream(ask()))
    claude = make_anthropic()
    await collect(claude.stream(ask()))
    claude.client.api_key = "sk-ant-rotated"
    await collect(claude.stream(ask()))
    sent = server.requests
    assert [r.headers["authorization"] for r in sent] == ["Bearer sk-test"] * 2 + ["Bearer sk-rotated"] * 2 + [
        "Bearer sk-ant-test", "Bearer sk-ant-rotated"]
    assert [r.headers.get("openai-organization") for r in sent[:4]] == [None, None, "org-2", "org-2"]
    assert [r.path for r in sent[:4]] == ["/v1/chat/completions"] * 3 + ["/v2/chat/completions"]
    assert all("x-stainless-retry-count" not in r.headers for r in sent)  # all over aiohttp


async def test_the_responses_model_goes_over_aiohttp(server: FakeServer, closing: list[Any]) -> None:
    server.queue(text_reply("hello"))
    model = OpenAIResponsesModel("gpt-fake", base_url=f"{server.url}/v1", api_key="sk", timeout=5)
    closing.append(model)
    assert text_of(await collect(model.stream(ask()))) == "hello"
    assert server.requests[0].path == "/v1/responses" and "x-stainless-retry-count" not in server.requests[0].headers


async def test_a_value_only_the_sdk_encodes_goes_through_the_sdk(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply(oa_text("ok")))
    when = datetime.datetime(2026, 1, 2, 3, 4, 5)
    await collect(make_openai().stream(ask(options={"metadata": {"at": when}})))
    assert server.requests[-1].body["metadata"] == {"at": when.isoformat()}  # the SDK's encoder wrote it


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
async def test_nan_is_refused_as_the_sdk_refuses_it(make_openai: Any, value: float) -> None:
    with pytest.raises(ValueError, match="JSON compliant"):
        await collect(make_openai().stream(ask(options={"temperature": value})))


@pytest.mark.parametrize("body", [
    {"seed": 2**70, "n": -(2**64)},  # past 64 bits: orjson refuses them, the stdlib writes them
    {"logit_bias": {50256: -100, 1.5: 1, True: 2, None: 3}},  # keys that are no strings
    {"user": None, "content": "null", "stop": ["\u0000", "é\u2028", '"\\']},  # a null: written again
    {"nested": [[[{"a": [1.5, 0.1, -0.0, 2**63 - 1, -(2**63), True, False, {}, []]}]]]},
])
def test_a_body_is_the_json_the_stdlib_writes(body: dict[str, Any]) -> None:
    written = body_bytes(body)
    assert written is not None
    assert json.loads(written) == json.loads(json.dumps(body, ensure_ascii=False, separators=(",", ":")))


@pytest.mark.parametrize("value", [datetime.datetime(2026, 1, 2), datetime.date(2026, 1, 2), datetime.time(3, 4),
                                   _Point(1, 2), object()])
def test_a_value_the_stdlib_does_not_write_leaves_the_body_to_the_sdk(value: Any) -> None:
    assert body_bytes({"metadata": {"at": value}}) is None


async def test_ints_past_64_bits_and_int_keys_go_out_over_aiohttp(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply(oa_text("ok")))
    await collect(make_openai().stream(ask(options={"seed": 2**70, "logit_bias": {50256: -100}})))
    request = server.requests[-1]
    assert request.body["seed"] == 2**70 and request.body["logit_bias"] == {"50256": -100}
    assert "x-stainless-retry-count" not in request.headers  # not the SDK's


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_an_environment_proxy_carries_the_request(
        provider: str, server: FakeServer, closing: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    _no_proxies(monkeypatch)
    monkeypatch.setenv("HTTP_PROXY", server.url)
    model: Any
    if provider == "openai":
        server.queue(Reply(oa_text("via the proxy")))
        model = OpenAIChatModel("gpt-fake", base_url="http://upstream.invalid/v1", api_key="sk-test", timeout=5)
        path = "http://upstream.invalid/v1/chat/completions"
    else:
        server.queue(Reply(an_text("via the proxy")))
        model = AnthropicChatModel("claude-fake", base_url="http://upstream.invalid", api_key="sk-ant", timeout=5)
        path = "http://upstream.invalid/v1/messages"
    closing.append(model)
    assert text_of(await collect(model.stream(ask()))) == "via the proxy"
    assert [r.path for r in server.requests] == [path]  # absolute-form: the proxy was asked


async def test_no_proxy_leaves_a_host_direct(
        server: FakeServer, make_openai: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_proxies(monkeypatch)
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing there: using it would fail
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    server.queue(Reply(oa_text("direct")))
    assert text_of(await collect(make_openai().stream(ask()))) == "direct"
    assert server.requests[0].path == "/v1/chat/completions"


def test_a_model_serves_a_second_event_loop() -> None:
    """A session belongs to the loop it was made on: a model used from a second ``asyncio.run``
    (without ``aclose`` between) makes a new one rather than reusing the first loop's."""
    model = OpenAIChatModel("gpt-fake", base_url="http://127.0.0.1:9/v1", api_key="sk", timeout=5)

    async def once(text: str) -> str:
        srv = FakeServer()
        await srv.start()
        try:
            srv.queue(Reply(oa_text(text)))
            model.client.base_url = f"{srv.url}/v1"  # each loop's server has a port of its own
            return text_of(await collect(model.stream(ask())))
        finally:
            await srv.stop()

    assert [asyncio.run(once("one")), asyncio.run(once("two"))] == ["one", "two"]
    asyncio.run(model.aclose())


async def test_a_netrc_entry_for_the_host_does_not_clash_with_the_key(
        server: FakeServer, make_openai: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """aiohttp's ``trust_env`` would take credentials for the API host from ``~/.netrc`` and then
    refuse the request, which carries the SDK's Authorization header already."""
    (tmp_path / ".netrc").write_text("machine 127.0.0.1 login someone password secret\n")
    (tmp_path / ".netrc").chmod(0o600)
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    server.queue(Reply(oa_text("ok")))
    assert text_of(await collect(make_openai().stream(ask()))) == "ok"
    assert server.requests[0].headers["authorization"] == "Bearer sk-test"


async def test_a_proxys_credentials_in_its_url_are_sent_to_the_proxy(
        server: FakeServer, closing: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    _no_proxies(monkeypatch)
    monkeypatch.setenv("HTTP_PROXY", f"http://user:pa%20ss@127.0.0.1:{server.port}")
    server.queue(Reply(oa_text("via the proxy")))
    model = OpenAIChatModel("gpt-fake", base_url="http://upstream.invalid/v1", api_key="sk-test", timeout=5)
    closing.append(model)
    assert text_of(await collect(model.stream(ask()))) == "via the proxy"
    request = server.requests[0]
    assert request.path == "http://upstream.invalid/v1/chat/completions"
    assert request.headers["proxy-authorization"] == "Basic " + base64.b64encode(b"user:pa ss").decode()


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_the_default_path_touches_no_private_member_of_the_sdk_client(
        provider: str, server: FakeServer, closing: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every attribute of the SDK client the model reads from our code, recorded: by default
    none is private (the SDK's own code may use its own, through its public properties)."""
    touched: list[str] = []
    sdk: Any = openai if provider == "openai" else anthropic
    name = "AsyncOpenAI" if provider == "openai" else "AsyncAnthropic"
    made_by_sdk: Any = getattr(sdk, name)

    class Spy(made_by_sdk):
        def __getattribute__(self, attr: str) -> Any:
            if attr.startswith("_") and not attr.startswith("__"):
                caller = sys._getframe(1).f_code.co_filename
                if os.sep + "agentscope_py" + os.sep in caller:
                    touched.append(attr)
            return super().__getattribute__(attr)

    monkeypatch.setattr(sdk, name, Spy)
    if provider == "openai":
        server.queue(Reply(oa_text("ok")))
        model: Any = OpenAIChatModel("gpt-fake", base_url=f"{server.url}/v1", api_key="sk-test", timeout=5)
    else:
        server.queue(Reply(an_text("ok")))
        model = AnthropicChatModel("claude-fake", base_url=server.url, api_key="sk-ant", timeout=5)
    closing.append(model)
    assert text_of(await collect(model.stream(ask()))) == "ok"
    assert isinstance(model.client, Spy) and touched == []
    model.http_client  # noqa: B018 - the recording hook reaches the SDK's HTTP client, a private member
    assert touched == ["_client"]


def test_a_model_never_closed_leaves_no_open_session_behind(recwarn: pytest.WarningsRecorder) -> None:
    """aiohttp reports a session left open (a ResourceWarning and an error through the loop's
    exception handler); a model's session is closed when the loop shuts down, closed or not."""
    reported: list[dict[str, Any]] = []

    async def run() -> str:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
        srv = FakeServer()
        await srv.start()
        try:
            srv.queue(Reply(oa_text("one")))
            model = OpenAIChatModel("gpt-fake", base_url=f"{srv.url}/v1", api_key="sk", timeout=5)
            return text_of(await collect(model.stream(ask())))  # and the model is dropped, unclosed
        finally:
            await srv.stop()

    gc.collect()  # what earlier tests of this worker left for the collector warns now, not below
    recwarn.clear()
    assert asyncio.run(run()) == "one"
    gc.collect()
    assert reported == []
    # aiohttp's own: "Unclosed client session", "Unclosed connector", "... connection", "... response"
    assert not [w for w in recwarn if issubclass(w.category, ResourceWarning) and str(w.message).startswith("Unclosed")]


async def test_http1transport_is_a_deprecated_name_of_httpx2s_transport(
        server: FakeServer, closing: list[Any]) -> None:
    from agentscope_py.model import Http1Transport

    with pytest.warns(DeprecationWarning, match="Http1Transport is deprecated"):
        transport = Http1Transport(limits=httpx2.Limits(max_connections=10))
    assert isinstance(transport, httpx2.AsyncHTTPTransport)
    # Code that built an SDK client over it keeps working.
    model = _sdk_model(server, closing, http_client=openai.DefaultAsyncHttpxClient(transport=transport))
    server.queue(Reply(oa_text("still")))
    assert text_of(await collect(model.stream(ask()))) == "still"


def test_the_sender_parses_a_url_once_and_a_new_one_again() -> None:
    sender = AioHttpSender()
    first = sender.url("http://127.0.0.1:8000/v1/chat/completions")
    assert sender.url("http://127.0.0.1:8000/v1/chat/completions") is first
    other = sender.url("http://127.0.0.1:8000/v1/chat/completions?api-version=2")
    assert str(other) == "http://127.0.0.1:8000/v1/chat/completions?api-version=2"
    assert sender.url("http://127.0.0.1:8000/v1/chat/completions") == first
