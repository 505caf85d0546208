"""The OpenAI Responses API against a byte-faithful loopback fake (``event:`` lines, sequence
numbers, terminal events carrying the response) that refuses what a strict server refuses."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import Msg, ReActAgent
from agentscope_py.message import ChatUsage, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock
from agentscope_py.model import (
    BadRequestError,
    MalformedStreamError,
    ModelRequest,
    RateLimitError,
    RecordingModel,
    ReplayModel,
    ServerError,
)
from agentscope_py.model.openai_responses import OpenAIResponsesModel
from agentscope_py.model.registry import resolve_model

from .fakes import Reply, ask, calls_of, collect, get_weather, text_of, thinking_of
from .responses_wire import ResponsesServer, ResponseStream, text_reply

pytestmark = pytest.mark.timeout(15)


@pytest.fixture
async def rserver() -> AsyncIterator[ResponsesServer]:
    srv = ResponsesServer()
    await srv.start()
    yield srv
    assert srv.rejected == []  # every request the provider sent was one a strict server takes
    await srv.stop()


@pytest.fixture
async def make(rserver: ResponsesServer) -> AsyncIterator[Callable[..., OpenAIResponsesModel]]:
    made: list[OpenAIResponsesModel] = []

    def build(**kw: Any) -> OpenAIResponsesModel:
        model = OpenAIResponsesModel("gpt-fake", base_url=f"{rserver.url}/v1", api_key="sk-test", timeout=5.0, **kw)
        made.append(model)
        return model

    yield build
    for model in made:
        await model.aclose()


# -- streaming ---------------------------------------------------------------------------------


async def test_text_usage_and_request_shape(rserver: ResponsesServer, make: Any) -> None:
    rserver.queue(Reply(ResponseStream().text("Hel", "lo", " world").completed(11, 3, cached=4, reasoning=2)))
    model = make(temperature=0.2)
    chunks = await collect(model.stream(ask(options={"max_output_tokens": 50})))

    assert [c.text for c in chunks if c.text] == ["Hel", "lo", " world"]  # streamed, once (not again at .done)
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"]
    usage = [c.usage for c in chunks if c.usage][-1]
    assert usage == ChatUsage(input_tokens=11, output_tokens=3, cache_read_tokens=4, reasoning_tokens=2)
    assert chunks[-1].model == "gpt-fake"

    (request,) = rserver.requests
    assert request.path == "/v1/responses"
    assert request.headers["authorization"] == "Bearer sk-test"
    assert request.body == {
        "model": "gpt-fake", "stream": True, "store": False, "include": ["reasoning.encrypted_content"],
        "input": [{"role": "user", "content": "hi"}], "temperature": 0.2, "max_output_tokens": 50,
    }


async def test_reasoning_summary_and_text_are_thinking(rserver: ResponsesServer, make: Any) -> None:
    stream = (ResponseStream().reasoning("First I look.", "Then I answer.")
              .reasoning(item_id="rs_2", encrypted=None, text=("open ", "model thoughts")).text("42"))
    rserver.queue(Reply(stream.completed(reasoning=7)))
    chunks = await collect(make().stream(ask()))
    assert thinking_of(chunks) == "First I look.\n\nThen I answer.open model thoughts"
    assert text_of(chunks) == "42"
    signatures = [c.thinking_signature for c in chunks if c.thinking_signature]
    assert len(signatures) == 2 and all(s.endswith("\n") for s in signatures)
    assert '"encrypted_content":"gAAAAB-opaque"' in signatures[0] and '"id":"rs_2"' in signatures[1]
    assert [c.usage for c in chunks if c.usage][-1].reasoning_tokens == 7  # type: ignore[union-attr]


async def test_several_function_calls_in_one_response(rserver: ResponsesServer, make: Any) -> None:
    stream = ResponseStream().call("call_1", "get_weather", '{"city":', ' "Paris"}').call(
        "call_2", "get_weather", '{"city": "Oslo"}')
    rserver.queue(Reply(stream.completed()))
    chunks = await collect(make().stream(ask(tools=[get_weather.schema])))
    assert calls_of(chunks) == {0: ("call_1", "get_weather", '{"city": "Paris"}'),
                                1: ("call_2", "get_weather", '{"city": "Oslo"}')}
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["tool_calls"]
    (tool,) = rserver.bodies[0]["tools"]
    assert tool == {"type": "function", "name": "get_weather", "description": get_weather.schema.description,
                    "parameters": get_weather.schema.parameters, "strict": False}


async def test_a_server_that_sends_only_finished_items_is_read_once(rserver: ResponsesServer, make: Any) -> None:
    stream = ResponseStream()
    call = {"id": "fc_1", "type": "function_call", "status": "completed", "arguments": '{"city": "Rome"}',
            "call_id": "call_9", "name": "get_weather"}
    message = {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]}
    stream.event("response.output_item.done", output_index=0, item=message)
    stream.event("response.output_item.done", output_index=1, item=call)
    rserver.queue(Reply(stream.completed()))
    chunks = await collect(make().stream(ask(tools=[get_weather.schema])))
    assert text_of(chunks) == "Checking."
    assert calls_of(chunks) == {1: ("call_9", "get_weather", '{"city": "Rome"}')}


async def test_incomplete_is_length_like_the_chat_provider(rserver: ResponsesServer, make: Any) -> None:
    rserver.queue(Reply(ResponseStream().text("cut sh").incomplete()),
                  Reply(ResponseStream().text("x").incomplete("content_filter")))
    model = make()
    chunks = await collect(model.stream(ask()))
    assert text_of(chunks) == "cut sh"
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
    assert [c.usage for c in chunks if c.usage] == [ChatUsage(input_tokens=12, output_tokens=16)]
    chunks = await collect(model.stream(ask()))
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["content_filter"]


async def test_failed_and_error_events_are_typed_errors(rserver: ResponsesServer, make: Any) -> None:
    rserver.queue(Reply(ResponseStream().text("part").failed()),
                  Reply(ResponseStream().error("rate_limit_exceeded", "Slow down")),
                  Reply(ResponseStream().error("invalid_request_error", "bad input")))
    model = make()
    with pytest.raises(ServerError, match="failed to generate"):
        await collect(model.stream(ask()))
    with pytest.raises(RateLimitError, match="Slow down"):
        await collect(model.stream(ask()))
    with pytest.raises(BadRequestError, match="bad input"):
        await collect(model.stream(ask()))


async def test_a_stream_without_its_terminal_event_is_malformed(rserver: ResponsesServer, make: Any) -> None:
    parts = ResponseStream().text("The answer is").parts
    rserver.queue(Reply(parts), Reply(parts[:-1], end="cut"))
    model = make()
    with pytest.raises(MalformedStreamError, match=r"response\.completed"):
        await collect(model.stream(ask()))
    with pytest.raises(MalformedStreamError):
        await collect(model.stream(ask()))


async def test_http_errors_and_retries(rserver: ResponsesServer, make: Any) -> None:
    rserver.queue(Reply.json_error(429, {"error": {"message": "Slow down", "type": "requests"}}, retry_after="0"),
                  text_reply("finally"))
    agent = ReActAgent.builder().model(make()).max_retries(1).build()
    assert (await agent.call("hi")).text == "finally"
    assert len(rserver.requests) == 2


async def test_structured_output_uses_text_format(rserver: ResponsesServer, make: Any) -> None:
    rserver.queue(text_reply('{"n": 1}'))
    schema = {"title": "Out put", "type": "object", "properties": {"n": {"type": "integer"}}}
    await collect(make(text={"verbosity": "low"}).stream(ask(structured_output=schema)))
    assert rserver.bodies[0]["text"] == {"verbosity": "low", "format": {"type": "json_schema", "name": "Out_put",
                                                                          "schema": schema}}


async def test_tool_options_go_only_with_tools(rserver: ResponsesServer, make: Any) -> None:
    rserver.queue(text_reply("a"), text_reply("b"))
    model = make(tool_choice="required", parallel_tool_calls=False, reasoning={"effort": "low"}, strict_tools=True)
    await collect(model.stream(ask()))
    await collect(model.stream(ask(tools=[get_weather.schema])))
    first, second = rserver.bodies
    assert "tool_choice" not in first and "tools" not in first and first["reasoning"] == {"effort": "low"}
    assert second["tool_choice"] == "required" and second["parallel_tool_calls"] is False
    assert second["tools"][0]["strict"] is True


async def test_resolve_model_id(rserver: ResponsesServer) -> None:
    model = resolve_model("openai-responses:gpt-fake", base_url=f"{rserver.url}/v1", api_key="k")
    assert isinstance(model, OpenAIResponsesModel)
    rserver.queue(text_reply("ok"))
    try:
        assert text_of(await collect(model.stream(ask()))) == "ok"
    finally:
        await model.aclose()


# -- the whole agent: tool turns and reasoning carried across them -----------------------------


async def test_agent_tool_round_sends_outputs_and_reasoning_back(rserver: ResponsesServer, make: Any) -> None:
    first = (ResponseStream(response_id="resp_a").reasoning(encrypted="enc-1")  # no summary: opaque
             .call("call_1", "get_weather", '{"city": "Paris"}').call("call_2", "get_weather", '{"city": "Oslo"}'))
    rserver.queue(Reply(first.completed(20, 9)), text_reply("Sunny in ", "both.", given=40, taken=4),
                  text_reply("Bye."))
    agent = ReActAgent.builder().sys_prompt("Be brief.").model(make()).tools(get_weather).build()
    events = [ev async for ev in agent.stream("Weather in Paris and Oslo?")]
    assert events[-2].result.text == "Sunny in both."  # type: ignore[union-attr]
    ends = [e.usage for e in events if e.type == "model_call_end"]  # type: ignore[union-attr]
    assert ends == [ChatUsage(input_tokens=20, output_tokens=9), ChatUsage(input_tokens=40, output_tokens=4)]

    second = rserver.bodies[1]["input"]
    assert second == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "enc-1"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny in Paris"},
        {"type": "function_call_output", "call_id": "call_2", "output": "sunny in Oslo"},
    ]
    # The reasoning item lives in the conversation, so the next turn of the session sends it too.
    await agent.call("Thanks!")
    third = rserver.bodies[2]["input"]
    assert third[:7] == second and third[7:] == [{"type": "message", "role": "assistant", "content": "Sunny in both."},
                                                 {"role": "user", "content": "Thanks!"}]


def test_input_conversion_round_trips_blocks() -> None:
    from agentscope_py.model.openai_responses import to_responses_input

    signed = ThinkingBlock(thinking="sum", signature='{"type":"reasoning","id":"rs_9","encrypted_content":"e"}\n')
    foreign = ThinkingBlock(thinking="claude's", signature="EqQBCkYIARgCIkD")  # Anthropic's: not ours to send
    msgs = [
        Msg.user("q"),
        Msg(role="assistant", content=[TextBlock(text="let me"), signed, foreign,
                                       ToolUseBlock(id="c1", name="f", input={"a": 1})]),
        Msg.tool([ToolResultBlock(id="c1", name="f", output="done")]),
    ]
    assert to_responses_input(msgs) == [
        {"role": "user", "content": "q"},
        {"type": "message", "role": "assistant", "content": "let me"},
        {"type": "reasoning", "id": "rs_9", "encrypted_content": "e", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
    ]


async def test_previous_response_id_auto_sends_only_the_new_items(rserver: ResponsesServer, make: Any) -> None:
    rserver.queue(Reply(ResponseStream(response_id="resp_a").call("call_1", "get_weather", '{"city": "Oslo"}')
                        .completed()),
                  Reply(ResponseStream(response_id="resp_b").text("Sunny.").completed()),
                  Reply(ResponseStream(response_id="resp_c").text("Bye.").completed()))
    agent = ReActAgent.builder().model(make(store=True, previous_response_id="auto")).tools(get_weather).build()
    await agent.call("Weather in Oslo?")
    await agent.call("Thanks!")
    first, second, third = rserver.bodies
    assert "previous_response_id" not in first and "include" not in first and first["store"] is True
    assert second["previous_response_id"] == "resp_a"
    assert second["input"] == [{"type": "function_call_output", "call_id": "call_1", "output": "sunny in Oslo"}]
    assert third["previous_response_id"] == "resp_b"
    assert third["input"] == [{"role": "user", "content": "Thanks!"}]


def test_previous_response_id_auto_needs_store() -> None:
    with pytest.raises(ValueError, match="needs store=True"):
        OpenAIResponsesModel("m", base_url="http://127.0.0.1:9/v1", previous_response_id="auto")


# -- cancellation, recording -------------------------------------------------------------------


async def test_closing_the_stream_closes_the_http_stream(rserver: ResponsesServer, make: Any) -> None:
    rserver.queue(Reply(ResponseStream().text("first").parts[:5], end="stall"))
    model = make()
    stream = model.stream(ask())
    async with contextlib.aclosing(stream):
        first = await anext(stream)
        assert first.text == "first"
    await asyncio.wait_for(rserver.hung_up.wait(), 2)
    assert rserver.hangups == 1


async def test_interrupting_the_agent_closes_the_request(rserver: ResponsesServer, make: Any) -> None:
    rserver.queue(Reply(ResponseStream().text("thinking out loud").parts[:5], end="stall"))
    agent = ReActAgent.builder().model(make()).build()
    seen: list[str] = []
    async for ev in agent.stream("hi"):
        seen.append(ev.type)
        if ev.type == "text_block_delta":
            assert agent.interrupt()
    await asyncio.wait_for(rserver.hung_up.wait(), 2)
    assert seen[-1] == "agent_end"


async def test_recording_and_replay(rserver: ResponsesServer, make: Any, tmp_path: Path) -> None:
    stream = ResponseStream().reasoning("hm").call("call_1", "get_weather", '{"city": "Oslo"}')
    rserver.queue(Reply(stream.completed()), text_reply("Sunny."))
    path = tmp_path / "responses.json"
    recorder = RecordingModel(make(reasoning={"effort": "low"}), path, note="fake")
    agent = ReActAgent.builder().model(recorder).tools(get_weather).build()
    live = await agent.call("Weather?")

    replay = ReplayModel(path)
    try:
        assert isinstance(replay.model, OpenAIResponsesModel) and replay.provider == "openai"
        agent = ReActAgent.builder().model(replay).tools(get_weather).build()
        again = await agent.call("Weather?")
        replay.assert_complete()
    finally:
        await replay.aclose()
    assert again.text == live.text == "Sunny."
    assert len(rserver.requests) == 2  # the replay used no network


async def test_an_injected_client_does_not_retry(rserver: ResponsesServer) -> None:
    import openai

    sdk = openai.AsyncOpenAI(base_url=f"{rserver.url}/v1", api_key="sk-own", max_retries=5)
    rserver.queue(Reply.json_error(500, {"error": {"message": "boom"}}), text_reply("retried by the SDK"))
    model = OpenAIResponsesModel("gpt-fake", client=sdk)
    try:
        with pytest.raises(ServerError):
            await collect(model.stream(ModelRequest(messages=[Msg.user("hi")])))
    finally:
        await model.aclose()
    assert len(rserver.requests) == 1


async def test_events_without_output_index_are_told_apart_by_item_id(rserver: ResponsesServer, make: Any) -> None:
    # llama.cpp's server sends neither output_index nor sequence_number.
    stream = ResponseStream().call("call_1", "get_weather", '{"city":', ' "Paris"}').call(
        "call_2", "get_weather", '{"city": "Oslo"}')
    import json

    parts = []
    for part in stream.completed():
        assert isinstance(part, bytes)
        head, _, data = part.partition(b"data: ")
        payload = json.loads(data)
        payload.pop("output_index", None)
        payload.pop("sequence_number", None)
        parts.append(head + b"data: " + json.dumps(payload).encode() + b"\n\n")
    rserver.queue(Reply(list(parts)))
    chunks = await collect(make().stream(ask(tools=[get_weather.schema])))
    assert calls_of(chunks) == {0: ("call_1", "get_weather", '{"city": "Paris"}'),
                                1: ("call_2", "get_weather", '{"city": "Oslo"}')}


async def test_an_internal_model_call_keeps_opaque_reasoning(rserver: ResponsesServer, make: Any) -> None:
    from agentscope_py.middleware._internal import _collect

    rserver.queue(Reply(ResponseStream().reasoning(encrypted="enc-9").text("ok").completed()))
    reply = await _collect(make(), ask())
    thinking = [b for b in reply.content if isinstance(b, ThinkingBlock)]
    assert len(thinking) == 1 and thinking[0].thinking == ""
    assert '"encrypted_content":"enc-9"' in (thinking[0].signature or "")
