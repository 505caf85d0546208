"""Anthropic Messages against a byte-exact fake server."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import pytest

from agentscope_py import Msg, ReActAgent
from agentscope_py.message import ChatUsage
from agentscope_py.model import (
    AuthenticationError,
    BadRequestError,
    ContextLengthError,
    MalformedStreamError,
    ModelRequest,
    OverloadedError,
    RateLimitError,
    ServerError,
    ToolSchema,
)
from agentscope_py.model import (
    ModelTimeoutError as TimeoutError,
)
from agentscope_py.model.anthropic import AnthropicChatModel
from agentscope_py.model.registry import resolve_model

from .fakes import (
    PING,
    FakeServer,
    Reply,
    an_block,
    an_end,
    an_event,
    an_start,
    an_text,
    an_text_block,
    an_tool_block,
    calls_of,
    collect,
    get_weather,
    text_of,
    thinking_of,
)

pytestmark = pytest.mark.timeout(15)


def ask(text: str = "hi", **kw: Any) -> ModelRequest:
    return ModelRequest(messages=[Msg.system("Be brief."), Msg.user(text)], **kw)


def thinking_block(index: int, *pieces: str, signature: str = "sig-abc==") -> list[bytes | float]:
    deltas = [{"type": "thinking_delta", "thinking": p} for p in pieces]
    return an_block(index, {"type": "thinking", "thinking": "", "signature": ""},
                    [*deltas, {"type": "signature_delta", "signature": signature}])


# -- streaming ---------------------------------------------------------------------------------


async def test_thinking_text_tool_use_with_pings(server: FakeServer, make_anthropic: Any) -> None:
    server.queue(Reply([
        an_start(21, cache_creation_input_tokens=3, cache_read_input_tokens=5), PING,
        *thinking_block(0, "Let me ", "check."),
        *an_text_block(1, "Checking", " the weather."), PING,
        *an_tool_block(2, "toolu_1", "get_weather", '{"ci', 'ty": "Pa', 'ris"}'),
        *an_end("tool_use", 15),
    ]))
    tools = [ToolSchema("get_weather", "The weather", {"type": "object", "properties": {}})]
    chunks = await collect(make_anthropic(temperature=0.1).stream(ask(tools=tools, options={"top_k": 3})))

    assert thinking_of(chunks) == "Let me check."
    assert "".join(c.thinking_signature or "" for c in chunks) == "sig-abc=="
    assert text_of(chunks) == "Checking the weather."
    assert calls_of(chunks) == {2: ("toolu_1", "get_weather", '{"city": "Paris"}')}
    (last,) = [c for c in chunks if c.usage]
    assert last.finish_reason == "tool_calls" and last.model == "claude-fake"
    assert last.usage == ChatUsage(input_tokens=29, output_tokens=15, cache_read_tokens=5, cache_write_tokens=3)

    (request,) = server.requests
    assert request.path == "/v1/messages"
    assert request.body == {
        "model": "claude-fake", "max_tokens": 4096, "stream": True, "system": "Be brief.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{"name": "get_weather", "description": "The weather",
                   "input_schema": {"type": "object", "properties": {}}}],
        "temperature": 0.1, "top_k": 3,
    }


async def test_a_whole_tool_input_keeps_its_numbers_exact(server: FakeServer, make_anthropic: Any) -> None:
    # A tool input sent whole in its block's start: ints past 64 bits stay ints, digit for digit.
    big, negative = 123456789012345678901234567890, -9223372036854775809
    server.queue(Reply([
        an_start(10),
        *an_block(0, {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                      "input": {"n": big, "m": negative, "f": 0.5}}, []),
        *an_end("tool_use", 5),
    ]))
    chunks = await collect(make_anthropic().stream(ask()))
    assert calls_of(chunks)[0][:2] == ("toolu_1", "get_weather")
    arguments = calls_of(chunks)[0][2]
    assert json.loads(arguments) == {"n": big, "m": negative, "f": 0.5}
    assert str(big) in arguments


async def test_usage_is_cumulative(server: FakeServer, make_anthropic: Any) -> None:
    # Newer APIs repeat input and cache counts in message_delta; the last value of each wins.
    server.queue(Reply([an_start(10), *an_text_block(0, "ok"),
                        *an_end("end_turn", 30, input_tokens=12, cache_read_input_tokens=2)]))
    chunks = await collect(make_anthropic().stream(ask()))
    assert [c.usage for c in chunks if c.usage] == [
        ChatUsage(input_tokens=14, output_tokens=30, cache_read_tokens=2)]


@pytest.mark.parametrize(("stop", "ours"), [
    ("end_turn", "stop"), ("stop_sequence", "stop"), ("tool_use", "tool_calls"), ("max_tokens", "length"),
    ("refusal", "content_filter"), ("pause_turn", "pause_turn"),
])
async def test_stop_reasons(server: FakeServer, make_anthropic: Any, stop: str, ours: str) -> None:
    server.queue(Reply(an_text("x", stop=stop)))
    chunks = await collect(make_anthropic().stream(ask()))
    assert [c.finish_reason for c in chunks if c.finish_reason] == [ours]


async def test_max_tokens_option_overrides_the_default(server: FakeServer, make_anthropic: Any) -> None:
    server.queue(Reply(an_text("a")), Reply(an_text("b")))
    model = make_anthropic(max_tokens=100)
    await collect(model.stream(ask()))
    await collect(model.stream(ask(options={"max_tokens": 7})))
    assert [b["max_tokens"] for b in server.bodies] == [100, 7]


# -- the whole agent ---------------------------------------------------------------------------


async def test_react_agent_round_trips_signed_thinking_and_tool_use(
    server: FakeServer, make_anthropic: Any
) -> None:
    server.queue(
        Reply([an_start(20), *thinking_block(0, "Need the ", "weather."),
               *an_text_block(1, "Let me look."),
               *an_tool_block(2, "toolu_9", "get_weather", '{"city"', ': "Paris"}'),
               *an_end("tool_use", 12)]),
        Reply([an_start(60), PING, *an_text_block(0, "It is sunny", " in Paris."), *an_end("end_turn", 6)]),
    )
    agent = ReActAgent.builder().sys_prompt("Be brief.").model(make_anthropic()).tools(get_weather).build()
    events = [ev async for ev in agent.stream("Weather in Paris?")]
    final = events[-2].result  # type: ignore[union-attr]
    assert final.text == "It is sunny in Paris."
    kinds = [e.type for e in events]
    assert kinds.index("thinking_block_end") < kinds.index("text_block_start") < kinds.index("tool_call_start")
    (end,) = [e for e in events if e.type == "thinking_block_end"]
    assert end.signature == "sig-abc=="  # type: ignore[union-attr]

    second = server.bodies[1]
    assert second["system"] == "Be brief."
    assert second["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need the weather.", "signature": "sig-abc=="},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_9", "content": "sunny in Paris"},
        ]},
    ]


async def test_invalid_tool_input_becomes_an_error_result(server: FakeServer, make_anthropic: Any) -> None:
    server.queue(
        Reply([an_start(), *an_tool_block(0, "toolu_bad", "get_weather", '{"city": ', '"Par'), *an_end("tool_use", 5)]),
        Reply(an_text("Let me retry.")),
    )
    agent = ReActAgent.builder().model(make_anthropic()).tools(get_weather).build()
    assert (await agent.call("Weather?")).text == "Let me retry."
    assistant, results = server.bodies[1]["messages"][1:]
    assert assistant["content"] == [{"type": "tool_use", "id": "toolu_bad", "name": "get_weather", "input": {}}]
    (result,) = results["content"]
    assert result["tool_use_id"] == "toolu_bad" and result["is_error"] is True
    assert "not a JSON object" in result["content"] and '"Par' in result["content"]


async def test_error_frame_before_content_is_retried(server: FakeServer, make_anthropic: Any) -> None:
    overloaded = an_event({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    server.queue(Reply([an_start(), PING, overloaded]), Reply(an_text("second try")))
    agent = ReActAgent.builder().model(make_anthropic()).max_retries(1).build()
    assert (await agent.call("hi")).text == "second try"
    assert len(server.requests) == 2


async def test_error_frame_after_content_is_not_retried(server: FakeServer, make_anthropic: Any) -> None:
    overloaded = an_event({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    server.queue(Reply([an_start(), *an_text_block(0, "half"), overloaded]), Reply(an_text("unused")))
    agent = ReActAgent.builder().model(make_anthropic()).max_retries(2).build()
    with pytest.raises(OverloadedError, match="Overloaded"):
        await agent.call("hi")
    assert len(server.requests) == 1


async def test_fallback_from_overloaded(server: FakeServer, backup_server: FakeServer, make_anthropic: Any) -> None:
    server.queue(Reply.json_error(529, {"type": "error", "error": {"type": "overloaded_error",
                                                                   "message": "Overloaded"}}))
    backup_server.queue(Reply(an_text("backup")))
    primary, backup = make_anthropic(), make_anthropic(backup_server)
    switched: list[BaseException] = []
    agent = (ReActAgent.builder().model(primary).fallback_model(backup)
             .failover_listener(lambda a, e, b: switched.append(e)).build())
    assert (await agent.call("hi")).text == "backup"
    assert len(switched) == 1 and isinstance(switched[0], OverloadedError)


# -- errors and malformed streams --------------------------------------------------------------


def _error(status: int, kind: str, message: str, **headers: str) -> Reply:
    return Reply.json_error(status, {"type": "error", "error": {"type": kind, "message": message}}, **headers)


@pytest.mark.parametrize(("reply", "error", "retry_after"), [
    (_error(401, "authentication_error", "invalid x-api-key"), AuthenticationError, None),
    (_error(429, "rate_limit_error", "Number of request tokens has exceeded your rate limit", retry_after="4"),
     RateLimitError, 4.0),
    (_error(400, "invalid_request_error", "prompt is too long: 250000 tokens > 200000 maximum"),
     ContextLengthError, None),
    (_error(400, "invalid_request_error", "messages: roles must alternate"), BadRequestError, None),
    (_error(500, "api_error", "Internal server error"), ServerError, None),
    (_error(529, "overloaded_error", "Overloaded"), OverloadedError, None),
])
async def test_http_errors(server: FakeServer, make_anthropic: Any, reply: Reply, error: type[Exception],
                           retry_after: float | None) -> None:
    server.queue(reply)
    with pytest.raises(error) as info:
        await collect(make_anthropic().stream(ask()))
    exc = info.value
    assert type(exc) is error and exc.status_code == reply.status  # type: ignore[attr-defined]
    assert exc.retry_after == retry_after and exc.provider == "anthropic"  # type: ignore[attr-defined]
    assert str(exc).split(": ", 1)[1] in reply.parts[0].decode()  # type: ignore[union-attr]


async def test_stream_without_message_stop(server: FakeServer, make_anthropic: Any) -> None:
    server.queue(Reply(an_text("looks done")[:-1]))
    with pytest.raises(MalformedStreamError, match="message_stop"):
        await collect(make_anthropic().stream(ask()))


async def test_cut_mid_json(server: FakeServer, make_anthropic: Any) -> None:
    delta = an_text_block(0, "never finished")[1]
    assert isinstance(delta, bytes)
    server.queue(Reply([an_start(), an_text_block(0, "x")[0], delta[:50]], end="cut"))
    with pytest.raises(MalformedStreamError):
        await collect(make_anthropic().stream(ask()))


async def test_garbage_line(server: FakeServer, make_anthropic: Any) -> None:
    server.queue(Reply([an_start(), b"this is not sse\n\n", *an_text("x")[1:]]))
    with pytest.raises(MalformedStreamError, match="unexpected line"):
        await collect(make_anthropic().stream(ask()))


async def test_stalled_stream_times_out(server: FakeServer, make_anthropic: Any) -> None:
    server.queue(Reply([an_start(), *an_text_block(0, "Hi")], end="stall"))
    with pytest.raises(TimeoutError):
        await collect(make_anthropic(timeout=0.3).stream(ask()))
    await asyncio.wait_for(server.hung_up.wait(), 2)


async def test_missing_credentials_is_an_authentication_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_PROFILE", "ANTHROPIC_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", "/nonexistent")
    model = AnthropicChatModel("claude-x", base_url="http://127.0.0.1:9")
    try:
        with pytest.raises(AuthenticationError):
            await collect(model.stream(ask()))
    finally:
        await model.aclose()


async def test_resolve_model_id(server: FakeServer) -> None:
    server.queue(Reply(an_text("resolved")))
    model = resolve_model("anthropic:claude-fake", base_url=server.url, api_key="k")
    assert isinstance(model, AnthropicChatModel) and model.provider == "anthropic"
    try:
        assert text_of(await collect(model.stream(ask()))) == "resolved"
    finally:
        await model.aclose()


async def test_closing_the_stream_closes_the_connection(
    server: FakeServer, make_anthropic: Any, open_connections: Any
) -> None:
    server.queue(Reply([an_start(), *an_text_block(0, "first")], end="stall"))
    model = make_anthropic()
    stream = model.stream(ask())
    async with contextlib.aclosing(stream):
        assert (await anext(stream)).text == "first"
    await asyncio.wait_for(server.hung_up.wait(), 2)
    assert await open_connections(server, 0) == 0


async def test_an_injected_client_does_not_retry(server: FakeServer) -> None:
    import anthropic

    sdk = anthropic.AsyncAnthropic(base_url=server.url, api_key="sk-own", max_retries=5)
    server.queue(_error(529, "overloaded_error", "Overloaded"), Reply(an_text("retried by the SDK")))
    model = AnthropicChatModel("claude-fake", client=sdk)
    try:
        with pytest.raises(OverloadedError):
            await collect(model.stream(ask()))
    finally:
        await model.aclose()
    assert len(server.requests) == 1
