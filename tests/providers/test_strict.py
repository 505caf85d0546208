"""Requests strict OpenAI-compatible servers accept, against the fake server in strict mode.

The first run against llama.cpp's server failed on the second call of a tool turn (``content:
null`` next to ``tool_calls``) and on the max-iterations summary (``tool_choice`` without
``tools``); the strict fake refuses both the way llama.cpp does, so these tests catch a regression
without the real server.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from agentscope_py import Msg, ReActAgent, tool
from agentscope_py.message import TextBlock
from agentscope_py.model import BadRequestError, ModelRequest, ServerError, ToolSchema
from agentscope_py.model._errors import error_from_status
from agentscope_py.model.anthropic import AnthropicChatModel
from agentscope_py.model.ollama import OllamaChatModel
from agentscope_py.model.openai import OpenAIChatModel

from .fakes import FakeServer, Reply, oa_text, oa_tool_calls

pytestmark = pytest.mark.timeout(15)

FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@tool
def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: the city
    """
    return f"sunny in {city}"


@tool
def get_time(city: str) -> str:
    """The local time in a city.

    Args:
        city: the city
    """
    return f"noon in {city}"


async def post(server: FakeServer, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5) as client:
        return await client.post(f"{server.url}/v1/chat/completions", json=body)


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(("body", "says"), [
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": None, "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": TOOLS},
     "'messages', 1, 'ChatCompletionRequestAssistantMessage', 'content'), 'msg': 'Input should be a valid string"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": FORCE_WEATHER},
     "'tool_choice' is only allowed when 'tools' are specified"),
    ({"messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": False},
     "'parallel_tool_calls' is only allowed"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": []}, "'tools' must hold at least one tool"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "call_renamed", "content": "sunny"}], "tools": TOOLS},
     "'call_renamed' answers no tool call"),
])
async def test_the_strict_fake_refuses_what_strict_servers_refuse(
    strict_server: FakeServer, body: dict[str, Any], says: str
) -> None:
    response = await post(strict_server, {"model": "m", "stream": True, **body})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "internal_server_error" and says in error["message"]


async def test_the_strict_fake_takes_a_well_formed_tool_turn(strict_server: FakeServer) -> None:
    strict_server.queue(Reply(oa_text("ok")))
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "tools": TOOLS,
            "tool_choice": FORCE_WEATHER, "messages": [
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}
    assert (await post(strict_server, body)).status_code == 200
    assert strict_server.rejected == []


def model_for(server: FakeServer) -> OpenAIChatModel:
    return OpenAIChatModel("gemma3-270m", base_url=f"{server.url}/v1", api_key="none", timeout=5)


async def test_tool_turns_summary_and_second_turn_pass_a_strict_server(strict_server: FakeServer) -> None:
    strict_server.queue(
        # turn 1: two tools in one call, then a call forced by tool_choice, then the summary
        Reply(oa_tool_calls(("call_w", "get_weather", ['{"city": "Paris"}']),
                            ("call_t", "get_time", ['{"city": "Paris"}']))),
        Reply(oa_tool_calls(("call_w2", "get_weather", ['{"city": "Oslo"}']))),
        Reply(oa_text("Sunny and noon in Paris.")),
        # turn 2 in the same session
        Reply(oa_tool_calls(("call_w3", "get_weather", ['{"city": "Rome"}']))),
        Reply(oa_tool_calls(("call_w4", "get_weather", ['{"city": "Rome"}']))),
        Reply(oa_text("Sunny in Rome.")),
    )
    model = model_for(strict_server)
    agent = (ReActAgent.builder().sys_prompt("Be brief.").model(model).tools(get_weather, get_time)
             .model_options(tool_choice=FORCE_WEATHER, parallel_tool_calls=True).max_iters(2).build())
    try:
        first = await agent.call("Weather and time in Paris?")
        second = await agent.call("And Rome?")
    finally:
        await model.aclose()

    assert strict_server.rejected == []
    assert first.text == "Sunny and noon in Paris." and second.text == "Sunny in Rome."
    bodies = strict_server.bodies
    assert len(bodies) == 6
    summary = bodies[2]  # the max-iterations summary has no tools, so no tool options either
    assert "tools" not in summary and "tool_choice" not in summary and "parallel_tool_calls" not in summary
    assert bodies[1]["tool_choice"] == FORCE_WEATHER and bodies[1]["parallel_tool_calls"] is True
    replayed = bodies[1]["messages"][2]
    assert replayed["content"] == "" and [c["id"] for c in replayed["tool_calls"]] == ["call_w", "call_t"]
    assert [m["tool_call_id"] for m in bodies[1]["messages"][3:5]] == ["call_w", "call_t"]  # ids kept
    later = bodies[3]["messages"]  # the second turn carries the whole first one, accepted as well
    assert [m["role"] for m in later].count("tool") == 3 and later[-1] == {"role": "user", "content": "And Rome?"}


async def test_the_old_request_shape_fails_against_the_strict_server(strict_server: FakeServer) -> None:
    # What the run against llama.cpp saw, kept as a check that the strict fake would catch it.
    strict_server.queue(Reply(oa_text("unused")))
    model = model_for(strict_server)
    history = [Msg.user("hi"), Msg(role="assistant", content=[]), Msg.user("again")]
    params = model.request_params(ModelRequest(messages=history))
    params["messages"][1]["content"] = None
    try:
        with pytest.raises(openai.InternalServerError, match="Input should be a valid string"):
            await model.client.chat.completions.create(**params)
    finally:
        await model.aclose()


@pytest.mark.parametrize("options", [
    {"tool_choice": "required"}, {"parallel_tool_calls": False}, {"tools": []},
    {"tool_choice": FORCE_WEATHER, "parallel_tool_calls": True, "tools": []},
])
def test_tool_only_options_go_only_with_tools(options: dict[str, Any]) -> None:
    model = OpenAIChatModel("m", base_url="http://127.0.0.1:9/v1")
    bare = model.request_params(ModelRequest(messages=[Msg.user("hi")], options=dict(options)))["extra_body"]
    assert not {"tools", "tool_choice", "parallel_tool_calls"} & set(bare)
    tools = [ToolSchema("get_weather", "The weather", {"type": "object"})]
    full = model.request_params(ModelRequest(messages=[Msg.user("hi")], tools=tools, options=dict(options)))
    body = full["extra_body"]
    assert body["tools"] == [tools[0].to_openai()]
    assert {k: body[k] for k in options if k != "tools"} == {k: v for k, v in options.items() if k != "tools"}


@pytest.mark.parametrize("options", [{"tool_choice": {"type": "any"}}, {"tool_choice": {"type": "auto"}, "tools": []}])
def test_anthropic_sends_tool_choice_only_with_tools(options: dict[str, Any]) -> None:
    model = AnthropicChatModel("claude-x", base_url="http://127.0.0.1:9", api_key="k")
    bare = model.request_params(ModelRequest(messages=[Msg.user("hi")], options=dict(options)))
    assert "extra_body" not in bare and "tools" not in bare
    tools = [ToolSchema("get_weather", "The weather", {"type": "object"})]
    full = model.request_params(ModelRequest(messages=[Msg.user("hi")], tools=tools, options=dict(options)))
    assert full["extra_body"]["tool_choice"] == options["tool_choice"] and len(full["tools"]) == 1


def test_anthropic_leaves_out_empty_text_blocks() -> None:
    model = AnthropicChatModel("claude-x", base_url="http://127.0.0.1:9", api_key="k")
    history = [Msg.user("hi"), Msg(role="assistant", content=[TextBlock(text="")]), Msg.user("again")]
    params = model.request_params(ModelRequest(messages=history))
    assert params["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                               {"type": "text", "text": "again"}]}]


def test_ollama_has_no_tool_choice_and_no_empty_fields() -> None:
    model = OllamaChatModel("llama-x", host="http://127.0.0.1:9", tool_choice="required", parallel_tool_calls=True)
    history = [Msg.user("hi"), Msg(role="assistant", content=[TextBlock(text="")]), Msg.user("again")]
    body = model.request_params(ModelRequest(messages=history))
    assert body == {"model": "llama-x", "stream": True, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": "user", "content": "again"}]}


async def test_a_refused_request_is_a_bad_request_not_retried(strict_server: FakeServer) -> None:
    # llama-cpp-python answers a body it refuses with 500; retrying the same body cannot help.
    model = model_for(strict_server)
    agent = ReActAgent.builder().model(model).model_options(messages="not a list").max_retries(3).build()
    try:
        with pytest.raises(BadRequestError, match="validation error") as info:
            await agent.call("hi")
    finally:
        await model.aclose()
    assert info.value.status_code == 500 and not info.value.retryable
    assert len(strict_server.rejected) == 1  # no retries


def test_llama_cpp_validation_500_is_a_bad_request() -> None:
    message = ("1 validation error:\n  {'type': 'literal_error', 'loc': ('body', 'response_format', 'type'), "
               "'msg': \"Input should be 'text' or 'json_object'\", 'input': 'json_schema'}")
    assert type(error_from_status(500, message, provider="openai")) is BadRequestError
    assert type(error_from_status(500, "CUDA out of memory", provider="openai")) is ServerError
