"""Closing an agent's stream early closes everything inside it at once (so middleware finalisers,
spans and the model request end before ``aclose()`` returns, innermost first)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from agentscope_py import MiddlewareBase, ModelStep, ReActAgent, ScriptedModel, tool


class Finalisers(MiddlewareBase):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).finally_(lambda: self.log.append("agent"))

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).finally_(lambda: self.log.append("model_call"))

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).finally_(lambda: self.log.append("acting"))


async def test_closing_mid_model_call_closes_the_model_stream_before_aclose_returns() -> None:
    log: list[str] = []
    model = ScriptedModel([ModelStep.text("a long answer", chunks=6, delay=0.01)])
    agent = ReActAgent.builder().model(model).middleware(Finalisers(log)).build()
    async with contextlib.aclosing(agent.stream("hi").__aiter__()) as it:  # type: ignore[type-var]
        async for event in it:
            if event.type == "text_block_delta":
                break
    assert model.closed_streams == 1
    assert log == ["model_call", "agent"]


async def test_closing_mid_tool_call_cancels_the_tool_before_aclose_returns() -> None:
    log: list[str] = []
    started, cancelled = asyncio.Event(), asyncio.Event()

    @tool
    async def slow() -> AsyncIterator[str]:
        """Takes a while (a generator tool: it runs in a task of its own, which starts after its
        ToolResultStart is out)."""
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        yield "never"

    model = ScriptedModel([ModelStep.tool_call("slow", {}), ModelStep.text("unused")])
    agent = ReActAgent.builder().model(model).tools(slow).middleware(Finalisers(log)).build()
    async with contextlib.aclosing(agent.stream("hi").__aiter__()) as it:  # type: ignore[type-var]
        async for event in it:
            if event.type == "tool_result_start":
                await asyncio.wait_for(started.wait(), 5)  # the tool runs while this event is held
                break
    assert log == ["model_call", "acting", "agent"]
    assert cancelled.is_set()
