"""`RuntimeContext.wait` at its edges. In a run that was interrupted already, what it was given
to await gets a cancellation, as it does when the interrupt comes during the wait: a coroutine is
closed; a future or a task (a guardrail's checks gathered, a background check being settled) is
cancelled, so nothing the run started goes on running after the run ended. An interrupt that
comes as a bound on the wait passes (the concurrency limit's ``max_wait``) ends the run
interrupted, not with the bound's error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentscope_py import GenerateReason, ModelStep, ReActAgent, RuntimeContext, ScriptedModel, Toolkit, tool
from agentscope_py._control import RunControl
from agentscope_py.errors import AgentInterrupted
from agentscope_py.middleware import ConcurrencyLimitMiddleware, GuardrailMiddleware
from agentscope_py.model.base import ChatChunk, ModelRequest

pytestmark = pytest.mark.timeout(30)

LONG = 10.0


def interrupted_ctx() -> RuntimeContext:
    c = RuntimeContext()
    c.begin_run("reply_1", RunControl())
    assert c.control is not None
    c.control.interrupt()
    return c


async def test_ctx_wait_interrupted_already_cancels_a_task_it_was_given() -> None:
    c = interrupted_ctx()
    task = asyncio.create_task(asyncio.sleep(LONG))
    with pytest.raises(AgentInterrupted):
        await c.wait(task)
    await asyncio.sleep(0)
    assert task.cancelled()


async def test_ctx_wait_interrupted_already_cancels_a_future_it_was_given() -> None:
    c = interrupted_ctx()
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(AgentInterrupted):
        await c.wait(fut)
    assert fut.cancelled()


async def test_a_guardrail_check_started_after_a_tool_interrupted_its_run_does_not_outlive_the_run() -> None:
    # A tool interrupts its own run (its task is not cancelled: it finishes, and the flag stops the
    # run after it); the guardrail's output check of the tool's result starts after that, in a run
    # that is interrupted already. The check must not go on running once the run has ended.
    running: list[str] = []

    async def check(c: Any) -> None:
        if c.kind != "tool_result":
            return
        running.append("started")
        try:
            await asyncio.sleep(LONG)
        finally:
            running.remove("started")

    @tool
    async def stop(ctx: RuntimeContext) -> str:
        """Stop the run."""
        assert ctx.control is not None
        ctx.control.interrupt()
        return "stopping"

    model = ScriptedModel([ModelStep.tool_call("stop", {}), ModelStep.text("never")])
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([stop])).middlewares(
        [GuardrailMiddleware(output=check, covers=("text", "thinking", "tool_arguments", "tool_result"))]).build()
    reply = await asyncio.wait_for(agent.call("go", ctx=RuntimeContext("u", "s")), 5)
    assert reply.generate_reason is GenerateReason.INTERRUPTED
    for _ in range(5):
        await asyncio.sleep(0.02)
    assert running == [], "the guardrail's check runs on after its run ended"


class Stalling:
    """Sends nothing until cancelled; ``started`` is set when a call begins."""

    name = "stalling"

    def __init__(self) -> None:
        self.started = asyncio.Event()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self.started.set()
        await asyncio.sleep(LONG)
        yield ChatChunk(text="late")


async def test_an_interrupt_before_the_slots_max_wait_passed_ends_the_run_interrupted() -> None:
    # The interrupt is due before the wait's max_wait, but the loop is late (blocked) and runs
    # both at once: the interrupt came first, so the run ends interrupted, not with the limit's
    # error (which would fail the run as if nobody had interrupted it).
    limit = ConcurrencyLimitMiddleware(1, max_wait=1.0)
    holder_model = Stalling()
    holder = ReActAgent.builder().model(holder_model).middlewares([limit]).build()
    waiter_model = ScriptedModel([ModelStep.text("never")])
    agent = ReActAgent.builder().model(waiter_model).middlewares([limit]).build()
    holding = asyncio.create_task(holder.call("hold", ctx=RuntimeContext("u", "other")))
    await asyncio.wait_for(holder_model.started.wait(), 5)
    caller = asyncio.create_task(agent.call("go", ctx=RuntimeContext("u", "s")))
    while limit.waiting() == 0:
        await asyncio.sleep(0.005)
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, agent.interrupt, "u", "s")
    loop.call_soon(time.sleep, 1.2)  # (the loop is blocked past both the interrupt's time and the max_wait)
    reply = await asyncio.wait_for(caller, 5)
    assert reply.generate_reason is GenerateReason.INTERRUPTED
    assert waiter_model.requests == [] and limit.waiting() == 0 and limit.in_flight() == 1
    assert agent.busy_error("u", "s", "reject") is None
    assert holder.interrupt("u", "other")
    assert (await asyncio.wait_for(holding, 2)).generate_reason is GenerateReason.INTERRUPTED
    assert limit.in_flight() == 0
