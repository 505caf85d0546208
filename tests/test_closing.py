"""The closing guarantee: every Start the caller's stream carries gets exactly one
matching End, and the result is what callers saw."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import pytest
from conftest import types

from agentscope_py import (
    ExtensionPoint,
    GenerateReason,
    MiddlewareBase,
    MiddlewareError,
    ModelStep,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    Toolkit,
    tool,
)
from agentscope_py.events import RequestStop, TextBlockDelta
from agentscope_py.message import ToolUseBlock
from agentscope_py.model.base import ModelError
from agentscope_py.stream import EventStream

P = ExtensionPoint


def balance(events: list[Any]) -> Counter[str]:
    """Start minus End per bracket kind (all zero when balanced)."""
    count: Counter[str] = Counter()
    for e in events:
        for kind in ("text_block", "thinking_block", "data_block", "tool_call", "tool_result", "model_call"):
            if e.type == f"{kind}_start":
                count[kind] += 1
            elif e.type == f"{kind}_end":
                count[kind] -= 1
    return +count + -count  # drop the zeros, keep positives and negatives


class StopAfterTwoDeltas(MiddlewareBase):
    """A guardrail that stops reading the model after two deltas and requests a stop."""

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        seen = [0]

        def more(e: Any) -> bool:
            if type(e) is TextBlockDelta:
                seen[0] += 1
            return seen[0] <= 2

        return EventStream.concat(next(input).take_while(more), [RequestStop(reason="blocked")])


async def test_a_layer_that_stops_reading_leaves_the_stream_balanced() -> None:
    model = ScriptedModel([ModelStep.text("one two three four", chunks=4)])
    agent = ReActAgent.builder().model(model).middleware(StopAfterTwoDeltas()).build()
    events = await agent.stream("hi").to_list()
    assert types(events) == [
        "agent_start", "model_call_start", "text_block_start", "text_block_delta", "text_block_delta",
        "request_stop", "text_block_end", "model_call_end", "agent_result", "agent_end",
    ]
    end = events[-3]
    assert end.error is not None and "cut short" in end.error and not end.discarded  # the partial is remembered
    shown = "".join(e.delta for e in events if type(e) is TextBlockDelta)
    result = events[-2].result
    assert result.text == shown == "one two th"  # what the caller saw, not the delta the guardrail held back
    assert result.generate_reason == GenerateReason.MIDDLEWARE_STOP_REQUESTED


class Fallback(MiddlewareBase):
    """The docs' pattern: call next again with another model when the first fails."""

    def __init__(self, backup: ScriptedModel) -> None:
        self.backup = backup

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).catch(lambda exc: next(input.replace(model=self.backup)))


async def test_a_fallback_after_the_first_chunk_closes_the_failed_attempt() -> None:
    primary = ScriptedModel([ModelStep("half an answer", chunks=2, error=ConnectionError("gone"), error_after=1)],
                            name="primary")
    backup = ScriptedModel([ModelStep.text("full answer"), ModelStep.text("more")], name="backup")
    agent = ReActAgent.builder().model(primary).middleware(Fallback(backup)).build()
    events = await agent.stream("hi").to_list()
    assert balance(events) == Counter()
    ends = [e for e in events if e.type == "model_call_end"]
    assert [(e.discarded, e.error) for e in ends] == [(True, "ConnectionError: gone"), (False, None)]
    assert [e.model for e in events if e.type == "model_call_start"] == ["primary", "backup"]
    assert events[-2].result.text == "full answer"
    assert (await agent.call("again")).text  # the session goes on
    assert primary.requests[0].messages[-1].text == "hi"


class Redact(MiddlewareBase):
    def __init__(self, point: ExtensionPoint) -> None:
        self.point = point

    def active_points(self) -> Any:
        return {self.point}

    def _redact(self, e: Any) -> Any:
        return e.model_copy(update={"delta": e.delta.replace("ada@example.com", "[email]")}) \
            if type(e) is TextBlockDelta else e

    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).map(self._redact)

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).map(self._redact)


@pytest.mark.parametrize("point", [P.ON_REASONING, P.ON_MODEL_CALL])
async def test_what_call_returns_is_what_callers_saw(point: ExtensionPoint) -> None:
    model = ScriptedModel([ModelStep.text("write to ada@example.com")])
    agent = ReActAgent.builder().model(model).middleware(Redact(point)).build()
    events = await agent.stream("hi").to_list()
    shown = "".join(e.delta for e in events if type(e) is TextBlockDelta)
    assert shown == "write to [email]"
    assert events[-2].result.text == shown
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None
    remembered = state.context[-1].text
    assert remembered == ("write to [email]" if point is P.ON_MODEL_CALL else "write to ada@example.com")
    msg = await ReActAgent.builder().model(ScriptedModel([ModelStep.text("ada@example.com")])) \
        .middleware(Redact(point)).build().call("hi")
    assert msg.text == "[email]"


@tool
async def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return "slept"


async def test_an_interrupt_mid_stream_closes_every_open_bracket() -> None:
    model = ScriptedModel([ModelStep.text("a b c d e f", chunks=6, delay=0.05)])
    agent = ReActAgent.builder().model(model).build()
    ctx = RuntimeContext(user_id="u", session_id="s")
    events: list[Any] = []
    async for ev in agent.stream("hi", ctx=ctx):
        events.append(ev)
        if type(ev) is TextBlockDelta:
            agent.interrupt(user_id="u", session_id="s")
    assert balance(events) == Counter()
    end = next(e for e in events if e.type == "model_call_end")
    assert end.error is not None and "AgentInterrupted" in end.error and not end.discarded
    assert events[-2].result.generate_reason == GenerateReason.INTERRUPTED


async def test_an_interrupted_tool_result_ends_interrupted() -> None:
    model = ScriptedModel([ModelStep.tool_call("slow", {"seconds": 5}), ModelStep.text("unused")])
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([slow])).build()
    events: list[Any] = []
    async for ev in agent.stream("hi"):
        events.append(ev)
        if ev.type == "tool_result_start":
            asyncio.get_running_loop().call_later(0.05, agent.interrupt)
    assert balance(events) == Counter()
    assert [e.state.value for e in events if e.type == "tool_result_end"] == ["interrupted"]


class Buffer(MiddlewareBase):
    def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        from reactivex import operators as ops

        return next(input).pipe(ops.buffer_with_count(3))


async def test_a_hook_that_emits_lists_gets_an_error_naming_it() -> None:
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("hi")], loop=True)).middleware(Buffer()).build()
    with pytest.raises(MiddlewareError, match=r"Buffer at on_reasoning emitted a list .*not an AgentEvent"):
        await agent.call("hi")
    with pytest.raises(MiddlewareError, match="Buffer at on_reasoning"):
        await agent.stream("hi").to_list()


class NoneDelta(MiddlewareBase):
    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).map(lambda e: e.model_copy(update={"delta": None}) if type(e) is TextBlockDelta else e)


async def test_a_delta_set_to_none_is_a_clear_error_not_a_crash_in_the_builder() -> None:
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("hi")])).middleware(NoneDelta()).build()
    with pytest.raises(MiddlewareError, match=r"text block delta is NoneType .*not str: a middleware at on_model_call"):
        await agent.call("hi")


class Empty(MiddlewareBase):
    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return []


async def test_an_empty_stream_at_a_reasoning_point_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    model = ScriptedModel([])
    agent = ReActAgent.builder().name("quiet").model(model).middleware(Empty()).build()
    with caplog.at_level(logging.WARNING, logger="agentscope_py"):
        msg = await agent.call("hi")
        await agent.call("again")
    assert msg.text == "" and not model.requests
    warnings = [r for r in caplog.records if "empty" in r.getMessage()]
    assert len(warnings) == 1 and "Empty" in warnings[0].getMessage() and "quiet" in warnings[0].getMessage()


class AgentBuffer(MiddlewareBase):
    def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        from reactivex import operators as ops

        return next(input).pipe(ops.buffer_with_count(2))


class AgentCut(MiddlewareBase):
    def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).take_while(lambda e: type(e) is not TextBlockDelta or "stop" not in e.delta)


async def test_on_agent_hooks_must_emit_events_and_their_cuts_are_closed() -> None:
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("hi")])).middleware(AgentBuffer()).build()
    with pytest.raises(MiddlewareError, match="AgentBuffer at on_agent emitted a list"):
        await agent.stream("hi").to_list()
    model = ScriptedModel([ModelStep.text("go on stop here", chunks=3)])
    events = await ReActAgent.builder().model(model).middleware(AgentCut()).build().stream("hi").to_list()
    assert balance(events) == Counter() and types(events)[-2:] == ["text_block_end", "model_call_end"]


async def test_the_demo_redacts_what_callers_see_the_result_and_memory() -> None:
    from agentscope_py.demo import build_demo_agent

    agent = build_demo_agent()
    events = await agent.stream("What is 17 * 23?").to_list()
    shown = "".join(e.delta for e in events if type(e) is TextBlockDelta)
    result = events[-2].result
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None
    for text in (shown, result.text, state.context[-1].text):
        assert "[email]" in text and "demo@example.com" not in text


class StopsAtOnce(MiddlewareBase):
    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return [RequestStop(reason="limit reached")]


async def test_a_round_stopped_on_purpose_is_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    agent = ReActAgent.builder().model(ScriptedModel([])).middleware(StopsAtOnce()).build()
    with caplog.at_level(logging.WARNING, logger="agentscope_py"):
        msg = await agent.call("hi")
    assert msg.generate_reason == GenerateReason.MIDDLEWARE_STOP_REQUESTED
    assert not [r for r in caplog.records if "carried no event" in r.getMessage()]


class _PassModelCall(MiddlewareBase):
    """An on_model_call hook that passes the call through: the loop still reads the call itself."""

    def active_points(self) -> Any:
        return (P.ON_MODEL_CALL,)

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input)


@pytest.mark.parametrize("hooked", [False, True], ids=["no-hook", "passed-through"])
async def test_a_provider_failing_mid_stream_in_a_call_the_loop_reads_closes_each_block_once(hooked: bool) -> None:
    """A model call the loop reads itself closes its own blocks when the provider fails (the loop
    keeps none of its brackets): every Start still gets exactly one End, the call's End names the
    error, and the run ends with it."""
    call = ToolUseBlock(id="c1", name="lookup", input={"q": "x"})
    step = ModelStep("a b c", thinking="hmm", tool_calls=[call], chunks=3, error=ModelError("connection reset"),
                     error_after=4)
    builder = ReActAgent.builder().model(ScriptedModel([step]))
    agent = (builder.middleware(_PassModelCall()) if hooked else builder).build()
    events: list[Any] = []
    with pytest.raises(ModelError, match="connection reset"):
        async for ev in agent.stream("hi"):
            events.append(ev)
    assert balance(events) == Counter()
    starts = Counter(e.type for e in events if e.type.endswith("_start"))
    ends = Counter(e.type.replace("_end", "_start") for e in events if e.type.endswith("_end"))
    assert starts == ends and starts["model_call_start"] == 1 and starts["agent_start"] == 1
    end = next(e for e in events if e.type == "model_call_end")
    assert end.error is not None and "connection reset" in end.error and end.discarded
    assert events[-1].type == "agent_end" and "connection reset" in (events[-1].error or "")
