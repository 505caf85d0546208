"""Two provider rules a request can run into after trimming, compression and tool selection.

* Anthropic refuses a request whose history holds ``tool_use`` / ``tool_result`` blocks but that
  defines no tools ("Requests which include tool_use or tool_result blocks must define tools"):
  the max-iterations summary, a tool selector that narrowed to none. The converter defines the
  history's tools again, with ``tool_choice: {"type": "none"}``, so none can be called.
* Anthropic (and Bedrock, Gemini, the chat templates of Gemma, Mistral, …) refuse a conversation
  whose first non-system message is the assistant's: a trimmer without ``start_on_user`` keeps
  such a start. The Anthropic and Chat Completions converters open it with a user turn saying
  the conversation was shortened (`OPENING`).

Each rule: a converter test against the documented shape, and a run of `ReActAgent` with the
middleware that produces the request, against the fake server in strict mode.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentscope_py import Msg, ReActAgent, tool
from agentscope_py.message import TextBlock, ToolResultBlock, ToolUseBlock
from agentscope_py.middleware import MessageTrimMiddleware, ToolSelectorMiddleware
from agentscope_py.model import ModelRequest, ToolSchema
from agentscope_py.model._convert import OPENING
from agentscope_py.model._sdk import wire_body
from agentscope_py.model.anthropic import AnthropicChatModel, to_anthropic_messages
from agentscope_py.model.openai import OpenAIChatModel, to_openai_messages

from .fakes import FakeServer, Reply, an_end, an_start, an_text, an_tool_block, oa_text
from .strict import anthropic_problems, problems

pytestmark = pytest.mark.timeout(15)


@tool
def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: the city
    """
    return f"sunny in {city}"


TOOL_HISTORY = [
    Msg.system("Be brief."),
    Msg.user("Weather in Paris?"),
    Msg(role="assistant", content=[ToolUseBlock(id="toolu_1", name="get_weather", input={"city": "Paris"})]),
    Msg.tool([ToolResultBlock(id="toolu_1", name="get_weather", output="sunny")]),
]


def claude(base_url: str = "http://127.0.0.1:9") -> AnthropicChatModel:
    return AnthropicChatModel("claude-x", base_url=base_url, api_key="k")


def anthropic_body(request: ModelRequest) -> dict[str, Any]:
    return wire_body(claude().request_params(request))


# -- tool history without tools ----------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"tool_choice": {"type": "any"}}])
def test_anthropic_defines_the_history_tools_when_none_is_offered(options: dict[str, Any]) -> None:
    body = anthropic_body(ModelRequest(messages=TOOL_HISTORY, options=options))
    assert anthropic_problems(body) == []
    assert [t["name"] for t in body["tools"]] == ["get_weather"]
    assert body["tool_choice"] == {"type": "none"}  # none of them can be called


def test_a_result_whose_call_was_cut_still_names_its_tool() -> None:
    history = [Msg.tool([ToolResultBlock(id="toolu_0", name="lookup", output="x")]), Msg.user("go on")]
    body = anthropic_body(ModelRequest(messages=history))
    assert [t["name"] for t in body["tools"]] == ["lookup"] and anthropic_problems(body) == []


def test_offered_tools_and_tool_less_histories_are_sent_as_before() -> None:
    offered = [ToolSchema("get_weather", "The weather", {"type": "object"})]
    body = anthropic_body(ModelRequest(messages=TOOL_HISTORY, tools=offered))
    assert body["tools"][0]["description"] == "The weather" and "tool_choice" not in body
    plain = anthropic_body(ModelRequest(messages=[Msg.user("hi")]))
    assert "tools" not in plain and "tool_choice" not in plain


async def test_the_max_iterations_summary_passes_a_strict_anthropic(strict_server: FakeServer) -> None:
    strict_server.queue(
        Reply([an_start(), *an_tool_block(0, "toolu_1", "get_weather", '{"city": "Paris"}'), *an_end("tool_use", 5)]),
        Reply(an_text("Sunny in Paris.")),
    )
    model = claude(strict_server.url)
    agent = ReActAgent.builder().model(model).tools(get_weather).max_iters(1).build()
    try:
        reply = await agent.call("Weather in Paris?")
    finally:
        await model.aclose()
    assert strict_server.rejected == []
    assert reply.text == "Sunny in Paris."
    summary = strict_server.bodies[1]
    assert summary["tool_choice"] == {"type": "none"} and [t["name"] for t in summary["tools"]] == ["get_weather"]


async def test_a_selector_narrowing_to_no_tool_passes_a_strict_anthropic(strict_server: FakeServer) -> None:
    strict_server.queue(
        Reply([an_start(), *an_tool_block(0, "toolu_1", "get_weather", '{"city": "Paris"}'), *an_end("tool_use", 5)]),
        Reply(an_text("Sunny in Paris.")),
    )
    rounds = iter([["get_weather"], []])  # the second round is offered nothing
    selector = ToolSelectorMiddleware(lambda ctx, messages, tools: next(rounds))
    model = claude(strict_server.url)
    agent = ReActAgent.builder().model(model).tools(get_weather).middlewares([selector]).build()
    try:
        reply = await agent.call("Weather in Paris?")
    finally:
        await model.aclose()
    assert strict_server.rejected == [] and reply.text == "Sunny in Paris."
    assert strict_server.bodies[1]["tool_choice"] == {"type": "none"}


# -- a conversation that opens with the assistant ----------------------------------------------


OPENS_WITH_ASSISTANT = [Msg.system("Be brief."), Msg.assistant("Hello."), Msg.user("Hi.")]


def test_anthropic_opens_with_a_user_turn() -> None:
    system, wire = to_anthropic_messages(OPENS_WITH_ASSISTANT)
    assert system == "Be brief."
    assert [m["role"] for m in wire] == ["user", "assistant", "user"]
    assert wire[0]["content"] == [{"type": "text", "text": OPENING}]
    assert anthropic_problems(anthropic_body(ModelRequest(messages=OPENS_WITH_ASSISTANT))) == []


def test_chat_completions_open_with_a_user_message() -> None:
    wire = to_openai_messages(OPENS_WITH_ASSISTANT)
    assert [m["role"] for m in wire] == ["system", "user", "assistant", "user"]
    assert wire[1] == {"role": "user", "content": OPENING}
    assert problems({"messages": wire}) == []
    # a conversation that opens with the user is sent as it is
    assert to_openai_messages([Msg.user("Hi.")]) == [{"role": "user", "content": "Hi."}]


def test_a_call_and_its_results_opening_the_conversation_follow_the_user_turn() -> None:
    history = [Msg(role="assistant", content=[ToolUseBlock(id="c1", name="get_weather", input={})]),
               Msg.tool([ToolResultBlock(id="c1", name="get_weather", output=[TextBlock(text="sunny")])])]
    _, wire = to_anthropic_messages(history)
    assert [m["role"] for m in wire] == ["user", "assistant", "user"]
    assert [m["role"] for m in to_openai_messages(history)] == ["user", "assistant", "tool"]


async def two_turns_trimmed(model: AnthropicChatModel | OpenAIChatModel) -> Msg:
    """Two turns with the last two messages kept: the second request is [assistant, user]."""
    agent = (ReActAgent.builder().sys_prompt("Be brief.").model(model)
             .middlewares([MessageTrimMiddleware(max_messages=2)]).build())
    try:
        await agent.call("Hi.")
        return await agent.call("How are you?")
    finally:
        await model.aclose()


async def test_a_trimmed_conversation_passes_a_strict_anthropic(strict_server: FakeServer) -> None:
    strict_server.queue(Reply(an_text("Hello.")), Reply(an_text("Fine.")))
    reply = await two_turns_trimmed(claude(strict_server.url))
    assert strict_server.rejected == [] and reply.text == "Fine."
    second = strict_server.bodies[1]["messages"]  # [assistant, user] kept, opened by the user turn
    assert [m["role"] for m in second] == ["user", "assistant", "user"]


async def test_a_trimmed_conversation_passes_a_strict_chat_server(strict_server: FakeServer) -> None:
    strict_server.queue(Reply(oa_text("Hello.")), Reply(oa_text("Fine.")))
    reply = await two_turns_trimmed(OpenAIChatModel("gpt-x", base_url=f"{strict_server.url}/v1", api_key="k"))
    assert strict_server.rejected == [] and reply.text == "Fine."
    assert [m["role"] for m in strict_server.bodies[1]["messages"]] == ["system", "user", "assistant", "user"]
