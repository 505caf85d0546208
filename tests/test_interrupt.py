"""An interrupt cancels the run's child tasks (the model request, the tools) and then surfaces in
the run's own task as `AgentInterrupted`, an ordinary exception: middleware sees it pass like any
error, the run's task is never cancelled, and ``call`` returns the INTERRUPTED reply."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from agentscope_py import AgentInterrupted, GenerateReason, MiddlewareBase, ReActAgent
from agentscope_py.model.base import ChatChunk, ModelRequest


class Stalling:
    """A model that streams one chunk, then waits until it is cancelled."""

    name = "stalling"

    def __init__(self) -> None:
        self.streaming = asyncio.Event()
        self.cancelled = False
        self.closed = False

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        try:
            yield ChatChunk(text="partial ")
            self.streaming.set()
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.closed = True


class SeesErrors(MiddlewareBase):
    """Records what passes through on_model_call, as middleware written with ``except Exception``."""

    def __init__(self, model: Stalling) -> None:
        self.model = model
        self.seen: list[tuple[str, bool]] = []

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        async def gen() -> AsyncIterator[Any]:
            try:
                async for ev in next(input):
                    yield ev
            except Exception as exc:  # an interrupt is an ordinary exception
                self.seen.append((type(exc).__name__, self.model.closed))
                raise

        return gen()


async def test_an_interrupt_cancels_the_model_request_then_raises_an_ordinary_exception_in_the_run() -> None:
    model = Stalling()
    mw = SeesErrors(model)
    agent = ReActAgent.builder().model(model).middleware(mw).build()  # type: ignore[arg-type]
    caller = asyncio.create_task(agent.call("go"))
    await asyncio.wait_for(model.streaming.wait(), 2)
    assert agent.interrupt()
    msg = await asyncio.wait_for(caller, 2)
    assert msg.generate_reason is GenerateReason.INTERRUPTED and msg.text == "partial "
    assert model.cancelled and model.closed
    # The middleware saw AgentInterrupted through `except Exception`, after the request was closed.
    assert mw.seen == [("AgentInterrupted", True)]
    assert caller.cancelling() == 0
    assert issubclass(AgentInterrupted, Exception)


async def cancel_and_wait(caller: asyncio.Task[Any]) -> None:
    """Cancel ``caller`` and wait for it: the cancellation must reach it, not be swallowed."""
    caller.cancel()
    try:
        await asyncio.wait_for(caller, 2)
    except asyncio.CancelledError:
        return
    raise AssertionError("the caller's cancellation was swallowed")


async def test_cancelling_the_caller_is_still_a_cancellation() -> None:
    model = Stalling()
    mw = SeesErrors(model)
    agent = ReActAgent.builder().model(model).middleware(mw).build()  # type: ignore[arg-type]
    caller = asyncio.create_task(agent.call("go"))
    await asyncio.wait_for(model.streaming.wait(), 2)
    await cancel_and_wait(caller)
    assert model.closed and mw.seen == []  # a cancellation is no error middleware handles
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and state.context[-1].generate_reason is GenerateReason.INTERRUPTED


async def test_no_retry_and_no_fallback_acts_on_an_interrupt() -> None:
    from agentscope_py import ModelStep, ScriptedModel
    from agentscope_py.middleware import ModelFallbackMiddleware, RetryMiddleware

    model = Stalling()
    backup = ScriptedModel([ModelStep.text("from the backup")])
    acted: list[str] = []
    retry = RetryMiddleware(max_retries=3, retry_on=Exception, initial_delay=0.01, after_first_event=True,
                            on_retry=lambda *a: acted.append("retry"))
    fallback = ModelFallbackMiddleware(backup, after_first_event=True, on_failover=lambda *a: acted.append("failover"))
    agent = ReActAgent.builder().model(model).middleware(retry).middleware(fallback).build()  # type: ignore[arg-type]
    caller = asyncio.create_task(agent.call("go"))
    await asyncio.wait_for(model.streaming.wait(), 2)
    agent.interrupt()
    msg = await asyncio.wait_for(caller, 2)
    assert msg.generate_reason is GenerateReason.INTERRUPTED
    assert acted == [] and backup.requests == []  # nothing was retried, no other model tried


class PassesThrough(MiddlewareBase):
    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input)


async def test_a_call_whose_model_call_nobody_reads_is_interrupted_and_cancelled_the_same() -> None:
    # No hook reads the model call (none, or one passing it through): the reply goes to the loop
    # with no event made, and an interrupt or a cancellation keeps what it had as the turn's end.
    for middlewares in ([], [PassesThrough()]):
        model = Stalling()
        agent = ReActAgent.builder().model(model).middlewares(middlewares).build()  # type: ignore[arg-type]
        caller = asyncio.create_task(agent.call("go"))
        await asyncio.wait_for(model.streaming.wait(), 2)
        assert agent.interrupt()
        msg = await asyncio.wait_for(caller, 2)
        assert msg.generate_reason is GenerateReason.INTERRUPTED and msg.text == "partial "
        assert model.cancelled and model.closed and caller.cancelling() == 0

        model = Stalling()
        agent = ReActAgent.builder().model(model).middlewares(middlewares).build()  # type: ignore[arg-type]
        caller = asyncio.create_task(agent.call("go"))
        await asyncio.wait_for(model.streaming.wait(), 2)
        await cancel_and_wait(caller)
        state, _ = await agent.state_store.load("default", "default")
        assert model.closed and state is not None
        assert state.context[-1].generate_reason is GenerateReason.INTERRUPTED
        assert state.context[-1].text == "partial "
