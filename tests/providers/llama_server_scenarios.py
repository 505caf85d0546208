"""Agent runs against llama.cpp's C++ server (`llama-server`) on each of its three protocols,
shared by the live tests (which record them) and the replay tests (which run them again against
the recorded bytes).

One server process answers OpenAI Chat Completions (`OpenAIChatModel`), OpenAI Responses
(`OpenAIResponsesModel`) and Anthropic Messages (`AnthropicChatModel`). A run must send the same
requests every time for its cassette to replay, so each is fixed down to the options.

Tool calls: Gemma 3 270M does not decide to call a tool by itself. llama-server learns the call
syntax of ``scripts/gemma3-tools.jinja`` (``<tool_call>`` + JSON) and constrains the output with a
grammar, but that grammar lets any text come before the call even with ``tool_choice:
"required"``, and the model writes text until its token limit. So the tool scenario here sends a
conversation that already holds a call and its result (the shapes each protocol must carry), and
tool calls the model makes stay with llama-cpp-python's server (``test_real_server.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from agentscope_py import Msg, ReActAgent
from agentscope_py.message import ToolResultBlock, ToolUseBlock
from agentscope_py.model import AnthropicChatModel, ChatModel, ContextLengthError, ModelRequest, OpenAIChatModel
from agentscope_py.model.openai_responses import OpenAIResponsesModel

from .scenarios import STORY, Outcome, _run, get_weather

PROTOCOLS = ("chat", "responses", "messages")
MODEL = "gemma3-270m"

# Per protocol: the option that limits the reply.
_LIMIT = {"chat": "max_tokens", "responses": "max_output_tokens", "messages": "max_tokens"}


def make_model(protocol: str, url: str, **kw: Any) -> ChatModel:
    """The provider for ``protocol`` pointed at the server at ``url`` (``http://host:port``)."""
    if protocol == "chat":
        return OpenAIChatModel(MODEL, base_url=f"{url}/v1", api_key="none", timeout=120, **kw)
    if protocol == "responses":
        return OpenAIResponsesModel(MODEL, base_url=f"{url}/v1", api_key="none", timeout=120, **kw)
    return AnthropicChatModel(MODEL, base_url=url, api_key="none", timeout=120, **kw)


def _options(protocol: str, limit: int, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0.7, "seed": 7, _LIMIT[protocol]: limit, **extra}


async def hello(model: ChatModel, protocol: str) -> Outcome:
    """One question, a streamed answer, usage as the server reports it."""
    agent = ReActAgent.builder().model(model).model_options(**_options(protocol, 24, temperature=0)).build()
    return await _run(agent, "What is the capital of France?", Outcome())


async def two_turns(model: ChatModel, protocol: str) -> Outcome:
    """Two user turns in one session: the second request carries the first turn's answer."""
    agent = (ReActAgent.builder().sys_prompt("You are a helpful assistant. Answer in one sentence.")
             .model(model).model_options(**_options(protocol, 24)).build())
    out = await _run(agent, "What is the capital of France?", Outcome())
    return await _run(agent, "And of Norway?", out)


async def tool_result(model: ChatModel, protocol: str) -> Outcome:
    """A conversation holding a tool call and its result, with the tool offered: the server takes
    the call and the result in its protocol's shape and writes the answer."""
    history = [
        Msg.system("You are a weather assistant. Answer in one sentence."),
        Msg.user("What is the weather in Paris?"),
        Msg(role="assistant", content=[ToolUseBlock(id="call_1", name="get_weather", input={"city": "Paris"})]),
        Msg.tool([ToolResultBlock(id="call_1", name="get_weather", output="sunny, 21 degrees in Paris")]),
    ]
    request = ModelRequest(messages=history, tools=[get_weather.schema], options=_options(protocol, 32))
    out = Outcome()
    text: list[str] = []
    try:
        async for chunk in model.stream(request):
            if chunk.text:
                text.append(chunk.text)
                out.text_deltas += 1
            if chunk.tool_call is not None and chunk.tool_call.name:
                out.tool_calls.append((chunk.tool_call.name, chunk.tool_call.arguments))
            if chunk.finish_reason is not None:
                out.finish_reasons.append(chunk.finish_reason)
            if chunk.usage is not None:
                out.usages.append(chunk.usage)
    except Exception as exc:
        out.error = exc
    out.texts.append("".join(text))
    return out


async def cancelled(model: ChatModel, protocol: str) -> Outcome:
    """A long answer abandoned after 5 text deltas: the HTTP stream is closed."""
    agent = (ReActAgent.builder().sys_prompt("You are a helpful assistant.").model(model)
             .model_options(**_options(protocol, 1500)).build())
    return await _run(agent, "Continue this story: " + STORY, Outcome(), stop_after_deltas=5)


async def refused(model: ChatModel, protocol: str) -> Outcome:
    """A prompt longer than the server's context: refused before any token, a typed error."""
    agent = ReActAgent.builder().model(model).model_options(**_options(protocol, 8)).build()
    return await _run(agent, STORY * 20, Outcome())


SCENARIOS: dict[str, Callable[[ChatModel, str], Awaitable[Outcome]]] = {
    "hello": hello,
    "two_turns": two_turns,
    "tool_result": tool_result,
    "cancelled": cancelled,
    "refused": refused,
}


def check(name: str, protocol: str, out: Outcome) -> None:
    """What each scenario must show, live or replayed: the protocol, not the model's words."""
    if name == "refused":
        assert isinstance(out.error, ContextLengthError), repr(out.error)
        assert out.error.status_code == 400 and not out.error.retryable
        assert out.texts == [] and out.text_deltas == 0
        return
    assert out.error is None, f"{protocol} {name}: {out.error!r}"
    if name == "hello":
        assert len(out.texts) == 1 and out.texts[0] and out.text_deltas >= 2
        assert out.finish_reasons in (["stop"], ["length"])
    elif name == "two_turns":
        assert len(out.texts) == 2 and all(out.texts) and set(out.finish_reasons) <= {"stop", "length"}
        assert len(out.usages) == 2 and out.usages[1].input_tokens > out.usages[0].input_tokens  # the history grew
    elif name == "tool_result":
        assert out.texts[0] and out.text_deltas >= 2 and len(out.finish_reasons) == 1
    elif name == "cancelled":
        assert out.text_deltas == 5 and out.texts == [] and out.finish_reasons == []
        return
    # llama-server counts the tokens of every completed call, on every protocol.
    assert out.usages and all(u is not None and u.input_tokens > 0 and u.output_tokens > 0 for u in out.usages), \
        out.usages
