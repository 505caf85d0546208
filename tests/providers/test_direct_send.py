"""`OpenAIChatModel` sends its second and later requests on the SDK's httpx client directly
(`agentscope_py.model._direct.DirectSend`): the same request on the wire as the SDK's own, and
the same typed errors. Each test warms the model with one request (which the SDK sends), so
what follows goes the direct way, and compares it with what the SDK path gives."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentscope_py.model import (
    AuthenticationError,
    ContextLengthError,
    ModelConnectionError,
    ModelTimeoutError,
    RateLimitError,
    ServerError,
    ToolSchema,
)
from agentscope_py.model.openai import OpenAIChatModel

from .fakes import FakeServer, Reply, ask, collect, oa_text, text_of

pytestmark = pytest.mark.timeout(15)


async def _warm(server: FakeServer, model: OpenAIChatModel) -> None:
    server.queue(Reply(oa_text("warm")))
    assert text_of(await collect(model.stream(ask("warm")))) == "warm"
    assert model._direct.usable(model.client, {})  # what follows is sent directly


def _error_of(exc: BaseException) -> tuple[Any, ...]:
    return (type(exc), str(exc), getattr(exc, "status_code", None), getattr(exc, "retry_after", None),
            getattr(exc, "retryable", None))


async def _raised(model: OpenAIChatModel) -> BaseException:
    with pytest.raises(Exception) as info:
        await collect(model.stream(ask()))
    return info.value


async def test_a_direct_request_is_the_sdks_request(server: FakeServer, make_openai: Any) -> None:
    model = make_openai(temperature=0.3)
    tools = [ToolSchema("lookup", "Look up.", {"type": "object", "properties": {"q": {"type": "string"}}})]
    server.queue(Reply(oa_text("one")), Reply(oa_text("two")))
    first = await collect(model.stream(ask("naïve ☃ \u2028", tools=tools)))
    second = await collect(model.stream(ask("naïve ☃ \u2028", tools=tools)))
    assert (text_of(first), text_of(second)) == ("one", "two")
    sdk, direct = server.requests
    assert direct.path == sdk.path == "/v1/chat/completions"
    assert direct.headers == sdk.headers  # auth, user agent, platform headers, content type and length
    assert direct.body == sdk.body
    assert direct.connection == sdk.connection  # the same pool: the connection is reused


async def test_a_per_call_option_of_the_client_goes_through_the_sdk(server: FakeServer, make_openai: Any) -> None:
    model = make_openai()
    await _warm(server, model)
    server.queue(Reply(oa_text("ok")))
    await collect(model.stream(ask(options={"extra_headers": {"x-trace": "abc"}})))
    assert server.requests[-1].headers["x-trace"] == "abc"


async def test_a_changed_key_is_sent(server: FakeServer, make_openai: Any) -> None:
    model = make_openai()
    await _warm(server, model)
    server.queue(Reply(oa_text("ok")), Reply(oa_text("ok")))
    await collect(model.stream(ask()))
    model.client.api_key = "sk-rotated"
    await collect(model.stream(ask()))
    assert [r.headers["authorization"] for r in server.requests] == ["Bearer sk-test"] * 2 + ["Bearer sk-rotated"]


@pytest.mark.parametrize("reply", [
    Reply.json_error(401, {"error": {"message": "Incorrect API key provided", "code": "invalid_api_key"}}),
    Reply.json_error(429, {"error": {"message": "Rate limit reached"}}, retry_after="7"),
    Reply.json_error(429, {"error": {"message": "You exceeded your quota", "code": "insufficient_quota"}}),
    Reply.json_error(400, {"error": {"message": "maximum context length is 8192 tokens",
                                     "code": "context_length_exceeded"}}),
    Reply.json_error(503, {"error": {"message": "Unavailable"}}, retry_after="1"),
    Reply([b"<html>bad gateway</html>"], status=502, content_type="text/html", chunked=False),
], ids=["401", "429", "quota", "context", "503", "html-502"])
async def test_http_errors_are_the_sdk_paths(server: FakeServer, make_openai: Any, reply: Reply) -> None:
    server.queue(reply)
    via_sdk = await _raised(make_openai())
    model = make_openai()
    await _warm(server, model)
    server.queue(reply)
    direct = await _raised(model)
    assert _error_of(direct) == _error_of(via_sdk)
    assert isinstance(direct, (AuthenticationError, RateLimitError, ContextLengthError, ServerError))


async def test_connection_refused_is_the_sdk_paths(server: FakeServer, make_openai: Any) -> None:
    model = make_openai(timeout=2.0)
    await _warm(server, model)
    gone = FakeServer()
    await gone.start()
    url = gone.url
    await gone.stop()  # nothing listens there any more
    model.client.base_url = f"{url}/v1"
    direct = await _raised(model)
    fresh = OpenAIChatModel("gpt-fake", base_url=f"{url}/v1", api_key="sk-test", timeout=2.0)
    try:
        via_sdk = await _raised(fresh)
    finally:
        await fresh.aclose()
    assert isinstance(direct, ModelConnectionError) and direct.retryable
    assert _error_of(direct) == _error_of(via_sdk)


@contextlib.asynccontextmanager
async def _silent_server() -> AsyncIterator[str]:
    """Reads requests and never answers."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.read(65536)
            await asyncio.sleep(30)
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/v1"
    finally:
        srv.close()


async def test_no_answer_times_out_as_on_the_sdk_path(server: FakeServer, make_openai: Any) -> None:
    model = make_openai(timeout=0.3)
    await _warm(server, model)
    async with _silent_server() as url:
        model.client.base_url = url
        direct = await _raised(model)
        fresh = OpenAIChatModel("gpt-fake", base_url=url, api_key="sk-test", timeout=0.3)
        try:
            via_sdk = await _raised(fresh)
        finally:
            await fresh.aclose()
    assert isinstance(direct, ModelTimeoutError)
    assert _error_of(direct) == _error_of(via_sdk)


async def test_an_instrumented_create_sees_every_request(server: FakeServer, make_openai: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An instrumentation (OpenTelemetry's, say) installed at startup wraps the SDK's create():
    every request keeps going through it."""
    from openai.resources.chat.completions import AsyncCompletions

    shipped = AsyncCompletions.create
    seen: list[str] = []

    @functools.wraps(shipped)
    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["model"])
        return shipped(self, *args, **kwargs)

    monkeypatch.setattr(AsyncCompletions, "create", traced)
    model = make_openai()
    server.queue(Reply(oa_text("one")), Reply(oa_text("two")), Reply(oa_text("three")))
    for _ in range(3):
        await collect(model.stream(ask()))
    assert seen == ["gpt-fake"] * 3
    assert len(server.requests) == 3


async def test_a_value_only_the_sdk_can_encode_goes_through_the_sdk(server: FakeServer, make_openai: Any) -> None:
    import datetime

    model = make_openai()
    await _warm(server, model)
    server.queue(Reply(oa_text("ok")))
    when = datetime.datetime(2026, 1, 2, 3, 4, 5)
    await collect(model.stream(ask(options={"metadata": {"at": when}})))
    assert server.requests[-1].body["metadata"] == {"at": when.isoformat()}  # the SDK's encoder wrote it


async def test_nan_is_refused_as_the_sdk_refuses_it(server: FakeServer, make_openai: Any) -> None:
    model = make_openai()
    await _warm(server, model)
    with pytest.raises(ValueError, match="JSON compliant"):
        await collect(model.stream(ask(options={"temperature": float("nan")})))
