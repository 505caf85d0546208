"""The agents of test_durable_usage.py: a model whose connection drops after it reported its
usage (``DropsAfterUsage``: the first ``drops`` calls fail so, the next ones answer), and a
finish hook noting each run's totals in ``RUNS`` (this module is passed through the workflow
sandbox, so a worker in the test's process shares the list with the test)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from agentscope_py import ChatUsage, MiddlewareBase, ReActAgent
from agentscope_py.middleware import HedgeMiddleware
from agentscope_py.model.base import ChatChunk, ModelError, ModelRequest, ToolCallChunk

BILLED = ChatUsage(input_tokens=10, output_tokens=1)
RUNS: list[Any] = []


class DropsAfterUsage:
    name = "drops"
    provider = "drops"

    def __init__(self, drops: int, retryable: bool) -> None:
        self.drops, self.retryable, self.calls = drops, retryable, 0

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self.calls += 1
        yield ChatChunk(text="done")
        yield ChatChunk(usage=BILLED, finish_reason="stop")
        if self.calls <= self.drops:
            raise ModelError("the connection dropped", retryable=self.retryable)


class Finished(MiddlewareBase):
    async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
        RUNS.append(run)


def build_retried() -> ReActAgent:
    """The first call drops (retryable): Temporal runs the activity again, which answers."""
    return ReActAgent.builder().model(DropsAfterUsage(1, True)).middlewares([Finished()]).build()


def build_failing() -> ReActAgent:
    """Every call drops, and says trying again cannot help: the run fails."""
    return ReActAgent.builder().model(DropsAfterUsage(10**6, False)).middlewares([Finished()]).build()


class SlowFirstAttempt:
    """The first call reads its usage, then hangs (a hedge's backup wins, and the first is
    cancelled on its worker); the next ones call ``add``, then answer."""

    name = "slow-first"
    provider = "slow-first"

    def __init__(self) -> None:
        self.calls = 0

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self.calls += 1
        if self.calls == 1:
            yield ChatChunk(usage=BILLED)  # billed: the provider reported it
            await asyncio.sleep(30)
        if not any(m.role == "tool" for m in request.messages):
            yield ChatChunk(tool_call=ToolCallChunk(index=0, id="c1", name="add", arguments='{"a": 1, "b": 2}'))
            yield ChatChunk(usage=BILLED, finish_reason="tool_calls")
        else:
            yield ChatChunk(text="3")
            yield ChatChunk(usage=BILLED, finish_reason="stop")


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def build_hedged() -> ReActAgent:
    """A hedge whose backup wins the first call: its cancelled first attempt read its usage."""
    return (ReActAgent.builder().model(SlowFirstAttempt()).tools(add)
            .middlewares([Finished(), HedgeMiddleware(None, after=0.3)]).build())
