"""Agent runs against an OpenAI-compatible server, shared by the real-server tests (which record
them into cassettes) and the replay tests (which run them again against the cassettes).

A run must send the same requests every time for its cassette to replay, so each is fixed down
to the options: a seed, a token limit. Gemma 3 270M follows no instruction to use
a tool, and llama.cpp's ``chatml-function-calling`` cannot stream a tool call it was not told to
make ("Automatic streaming tool choice is not supported"), so `ToolPlan` names the tool of each
call and then says ``tool_choice: "none"`` for the answer.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agentscope_py import MiddlewareBase, Msg, ReActAgent, tool
from agentscope_py.message import TextBlock, ToolResultBlock, ToolUseBlock
from agentscope_py.model import ChatModel, MalformedStreamError

# At temperature 0 the 270M model answers a tool result with nothing; with this seed it writes.
OPTIONS: dict[str, Any] = {"temperature": 0.7, "seed": 7, "max_tokens": 48}


@tool
def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: the city
    """
    return f"sunny, 21 degrees in {city}"


@tool
def get_time(city: str) -> str:
    """The local time in a city.

    Args:
        city: the city
    """
    return f"it is 14:05 in {city}"


def _calls_this_turn(messages: list[Msg]) -> int:
    calls = 0
    for msg in reversed(messages):
        if getattr(msg, "synthetic", False):  # the agent's own reminders do not start a turn
            continue
        if msg.role == "user" and any(isinstance(b, TextBlock) for b in msg.content) and not any(
            isinstance(b, ToolResultBlock) for b in msg.content
        ):
            break
        calls += sum(1 for b in msg.content if isinstance(b, ToolUseBlock))
    return calls


class ToolPlan(MiddlewareBase):
    """Forces the tools of ``plan``, one per model call of a turn, then ``tool_choice="none"``."""

    def __init__(self, *plan: str) -> None:
        self.plan = plan

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        if not input.tools:
            return next(input)
        done = _calls_this_turn(list(input.messages))
        choice: Any = "none"
        if done < len(self.plan):
            choice = {"type": "function", "function": {"name": self.plan[done]}}
        return next(input.replace(options={**input.options, "tool_choice": choice}))


@dataclass
class Outcome:
    texts: list[str] = field(default_factory=list)
    tool_calls: list[tuple[str, str]] = field(default_factory=list)
    """(tool name, argument text) of each call, in order."""
    tool_results: list[str] = field(default_factory=list)
    text_deltas: int = 0
    usages: list[Any] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    error: BaseException | None = None
    seconds: float = 0.0


WEATHER_PROMPT = "You are a weather assistant. Answer in one sentence."


def _agent(model: ChatModel, *plan: str, tools: tuple[Any, ...] = (get_weather, get_time),
           sys_prompt: str = WEATHER_PROMPT, **options: Any) -> Any:
    builder = ReActAgent.builder().sys_prompt(sys_prompt).model(model)
    builder = builder.model_options(**{**OPTIONS, **options}).max_iters(4)
    if plan:
        builder = builder.tools(*tools).middleware(ToolPlan(*plan))
    return builder.build()


async def _run(agent: Any, question: str, out: Outcome, *, stop_after_deltas: int | None = None) -> Outcome:
    started = time.monotonic()
    args: dict[str, tuple[str, list[str]]] = {}
    try:
        async with contextlib.aclosing(agent.stream(question)) as events:
            async for ev in events:
                if ev.type == "tool_call_start":
                    args[ev.tool_call_id] = (ev.tool_name, [])
                elif ev.type == "tool_call_delta":
                    args[ev.tool_call_id][1].append(ev.delta)
                elif ev.type == "tool_call_end":
                    name, parts = args[ev.tool_call_id]
                    out.tool_calls.append((name, "".join(parts)))
                elif ev.type == "tool_result_end":
                    out.tool_results.append(str(ev.state))
                elif ev.type == "text_block_delta":
                    out.text_deltas += 1
                    if stop_after_deltas is not None and out.text_deltas >= stop_after_deltas:
                        break
                elif ev.type == "model_call_end":
                    out.usages.append(ev.usage)
                    out.finish_reasons.append(ev.finish_reason)
                elif ev.type == "agent_result":
                    out.texts.append(ev.result.text)
    except Exception as exc:  # the scenario's assertions look at it
        out.error = exc
    out.seconds += time.monotonic() - started
    return out


async def tool_turn(model: ChatModel) -> Outcome:
    """One tool call, its result, a final answer; then a second user turn in the same session."""
    agent = _agent(model, "get_weather")
    out = await _run(agent, "What is the weather in Paris?", Outcome())
    return await _run(agent, "And in Oslo?", out)


async def two_tools(model: ChatModel) -> Outcome:
    """Two tools in one turn (llama.cpp streams one forced call per response: two calls, two
    responses), then the answer."""
    return await _run(_agent(model, "get_weather", "get_time"), "Weather and local time in Rome?", Outcome())


# Gemma 3 270M under llama.cpp's chatml template mostly repeats or retells the user's message; a
# story with no instruction is what makes it write longest (50 to 110 tokens in our runs).
STORY = (
    "The keeper climbed the ninety steps of the lighthouse every evening at dusk. "
    "He trimmed the wick, polished the great lens and watched the grey sea for ships. For eleven years "
    "nothing had happened that he could not write in one line of the log: wind from the west, a schooner "
    "at noon, fog until four. His wife had gone to the mainland in the spring and her letters came with "
    "the supply boat, folded small, smelling of the bakery where she worked. One night in November a storm "
    "came in from the west, faster than the glass had promised. The rain came sideways and the lamp "
    "shook in its frame. At midnight he saw a light where no light should be, low on the water near the "
    "reef, and then a second one, and he understood that a ship had lost its way and was feeling for the "
    "channel in the dark. He wound the clockwork that turned the lens, faster, as if speed could make the "
    "beam brighter, and he rang the fog bell by hand until his arms burned. Towards dawn the lights turned "
    "away from the reef, slowly, one after the other, and he wrote in the log: storm, ship safe, lamp "
    "kept. Then he sat on the top step and slept until the supply boat came."
)


async def long_text(model: ChatModel) -> Outcome:
    """A streamed text of a few hundred tokens."""
    agent = _agent(model, sys_prompt="You are a helpful assistant.", max_tokens=400)
    return await _run(agent, STORY, Outcome())


async def cancelled(model: ChatModel) -> Outcome:
    """A long answer abandoned after 5 text deltas: the consumer stops reading, the model's
    stream and its HTTP response are closed."""
    agent = _agent(model, sys_prompt="You are a helpful assistant.", max_tokens=1500)
    return await _run(agent, "Continue this story: " + STORY, Outcome(), stop_after_deltas=5)


async def auto_tool_choice(model: ChatModel) -> Outcome:
    """Tools without a forced choice: llama.cpp's chatml-function-calling starts the stream, then
    fails ("Automatic streaming tool choice is not supported") and ends it without [DONE]."""
    options = {**OPTIONS, "temperature": 0, "seed": 1, "tool_choice": "auto"}  # the model goes for the tool
    agent = ReActAgent.builder().model(model).tools(get_weather).model_options(**options).max_iters(3).build()
    return await _run(agent, "What is the weather in Paris? Use the get_weather tool.", Outcome())


async def hello(model: ChatModel) -> Outcome:
    """The run docs/providers.md replays: one question, no tools."""
    agent = ReActAgent.builder().model(model).model_options(temperature=0, seed=1, max_tokens=16).build()
    return await _run(agent, "What is the capital of France?", Outcome())


SCENARIOS: dict[str, Callable[[ChatModel], Awaitable[Outcome]]] = {
    "hello": hello,
    "tool_turn": tool_turn,
    "two_tools": two_tools,
    "long_text": long_text,
    "cancelled": cancelled,
    "auto_tool_choice": auto_tool_choice,
}


def check(name: str, out: Outcome) -> None:
    """What each scenario must show, live or replayed."""
    if name == "auto_tool_choice":
        assert isinstance(out.error, MalformedStreamError), repr(out.error)
        assert "without [DONE]" in str(out.error) and out.texts == []
        return
    assert out.error is None, f"{name}: {out.error!r}"
    # A live run is not exactly repeatable (the server's prompt cache changes the numerics), so
    # what is checked is the protocol: which tools, their results, how each call ended.
    if name == "tool_turn":
        assert len(out.texts) == 2 and len(out.tool_calls) >= 2
        assert {n for n, _ in out.tool_calls} == {"get_weather"}
        assert json.loads(out.tool_calls[0][1]) == {"city": "Paris"}
        assert set(out.tool_results) == {"success"} and out.finish_reasons[-1] in ("stop", "length")
    elif name == "two_tools":
        assert [n for n, _ in out.tool_calls][:2] == ["get_weather", "get_time"]
        assert set(out.tool_results) == {"success"} and len(out.texts) == 1
        assert out.finish_reasons[:2] == ["tool_calls", "tool_calls"] and out.finish_reasons[-1] in ("stop", "length")
    elif name == "long_text":
        assert len(out.texts) == 1 and len(out.texts[0]) > 150 and out.text_deltas > 25
        assert out.finish_reasons in (["length"], ["stop"])
    elif name == "hello":
        assert len(out.texts) == 1 and out.finish_reasons in (["stop"], ["length"])
    elif name == "cancelled":
        assert out.text_deltas == 5 and out.texts == [] and out.finish_reasons == []
    # llama.cpp's server sends no usage (it ignores include_usage): unknown, not zero
    assert all(u is None for u in out.usages), out.usages
