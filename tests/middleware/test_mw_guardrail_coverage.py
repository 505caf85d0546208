"""GuardrailMiddleware checks every text the caller receives — the answer, the reasoning and tool
call arguments — at every split of the stream; ``covers`` narrows it."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentscope_py import ModelStep, ReActAgent, ScriptedModel
from agentscope_py.errors import GuardrailTripped
from agentscope_py.message import ChatUsage
from agentscope_py.middleware import GuardrailCheck, GuardrailMiddleware
from agentscope_py.model.base import ChatChunk, ModelRequest, ToolCallChunk
from tests.middleware.resilience_helpers import balance

FORBIDDEN = "launch code"


def no_launch_code(check: GuardrailCheck) -> str | None:
    return f"{check.kind} mentions the launch code" if FORBIDDEN in check.text else None


class PartsModel:
    """Streams the chunks it is given, then usage."""

    name = "parts"
    provider = "test"
    supports_structured_output = False

    def __init__(self, chunks: list[ChatChunk]) -> None:
        self.chunks = chunks
        self.closed = 0

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        try:
            for chunk in self.chunks:
                yield chunk
            yield ChatChunk(usage=ChatUsage(input_tokens=1, output_tokens=1), finish_reason="stop")
        finally:
            self.closed += 1


def cut(text: str, rng: random.Random) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(8, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def thinking_chunks(text: str, rng: random.Random) -> list[ChatChunk]:
    return [ChatChunk(thinking=piece) for piece in cut(text, rng)]


def argument_chunks(arguments: str, rng: random.Random) -> list[ChatChunk]:
    return [ChatChunk(tool_call=ToolCallChunk(index=0, id="c1" if i == 0 else None, name="send" if i == 0 else None,
                                              arguments=piece))
            for i, piece in enumerate(cut(arguments, rng))]


async def run(model: Any, **options: Any) -> tuple[list[Any], BaseException | None]:
    agent = ReActAgent.builder().model(model).middleware(GuardrailMiddleware(stream=no_launch_code, **options)).build()
    events: list[Any] = []
    try:
        async for event in agent.stream("hi"):
            events.append(event)
    except GuardrailTripped as exc:
        return events, exc
    return events, None


def seen_by_caller(events: list[Any], kind: str) -> str:
    return "".join(e.delta for e in events if e.type == kind)


@pytest.mark.parametrize("seed", range(40))
async def test_forbidden_thinking_trips_at_any_split_and_blocking_lets_none_of_it_out(seed: int) -> None:
    rng = random.Random(seed)
    model = PartsModel([*thinking_chunks(f"The user wants the {FORBIDDEN} 0000.", rng), ChatChunk(text="No.")])
    events, _ = await run(model, blocking=True)
    tripped = [e for e in events if e.type == "guardrail_tripped"]
    assert [t.reason for t in tripped] == ["thinking mentions the launch code"]
    assert FORBIDDEN not in seen_by_caller(events, "thinking_block_delta")
    assert "No." not in seen_by_caller(events, "text_block_delta")  # the model was stopped there
    assert balance(events) == {} and model.closed == 1


@pytest.mark.parametrize("seed", range(40))
async def test_forbidden_tool_arguments_trip_at_any_split_naming_the_tool(seed: int) -> None:
    rng = random.Random(1000 + seed)
    checks: list[GuardrailCheck] = []

    def record(check: GuardrailCheck) -> str | None:
        checks.append(check)
        return no_launch_code(check)

    arguments = '{"to": "hq", "body": "the launch code is 0000"}'
    model = PartsModel(argument_chunks(arguments, rng))
    agent = ReActAgent.builder().model(model).middleware(
        GuardrailMiddleware(stream=record, blocking=True, exit_behavior="error")).build()
    events: list[Any] = []
    with pytest.raises(GuardrailTripped, match="tool_arguments mentions the launch code"):
        async for event in agent.stream("hi"):
            events.append(event)
    assert FORBIDDEN not in seen_by_caller(events, "tool_call_delta")
    assert {(c.kind, c.tool_name) for c in checks} == {("tool_arguments", "send")}
    assert balance(events) == {}


async def test_non_blocking_checks_see_thinking_too() -> None:
    model = ScriptedModel([ModelStep(text="fine", thinking=f"recall the {FORBIDDEN}", chunks=3)])
    events, _ = await run(model)
    assert [e.reason for e in events if e.type == "guardrail_tripped"] == ["thinking mentions the launch code"]


async def test_covers_narrows_what_the_checks_see() -> None:
    model = ScriptedModel([ModelStep(text="fine", thinking=f"recall the {FORBIDDEN}", chunks=3)])
    events, _ = await run(model, covers=("text",))
    assert not [e for e in events if e.type == "guardrail_tripped"] and events[-2].result.text == "fine"
    with pytest.raises(ValueError, match="covers takes a non-empty collection"):
        GuardrailMiddleware(stream=no_launch_code, covers=("text", "tool_results"))


async def test_output_checks_see_the_whole_reasoning_and_each_tool_calls_arguments() -> None:
    seen: list[tuple[str, str | None, str]] = []

    def record(check: GuardrailCheck) -> None:
        seen.append((check.kind, check.tool_name, check.text))

    step = ModelStep.tool_calls_of(("lookup", {"q": "a"}), ("lookup", {"q": "b"}), text="calling", thinking="hmm",
                                   chunks=2)
    model = ScriptedModel([step, ModelStep.text("done")])
    agent = ReActAgent.builder().model(model).middleware(GuardrailMiddleware(output=record)).build()
    await agent.call("go")
    assert seen[:4] == [("text", None, "calling"), ("thinking", None, "hmm"),
                        ("tool_arguments", "lookup", '{"q": "a"}'), ("tool_arguments", "lookup", '{"q": "b"}')]


def leaky(text: str) -> str:
    """Look a record up.

    Args:
        text: what to look up
    """
    return f"record for {text}: the {FORBIDDEN} is 0000, and more after it"


@pytest.mark.parametrize("blocking", [False, True])
async def test_tool_results_are_checked_when_covered(blocking: bool) -> None:
    model = ScriptedModel([ModelStep.tool_call("leaky", {"text": "x"}), ModelStep.text("never")])
    mw = GuardrailMiddleware(stream=no_launch_code, stream_every=8, blocking=blocking, covers=("text", "tool_result"))
    agent = ReActAgent.builder().model(model).tools(leaky).middleware(mw).build()
    events = await agent.stream("go").to_list()
    assert [e.reason for e in events if e.type == "guardrail_tripped"] == ["tool_result mentions the launch code"]
    shown = seen_by_caller(events, "tool_result_text_delta")
    if blocking:
        assert FORBIDDEN not in shown  # nothing unchecked went out
    end = next(e for e in events if e.type == "tool_result_end")
    assert end.state.value == "error" and balance(events) == {}
    assert events[-2].result.generate_reason.value == "middleware_stop_requested"
    assert len(model.requests) == 1  # the run stopped: the model never saw the result


async def test_tool_results_are_not_checked_by_default_and_output_checks_see_them_whole() -> None:
    model = ScriptedModel([ModelStep.tool_call("leaky", {"text": "x"}), ModelStep.text("fine")])
    agent = ReActAgent.builder().model(model).tools(leaky).middleware(GuardrailMiddleware(stream=no_launch_code)).build()
    assert (await agent.call("go")).text == "fine"

    seen: list[tuple[str, str | None, str]] = []

    def record(check: GuardrailCheck) -> None:
        seen.append((check.kind, check.tool_name, check.text))

    model = ScriptedModel([ModelStep.tool_call("leaky", {"text": "y"}), ModelStep.text("fine")])
    agent = ReActAgent.builder().model(model).tools(leaky).middleware(
        GuardrailMiddleware(output=record, covers=("tool_result",))).build()
    await agent.call("go")
    assert ("tool_result", "leaky", leaky("y")) in seen


async def test_a_tool_result_trip_with_exit_error_raises_and_stays_balanced() -> None:
    model = ScriptedModel([ModelStep.tool_call("leaky", {"text": "x"}), ModelStep.text("never")])
    mw = GuardrailMiddleware(output=no_launch_code, blocking=True, exit_behavior="error", covers=("tool_result",),
                             refusal="no")
    agent = ReActAgent.builder().model(model).tools(leaky).middleware(mw).build()
    events: list[Any] = []
    with pytest.raises(GuardrailTripped, match="tool_result mentions the launch code"):
        async for event in agent.stream("go"):
            events.append(event)
    assert seen_by_caller(events, "tool_result_text_delta") == ""  # held for the output check
    assert balance(events) == {} and "no" not in seen_by_caller(events, "text_block_delta")
