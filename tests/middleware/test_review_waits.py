"""`RuntimeContext.wait` in a run that was interrupted already: what it was given to await gets a
cancellation, as it does when the interrupt comes during the wait. A coroutine is closed; a
future or a task (a guardrail's checks gathered, a background check being settled) is
cancelled, so nothing the run started goes on running after the run ended."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentscope_py import GenerateReason, ModelStep, ReActAgent, RuntimeContext, ScriptedModel, Toolkit, tool
from agentscope_py._control import RunControl
from agentscope_py.errors import AgentInterrupted
from agentscope_py.middleware import GuardrailMiddleware

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
