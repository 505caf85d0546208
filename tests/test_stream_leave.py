"""A consumer that breaks out of an agent's stream and closes it (`contextlib.aclosing(stream)`,
``await stream.aclose()``) finds the run closed when that returns: its finish hooks run, its turn
saved, even when closing takes longer than a few loop ticks (a store across a thread, an MCP
session). The break drops the iterator, so its close runs in asyncio's finaliser task: the
stream's aclose waits for the run's end (tests/mcp/test_mcp_cuts.py found a turn read half saved)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from agentscope_py import GenerateReason, MiddlewareBase, ModelStep, ReActAgent, RuntimeContext, ScriptedModel


class SlowFinish(MiddlewareBase):
    """A finish hook that takes a while (a store, a flush)."""

    def __init__(self) -> None:
        self.done = False

    async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
        await asyncio.sleep(0.02)
        self.done = True


def slow_agent() -> tuple[ReActAgent, SlowFinish]:
    hook = SlowFinish()
    steps = [ModelStep.text("a b c d", chunks=4) for _ in range(3)]
    return ReActAgent.builder().model(ScriptedModel(steps)).middleware(hook).build(), hook


async def test_aclosing_a_stream_broken_out_of_waits_for_the_run_to_close() -> None:
    agent, hook = slow_agent()
    stream = agent.stream("go", ctx=RuntimeContext(session_id="s"))
    async with contextlib.aclosing(stream):
        async for ev in stream:
            if ev.type == "text_block_delta":
                break
    assert hook.done
    state, _ = await agent.state_store.load("default", "s")
    assert state is not None and state.context[-1].generate_reason is GenerateReason.INTERRUPTED


async def test_a_stream_closed_after_a_return_waits_too() -> None:
    agent, hook = slow_agent()
    stream = agent.stream("go")

    async def consume() -> None:
        try:
            async for ev in stream:
                if ev.type == "text_block_delta":
                    return
        finally:
            await stream.aclose()

    await consume()
    assert hook.done


async def test_closing_a_stream_whose_run_never_took_its_turn_returns_at_once() -> None:
    agent, hook = slow_agent()
    stream = agent.stream("go")
    await asyncio.wait_for(stream.aclose(), 1)  # never iterated
    async with contextlib.aclosing(stream):
        async for _ in stream:
            break  # at the AgentStart, before the run takes the session's turn
    assert not hook.done
    assert (await asyncio.wait_for(agent.call("again"), 5)).text == "a b c d"
