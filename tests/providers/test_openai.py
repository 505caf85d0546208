"""OpenAI-compatible Chat Completions against a byte-exact fake server."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from agentscope_py import ReActAgent
from agentscope_py.message import ChatUsage, ToolResultState
from agentscope_py.model import (
    AuthenticationError,
    BadRequestError,
    ContextLengthError,
    MalformedStreamError,
    OverloadedError,
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
from agentscope_py.model.openai import OpenAIChatModel
from agentscope_py.model.registry import resolve_model

from .fakes import (
    DONE,
    FakeServer,
    Reply,
    ask,
    calls_of,
    collect,
    get_weather,
    oa_chunk,
    oa_text,
    oa_tool_calls,
    oa_usage,
    sse,
    text_of,
    thinking_of,
)

pytestmark = pytest.mark.timeout(15)


# -- streaming ---------------------------------------------------------------------------------


async def test_text_usage_and_request_shape(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply([*oa_text("Hel", "lo", " world")[:-2], oa_usage(11, 3, cached=4, reasoning=2), DONE]))
    model = make_openai(temperature=0.2)
    chunks = await collect(model.stream(ask(options={"max_tokens": 50})))

    assert text_of(chunks) == "Hello world"
    assert [c.text for c in chunks if c.text] == ["Hel", "lo", " world"]  # streamed, not buffered
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"]
    usage = [c.usage for c in chunks if c.usage][-1]
    assert usage == ChatUsage(input_tokens=11, output_tokens=3, cache_read_tokens=4, reasoning_tokens=2)
    assert chunks[-1].model == "gpt-fake"

    (request,) = server.requests
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer sk-test"
    assert request.body == {
        "model": "gpt-fake", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}], "temperature": 0.2, "max_tokens": 50,
    }


async def test_reasoning_deltas_become_thinking(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply([
        oa_chunk({"role": "assistant", "content": "", "reasoning_content": "Let me "}),
        oa_chunk({"reasoning": "think."}),
        oa_chunk({"content": "42"}),
        oa_chunk({}, "stop"), oa_usage(5, 5), DONE,
    ]))
    chunks = await collect(make_openai().stream(ask()))
    assert thinking_of(chunks) == "Let me think."
    assert text_of(chunks) == "42"


async def test_parallel_tool_calls_in_fragments(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply(oa_tool_calls(
        ("call_a", "get_weather", ['{"ci', 'ty": ', '"Paris"}']),
        ("call_b", "get_weather", ['{"city"', ': "Oslo"}']),
    )))
    tools = [ToolSchema("get_weather", "The weather", {"type": "object", "properties": {}})]
    chunks = await collect(make_openai().stream(ask(tools=tools)))
    assert calls_of(chunks) == {
        0: ("call_a", "get_weather", '{"city": "Paris"}'),
        1: ("call_b", "get_weather", '{"city": "Oslo"}'),
    }
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["tool_calls"]
    assert server.bodies[0]["tools"] == [t.to_openai() for t in tools]


async def test_structured_output_uses_response_format(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply(oa_text('{"answer": 42}')))
    schema = {"title": "Answer", "type": "object", "properties": {"answer": {"type": "integer"}}}
    model = make_openai()
    assert model.supports_structured_output
    chunks = await collect(model.stream(ask(structured_output=schema, options={"structured_output": schema})))
    assert text_of(chunks) == '{"answer": 42}'
    body = server.bodies[0]
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "Answer", "schema": schema}}
    assert "structured_output" not in body  # the core's option is not a wire parameter


@pytest.mark.parametrize(("wire", "ours"), [
    ("stop", "stop"), ("length", "length"), ("content_filter", "content_filter"),
    ("tool_calls", "tool_calls"), ("function_call", "tool_calls"), ("end_of_turn_x", "end_of_turn_x"),
])
async def test_finish_reasons(server: FakeServer, make_openai: Any, wire: str, ours: str) -> None:
    server.queue(Reply(oa_text("x", finish=wire)))
    chunks = await collect(make_openai().stream(ask()))
    assert [c.finish_reason for c in chunks if c.finish_reason] == [ours]


async def test_stop_with_tool_calls_reports_tool_calls(server: FakeServer, make_openai: Any) -> None:
    parts = oa_tool_calls(("c1", "get_weather", ['{"city": "Rome"}']))
    parts[-3] = oa_chunk({}, "stop")  # some compatible servers say "stop" after tool calls
    server.queue(Reply(parts))
    chunks = await collect(make_openai().stream(ask()))
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["tool_calls"]


async def test_keep_alive_comments_are_ignored_and_connection_is_reused(
    server: FakeServer, make_openai: Any, open_connections: Any
) -> None:
    server.queue(Reply([b": keep-alive\n\n", *oa_text("one")]), Reply(oa_text("two")))
    model = make_openai()
    assert text_of(await collect(model.stream(ask()))) == "one"
    assert text_of(await collect(model.stream(ask()))) == "two"
    assert [r.connection for r in server.requests] == [1, 1]  # body read to the end: reusable
    assert await open_connections(server, 1) == 1


# -- the whole agent ---------------------------------------------------------------------------


async def test_react_agent_tool_round_then_answer(server: FakeServer, make_openai: Any) -> None:
    server.queue(
        Reply(oa_tool_calls(("call_1", "get_weather", ['{"city":', ' "Paris"}']),
                            ("call_2", "get_weather", ['{"city": "Oslo"}']))),
        Reply(oa_text("Sunny in ", "both.", prompt=40, completion=4)),
    )
    agent = ReActAgent.builder().sys_prompt("Be brief.").model(make_openai()).tools(get_weather).build()
    events = [ev async for ev in agent.stream("Weather in Paris and Oslo?")]
    final = events[-2].result  # type: ignore[union-attr]

    assert final.text == "Sunny in both."
    ends = [e.usage for e in events if e.type == "model_call_end"]  # type: ignore[union-attr]
    assert ends == [ChatUsage(input_tokens=20, output_tokens=9), ChatUsage(input_tokens=40, output_tokens=4)]
    assert final.usage == ChatUsage(input_tokens=60, output_tokens=13)  # the run's total
    kinds = [e.type for e in events]
    assert kinds.count("tool_call_start") == 2 and kinds.count("tool_result_end") == 2
    args: dict[str, str] = {}
    for e in events:
        if e.type == "tool_call_delta":  # fragments of the two calls arrive interleaved
            args[e.tool_call_id] = args.get(e.tool_call_id, "") + e.delta  # type: ignore[union-attr]
    assert args == {"call_1": '{"city": "Paris"}', "call_2": '{"city": "Oslo"}'}

    second = server.bodies[1]["messages"]
    assert second[0] == {"role": "system", "content": "Be brief."}
    assert second[1] == {"role": "user", "content": "Weather in Paris and Oslo?"}
    assert second[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
    ]}
    assert second[3:] == [
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny in Paris"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny in Oslo"},
    ]
    assert server.bodies[1]["tools"][0]["function"]["name"] == "get_weather"


async def test_invalid_tool_arguments_reach_the_model_as_an_error(server: FakeServer, make_openai: Any) -> None:
    server.queue(
        Reply(oa_tool_calls(("call_x", "get_weather", ['{"city": "Par']))),  # not JSON
        Reply(oa_text("Sorry, let me fix that.")),
    )
    agent = ReActAgent.builder().model(make_openai()).tools(get_weather).build()
    events = [ev async for ev in agent.stream("Weather?")]
    ends = [e for e in events if e.type == "tool_result_end"]
    assert [e.state for e in ends] == [ToolResultState.ERROR]  # type: ignore[attr-defined]

    second = server.bodies[1]["messages"]
    call = second[-2]["tool_calls"][0]
    assert call["function"]["arguments"] == '{"city": "Par'  # the model sees what it wrote
    result = second[-1]
    assert result["role"] == "tool" and result["tool_call_id"] == "call_x"
    assert "not a JSON object" in result["content"]


async def test_max_retries_honours_retry_after(server: FakeServer, make_openai: Any) -> None:
    limited = Reply.json_error(429, {"error": {"message": "Slow down", "type": "requests"}}, retry_after="0")
    server.queue(limited, Reply.json_error(429, {"error": {"message": "Slow down"}}, retry_after="0"),
                 Reply(oa_text("finally")))
    agent = ReActAgent.builder().model(make_openai()).max_retries(2).build()
    loop = asyncio.get_running_loop()
    started = loop.time()
    msg = await agent.call("hi")
    assert msg.text == "finally"
    assert len(server.requests) == 3
    assert loop.time() - started < 2  # Retry-After: 0 was honoured instead of backing off


async def test_retries_exhausted_raise_the_rate_limit(server: FakeServer, make_openai: Any) -> None:
    for _ in range(2):
        server.queue(Reply.json_error(429, {"error": {"message": "Slow down"}}, retry_after="0"))
    agent = ReActAgent.builder().model(make_openai()).max_retries(1).build()
    with pytest.raises(RateLimitError, match="Slow down"):
        await agent.call("hi")
    assert len(server.requests) == 2


async def test_fallback_model_after_server_errors(
    server: FakeServer, backup_server: FakeServer, make_openai: Any
) -> None:
    server.queue(Reply.json_error(500, {"error": {"message": "boom", "type": "server_error"}}))
    backup_server.queue(Reply(oa_text("from the backup")))
    primary, backup = make_openai(), make_openai(backup_server)
    switches: list[tuple[Any, BaseException, Any]] = []
    agent = (ReActAgent.builder().model(primary).fallback_model(backup)
             .failover_listener(lambda a, e, b: switches.append((a, e, b))).build())
    msg = await agent.call("hi")
    assert msg.text == "from the backup"
    ((failed, error, nxt),) = switches
    assert failed is primary and nxt is backup
    assert isinstance(error, ServerError) and error.status_code == 500 and "boom" in str(error)


async def test_an_error_after_chunks_is_not_retried(server: FakeServer, make_openai: Any) -> None:
    server.queue(
        Reply([oa_chunk({"content": "partial"}), sse({"error": {"message": "went away", "type": "server_error"}})]),
        Reply(oa_text("must not be used")),
    )
    agent = ReActAgent.builder().model(make_openai()).max_retries(3).build()
    seen: list[Any] = []
    with pytest.raises(ServerError, match="went away"):
        async for ev in agent.stream("hi"):
            seen.append(ev)
    # The failed attempt is closed (the closing guarantee), and marked as failed and discarded.
    types = [e.type for e in seen]
    assert types == ["agent_start", "model_call_start", "text_block_start", "text_block_delta",
                     "text_block_end", "model_call_end", "agent_end"]
    assert seen[-2].error.startswith("ServerError") and "went away" in seen[-2].error and seen[-2].discarded
    assert seen[-1].error == seen[-2].error
    assert len(server.requests) == 1


async def test_truncated_stream_is_never_a_complete_answer(server: FakeServer, make_openai: Any) -> None:
    cut = oa_chunk({"content": "The answer is"})
    server.queue(Reply([oa_chunk({"content": "Partial "}), cut[: len(cut) // 2]], end="cut"))
    agent = ReActAgent.builder().model(make_openai()).build()
    seen: list[Any] = []
    with pytest.raises(MalformedStreamError):
        async for ev in agent.stream("hi"):
            seen.append(ev)
    assert "agent_result" not in [e.type for e in seen]
    end = seen[-2]  # the call is closed, marked as failed: never a complete answer
    assert end.type == "model_call_end" and end.discarded and end.error.startswith("MalformedStreamError")
    assert seen[-1].type == "agent_end" and seen[-1].error.startswith("MalformedStreamError")
    state, _ = await agent.state_store.load("default", "default")
    assert state is None or all("Partial" not in m.text for m in state.context)


# -- malformed streams and errors --------------------------------------------------------------


async def test_cut_mid_json_without_chunking(server: FakeServer, make_openai: Any) -> None:
    cut = oa_chunk({"content": "never finished"})
    server.queue(Reply([oa_chunk({"content": "Hi"}), cut[:40]], chunked=False))  # clean close mid-JSON
    with pytest.raises(MalformedStreamError, match="invalid JSON"):
        await collect(make_openai().stream(ask()))


async def test_stream_without_done(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply(oa_text("complete-looking")[:-1], chunked=False))
    with pytest.raises(MalformedStreamError, match=r"\[DONE\]"):
        await collect(make_openai().stream(ask()))


async def test_garbage_line(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply([oa_chunk({"content": "Hi"}), b"<html>502 Bad Gateway</html>\n\n", DONE]))
    with pytest.raises(MalformedStreamError, match="unexpected line"):
        await collect(make_openai().stream(ask()))


async def test_stalled_stream_times_out(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply([oa_chunk({"content": "Hi"})], end="stall"))
    with pytest.raises(TimeoutError):
        await collect(make_openai(timeout=0.3).stream(ask()))
    await asyncio.wait_for(server.hung_up.wait(), 2)


async def test_connection_refused() -> None:
    srv = FakeServer()
    await srv.start()
    url = srv.url
    await srv.stop()  # nothing listens there any more
    model = OpenAIChatModel("m", base_url=f"{url}/v1", api_key="k", timeout=2)
    try:
        with pytest.raises(ConnectionError) as info:
            await collect(model.stream(ask()))
        assert info.value.retryable
    finally:
        await model.aclose()


@pytest.mark.parametrize(("reply", "error", "retry_after"), [
    (Reply.json_error(401, {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                                      "code": "invalid_api_key"}}), AuthenticationError, None),
    (Reply.json_error(403, {"error": {"message": "Forbidden region"}}), AuthenticationError, None),
    (Reply.json_error(429, {"error": {"message": "Rate limit reached"}}, retry_after="7"), RateLimitError, 7.0),
    (Reply.json_error(400, {"error": {"message": "This model's maximum context length is 8192 tokens",
                                      "code": "context_length_exceeded"}}), ContextLengthError, None),
    (Reply.json_error(400, {"error": {"message": "Invalid value for temperature"}}), BadRequestError, None),
    (Reply.json_error(500, {"error": {"message": "Internal error"}}), ServerError, None),
    (Reply.json_error(502, {"error": {"message": "Bad gateway"}}), ServerError, None),
    (Reply.json_error(503, {"error": {"message": "Unavailable"}}, retry_after="1"), ServerError, 1.0),
    (Reply.json_error(529, {"error": {"message": "Overloaded"}}), OverloadedError, None),
])
async def test_http_errors(server: FakeServer, make_openai: Any, reply: Reply, error: type[Exception],
                           retry_after: float | None) -> None:
    server.queue(reply)
    with pytest.raises(error) as info:
        await collect(make_openai().stream(ask()))
    exc = info.value
    assert type(exc) is error
    assert exc.status_code == reply.status and exc.provider == "openai"  # type: ignore[attr-defined]
    assert exc.retry_after == retry_after  # type: ignore[attr-defined]
    message = reply.parts[0].decode()  # type: ignore[union-attr]
    assert str(exc).split(": ", 1)[1] in message  # the provider's own message


async def test_insufficient_quota_is_not_retryable(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply.json_error(429, {"error": {"message": "You exceeded your quota", "code": "insufficient_quota"}}))
    with pytest.raises(RateLimitError) as info:
        await collect(make_openai().stream(ask()))
    assert not info.value.retryable


@pytest.mark.parametrize(("frame", "error"), [
    (sse({"error": {"message": "Rate limited mid-stream", "type": "rate_limit_error"}}), RateLimitError),
    (sse({"error": {"message": "Overloaded", "type": "overloaded_error"}}, event="error"), OverloadedError),
    (sse({"error": {"message": "Something broke", "type": "server_error"}}), ServerError),
])
async def test_mid_stream_error_frames(server: FakeServer, make_openai: Any, frame: bytes,
                                       error: type[Exception]) -> None:
    server.queue(Reply([oa_chunk({"content": "a"}), frame, DONE]))
    with pytest.raises(error):
        await collect(make_openai().stream(ask()))


async def test_error_body_sent_with_status_200(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply([b'{"error": {"message": "prompt is too long", "type": "invalid_request_error"}}'],
                       content_type="application/json", chunked=False))
    with pytest.raises(ContextLengthError, match="prompt is too long"):
        await collect(make_openai().stream(ask()))


async def test_missing_key_for_the_default_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    model = OpenAIChatModel("gpt-4o-mini")  # building needs no key
    with pytest.raises(AuthenticationError, match="OPENAI_API_KEY"):
        await collect(model.stream(ask()))


async def test_env_vars_configure_the_client(server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    monkeypatch.setenv("OPENAI_BASE_URL", f"{server.url}/v1")
    server.queue(Reply(oa_text("env")))
    model = OpenAIChatModel("gpt-fake")
    try:
        assert text_of(await collect(model.stream(ask()))) == "env"
    finally:
        await model.aclose()
    assert server.requests[0].headers["authorization"] == "Bearer sk-env"


async def test_resolve_model_id(server: FakeServer) -> None:
    server.queue(Reply(oa_text("resolved")))
    model = resolve_model("openai:gpt-fake", base_url=f"{server.url}/v1", api_key="sk-r")
    assert isinstance(model, OpenAIChatModel) and model.name == "gpt-fake" and model.provider == "openai"
    try:
        assert text_of(await collect(model.stream(ask()))) == "resolved"
    finally:
        await model.aclose()  # type: ignore[attr-defined]


# -- cancellation ------------------------------------------------------------------------------


async def test_closing_the_stream_closes_the_connection(
    server: FakeServer, make_openai: Any, open_connections: Any
) -> None:
    server.queue(Reply([oa_chunk({"content": "first"})], end="stall"))
    model = make_openai()
    stream = model.stream(ask())
    async with contextlib.aclosing(stream):
        first = await anext(stream)
        assert first.text == "first"
    await asyncio.wait_for(server.hung_up.wait(), 2)
    assert await open_connections(server, 0) == 0


async def test_interrupting_the_agent_closes_the_request(server: FakeServer, make_openai: Any) -> None:
    server.queue(Reply([oa_chunk({"content": "thinking out loud"})], end="stall"))
    agent = ReActAgent.builder().model(make_openai()).build()
    seen: list[str] = []
    async for ev in agent.stream("hi"):
        seen.append(ev.type)
        if ev.type == "text_block_delta":
            assert agent.interrupt()
    await asyncio.wait_for(server.hung_up.wait(), 2)
    assert seen[-1] == "agent_end"


async def test_an_injected_client_does_not_retry(server: FakeServer) -> None:
    import openai

    sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="sk-own", max_retries=5)
    server.queue(Reply.json_error(500, {"error": {"message": "boom"}}), Reply(oa_text("retried by the SDK")))
    model = OpenAIChatModel("gpt-fake", client=sdk)
    try:
        with pytest.raises(ServerError):
            await collect(model.stream(ask()))
    finally:
        await model.aclose()
    assert len(server.requests) == 1
    assert server.requests[0].headers["authorization"] == "Bearer sk-own"
