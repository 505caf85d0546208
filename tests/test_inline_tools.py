"""A lone call to a tool that returns once runs inline in the run's task (no task of its own), in
its own context copy, only while the stream is awaited: it starts when the event after
ToolResultStart is asked for, an interrupt cancels it without disturbing the consumer, and it
times out like any other call."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import pytest

from agentscope_py import (
    GenerateReason,
    MiddlewareBase,
    ModelStep,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    ToolResultState,
    tool,
)
from agentscope_py.events import ToolResultEnd, ToolResultTextDelta

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="consumer")


def agent_with(fn: Any, *steps: ModelStep, middleware: MiddlewareBase | None = None) -> ReActAgent:
    builder = ReActAgent.builder().model(ScriptedModel(list(steps))).tools(fn)
    if middleware is not None:
        builder = builder.middleware(middleware)
    return builder.build()


async def tool_results(agent: ReActAgent, ctx: RuntimeContext | None = None) -> list[Any]:
    state, _ = await agent.state_store.load(ctx.user_id if ctx else "default", ctx.session_id if ctx else "default")
    assert state is not None
    return [b for m in state.context for b in m.tool_results]


async def test_the_tool_starts_when_the_event_after_its_start_is_asked_for() -> None:
    started: list[bool] = []

    @tool
    async def probe() -> str:
        """Records that it started."""
        started.append(True)
        await asyncio.sleep(0.01)
        return "done"

    agent = agent_with(probe, ModelStep.tool_call("probe", {}), ModelStep.text("ok"))
    seen_at_start: list[bool] = []
    async for ev in agent.stream("go"):
        if ev.type == "tool_result_start":
            seen_at_start.append(bool(started))
    assert seen_at_start == [False] and started == [True]


@pytest.mark.parametrize("awaits", [False, True])
async def test_a_tool_that_interrupts_its_own_run_finishes_and_ends_it_without_a_stray_cancellation(
    awaits: bool,
) -> None:
    holder: dict[str, ReActAgent] = {}

    @tool
    async def stop_everything() -> str:
        """Interrupts the run that called it."""
        holder["agent"].interrupt()
        if awaits:
            await asyncio.sleep(0.01)
        return "stopped"

    agent = holder["agent"] = agent_with(stop_everything, ModelStep.tool_call("stop_everything", {}),
                                         ModelStep.text("unused"))
    task = asyncio.create_task(agent.call("go"))
    msg = await asyncio.wait_for(task, 2)
    assert msg.generate_reason is GenerateReason.INTERRUPTED
    assert task.cancelling() == 0
    results = await tool_results(agent)
    assert [(r.state, r.text) for r in results] == [(ToolResultState.SUCCESS, "stopped")]


async def test_interrupt_while_the_consumer_holds_the_start_event_spares_the_consumer() -> None:
    ran: list[bool] = []

    @tool
    async def slow() -> str:
        """Takes long."""
        ran.append(True)
        await asyncio.sleep(30)
        return "never"

    agent = agent_with(slow, ModelStep.tool_call("slow", {}), ModelStep.text("unused"))
    kinds: list[str] = []
    async for ev in agent.stream("go"):
        kinds.append(ev.type)
        if ev.type == "tool_result_start":
            agent.interrupt()
            await asyncio.sleep(0.01)  # the consumer's own await is not cancelled
    assert ran == []  # interrupted before it started: it never runs
    assert kinds[-2:] == ["agent_result", "agent_end"]
    results = await tool_results(agent)
    assert [r.state for r in results] == [ToolResultState.INTERRUPTED]


async def test_a_timeout_inside_the_tool_never_cancels_the_consumer_while_it_holds_an_event() -> None:
    """The tool runs only while the stream is awaited, so a timeout it sets (``asyncio.timeout``
    cancels the current task) fires inside the tool, not in the consumer's own code."""

    @tool
    async def bounded() -> str:
        """Waits under its own deadline."""
        try:
            async with asyncio.timeout(0.05):
                await asyncio.sleep(5)
        except TimeoutError:
            return "gave up in time"
        return "never"

    agent = agent_with(bounded, ModelStep.tool_call("bounded", {}), ModelStep.text("fine"))
    texts: list[str] = []
    async for ev in agent.stream("go"):
        if type(ev) is ToolResultTextDelta:
            texts.append(ev.delta)
        await asyncio.sleep(0.1)  # a slow consumer: each event takes it longer than the tool's deadline
    assert texts == ["gave up in time"]
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_interrupt_cancels_the_tool_not_the_caller() -> None:
    started = asyncio.Event()

    @tool
    async def slow() -> str:
        """Takes long."""
        started.set()
        await asyncio.sleep(30)
        return "never"

    agent = agent_with(slow, ModelStep.tool_call("slow", {}), ModelStep.text("after"))
    task = asyncio.create_task(agent.call("go"))
    await asyncio.wait_for(started.wait(), 1)
    agent.interrupt()
    msg = await asyncio.wait_for(task, 1)
    assert msg.generate_reason is GenerateReason.INTERRUPTED
    assert task.cancelling() == 0
    assert (await agent.call("again")).text == "after"


async def test_the_tool_runs_in_its_own_context_copy() -> None:
    class SetsVar(MiddlewareBase):
        def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            VAR.set("acting-mw")
            return next(input)

    seen: list[str] = []

    @tool
    async def reader() -> str:
        """Reads and sets the variable."""
        seen.append(VAR.get())
        VAR.set("tool")
        await asyncio.sleep(0)
        seen.append(VAR.get())
        return "ok"

    agent = agent_with(reader, ModelStep.tool_call("reader", {}), ModelStep.text("done"), middleware=SetsVar())
    consumer_saw = set()
    async for _ in agent.stream("go"):
        consumer_saw.add(VAR.get())
    assert seen == ["acting-mw", "tool"]
    assert consumer_saw == {"consumer"}


async def test_timeouts_and_a_tools_own_timeout_error_become_error_results() -> None:
    @tool(timeout=0.05)
    async def sleepy() -> str:
        """Too slow."""
        await asyncio.sleep(5)
        return "late"

    @tool
    async def raises_timeout() -> str:
        """Its own TimeoutError."""
        raise TimeoutError("upstream took too long")

    for fn, expected in ((sleepy, "Error: sleepy timed out after 0.05 s."),
                         (raises_timeout, "Error: TimeoutError: upstream took too long")):
        agent = agent_with(fn, ModelStep.tool_call(fn.name, {}), ModelStep.text("fine"))
        events = [ev async for ev in agent.stream("go")]
        texts = [e.delta for e in events if type(e) is ToolResultTextDelta]
        ends = [e.state for e in events if type(e) is ToolResultEnd]
        assert (texts, ends) == ([expected], [ToolResultState.ERROR])
        assert events[-2].result.text == "fine"


async def test_closing_the_stream_at_the_start_event_never_runs_the_tool() -> None:
    ran: list[bool] = []

    @tool
    async def slow() -> str:
        """Takes long."""
        ran.append(True)
        await asyncio.sleep(30)
        return "never"

    agent = agent_with(slow, ModelStep.tool_call("slow", {}), ModelStep.text("unused"))
    stream = agent.stream("go").__aiter__()
    async for ev in stream:
        if ev.type == "tool_result_start":
            break
    await stream.aclose()  # type: ignore[attr-defined]
    assert ran == []
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    assert [r.state for r in await tool_results(agent)] == [ToolResultState.INTERRUPTED]
