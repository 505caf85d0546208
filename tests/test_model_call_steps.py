"""The model call read by its consumer (`agent._model_call.ModelEvents`, a stepped prefetch): while
the consumer keeps up, the provider is read in the consumer's task; a consumer away for a loop
turn hands the reads to a task that runs ahead; a deadline or an interrupt lands only inside a
read, is taken back there and raised typed, and marks the call when nobody reads; any other
cancellation stays a cancellation. Every case ends with the model's stream closed and every
block the consumer saw opened also closed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentscope_py import AgentInterrupted, GenerateReason, ReActAgent, RuntimeContext
from agentscope_py.errors import ModelTimeoutError
from agentscope_py.middleware import TimeoutMiddleware
from agentscope_py.model.base import ChatChunk, ModelRequest

pytestmark = pytest.mark.timeout(30)


class Chunks:
    """A model that streams ``n`` text chunks, each after ``gap`` seconds (0: a bare loop turn),
    then, with ``stall``, waits until it is cancelled. It records how far it got and its close."""

    name = "chunks"

    def __init__(self, n: int, gap: float = 0.0, stall: bool = False) -> None:
        self.n, self.gap, self.stall = n, gap, stall
        self.produced = 0
        self.closed = False
        self.cancelled = False
        self.waiting = asyncio.Event()  # set while it waits for the stall's end

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        try:
            for k in range(self.n):
                if k:
                    await asyncio.sleep(self.gap)
                self.produced += 1
                yield ChatChunk(text=f"t{k} ")
            if self.stall:
                self.waiting.set()
                await asyncio.sleep(30)
            yield ChatChunk(finish_reason="stop")
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.closed = True


def open_blocks(events: list[Any]) -> list[str]:
    """The kinds of the blocks a list of events left open (empty: every Start has its End)."""
    opened: list[str] = []
    for e in events:
        kind = e.type.rsplit("_", 1)[0]
        if e.type.endswith("_start") and kind != "agent":
            opened.append(kind)
        elif e.type.endswith("_end") and kind != "agent" and kind in opened:
            opened.remove(kind)
    return opened


def agent_of(model: Any, *middleware: Any) -> ReActAgent:
    return ReActAgent.builder().model(model).middlewares(list(middleware)).build()


async def test_a_consumer_that_keeps_up_gets_every_event_in_order() -> None:
    model = Chunks(20)
    events = await agent_of(model).stream("go").to_list()
    deltas = [e.delta for e in events if e.type == "text_block_delta"]
    assert deltas == [f"t{k} " for k in range(20)]
    assert not open_blocks(events) and model.closed


async def test_the_model_is_read_ahead_only_while_the_consumer_is_away() -> None:
    # Holding an event without awaiting: nothing is read meanwhile (the consumer reads). Away for
    # loop turns: the reads go on in a task of their own, ahead of it; nothing is lost.
    model = Chunks(30)
    seen: list[str] = []
    async with contextlib.aclosing(agent_of(model).stream("go").__aiter__()) as events:
        async for ev in events:
            if ev.type != "text_block_delta":
                continue
            seen.append(ev.delta)
            if len(seen) == 1:
                assert model.produced == 1
            if len(seen) == 2:
                before = model.produced
                for _ in range(10):
                    await asyncio.sleep(0)
                assert model.produced > before + 3  # it ran ahead while this consumer was away
    assert seen == [f"t{k} " for k in range(30)] and model.closed


async def test_a_consumer_that_leaves_between_reads_closes_the_model_stream() -> None:
    model = Chunks(50, stall=True)
    agent = agent_of(model)
    async with contextlib.aclosing(agent.stream("go").__aiter__()) as events:
        async for ev in events:
            if ev.type == "text_block_delta":
                break  # while it holds this event, nobody reads the model
    assert model.closed and model.produced < 50
    assert asyncio.all_tasks() == {asyncio.current_task()}  # nothing left running
    state, _ = await agent.state_store.load("default", "default")
    assert state is not None and state.context[-1].generate_reason is GenerateReason.INTERRUPTED


async def test_cancelling_the_consumer_inside_its_read_is_a_cancellation() -> None:
    model = Chunks(1, stall=True)
    got: list[str] = []

    async def consume() -> None:
        async for ev in agent_of(model).stream("go"):
            got.append(ev.type)

    consumer = asyncio.create_task(consume())
    await asyncio.wait_for(model.waiting.wait(), 5)  # the consumer is inside the read now
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(consumer, 5)
    assert model.cancelled and model.closed
    assert "text_block_delta" in got


async def test_an_interrupt_with_the_consumers_cancellation_stays_a_cancellation() -> None:
    # Both land in the same read: the interrupt's is taken back, the other one goes on.
    model = Chunks(1, stall=True)
    agent = agent_of(model)
    consumer = asyncio.create_task(agent.call("go"))
    await asyncio.wait_for(model.waiting.wait(), 5)
    consumer.cancel()
    assert agent.interrupt()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(consumer, 5)
    assert model.closed


async def test_an_interrupt_inside_the_read_is_taken_back_and_raised_typed() -> None:
    model = Chunks(1, stall=True)
    agent = agent_of(model)
    caller = asyncio.create_task(agent.call("go"))
    await asyncio.wait_for(model.waiting.wait(), 5)
    assert agent.interrupt()
    msg = await asyncio.wait_for(caller, 5)
    assert msg.generate_reason is GenerateReason.INTERRUPTED and msg.text == "t0 "
    assert model.cancelled and model.closed
    assert caller.cancelling() == 0  # the run's task carries no cancellation


async def test_an_interrupt_while_the_consumer_holds_an_event_ends_the_call_at_its_next_read() -> None:
    # Called from the consumer's own task, between reads: nothing is cancelled; the call is
    # marked, and its next read ends it (closing the block, then AgentInterrupted).
    model = Chunks(50, stall=True)
    agent = agent_of(model)
    events: list[Any] = []
    async for ev in agent.stream("go"):
        events.append(ev)
        if ev.type == "text_block_delta" and len(events) < 10:
            assert agent.interrupt()
    types = [e.type for e in events]
    assert types.count("text_block_delta") == 1
    assert types.index("text_block_end") > types.index("text_block_delta")
    end = next(e for e in events if e.type == "model_call_end")
    assert end.error is not None and "AgentInterrupted" in end.error and end.discarded is False
    assert events[-2].result.generate_reason is GenerateReason.INTERRUPTED
    assert not open_blocks(events) and model.closed and model.produced == 1


async def test_a_deadline_inside_the_read_fails_the_call_and_leaves_the_consumer_uncancelled() -> None:
    model = Chunks(1, stall=True)
    agent = agent_of(model, TimeoutMiddleware(model_timeout=0.2))
    events: list[Any] = []

    async def consume() -> None:
        async for ev in agent.stream("go"):
            events.append(ev)

    consumer = asyncio.create_task(consume())
    with pytest.raises(ModelTimeoutError, match=r"did not finish within 0\.2 s"):
        await asyncio.wait_for(consumer, 5)
    assert consumer.cancelling() == 0
    assert not open_blocks(events) and model.cancelled and model.closed
    await asyncio.sleep(0)  # this task can still await: it was not left cancelled


async def test_a_deadline_passing_while_nobody_reads_fails_the_call_at_the_next_read() -> None:
    # The consumer blocks the loop with an event in hand, past the deadline: the deadline passes
    # while nobody reads (only marked), and the call fails at its next read, closing its block.
    model = Chunks(5, gap=0.01)
    agent = agent_of(model, TimeoutMiddleware(model_timeout=0.1))
    events: list[Any] = []
    with pytest.raises(ModelTimeoutError, match=r"did not finish within 0\.1 s"):
        async for ev in agent.stream("go"):
            events.append(ev)
            if ev.type == "text_block_delta" and len(events) < 6:
                time.sleep(0.2)  # noqa: ASYNC251 - blocking on purpose: no loop turn until it is over
    assert [e.delta for e in events if e.type == "text_block_delta"] == ["t0 "]
    end = next(e for e in events if e.type == "model_call_end")
    assert end.error is not None and "ModelTimeoutError" in end.error
    assert not open_blocks(events) and model.closed


async def test_a_call_read_ahead_that_ends_in_time_never_fails_for_a_slow_consumer() -> None:
    # Handed to a task while the consumer sleeps, the call ends in time; the consumer, slower
    # than the deadline, still gets all of it.
    model = Chunks(4)
    agent = agent_of(model, TimeoutMiddleware(model_timeout=0.1))
    deltas: list[str] = []
    async for ev in agent.stream("go"):
        if ev.type == "text_block_delta":
            deltas.append(ev.delta)
            await asyncio.sleep(0.06)
    assert deltas == ["t0 ", "t1 ", "t2 ", "t3 "]


async def test_two_consumers_on_one_loop_each_get_their_own_call() -> None:
    # Many model calls on one loop share the end-of-turn check: each keeps its order and its
    # own reads, the slow one handed to a task, the fast one read inline.
    fast, slow = Chunks(30), Chunks(30)
    agent = ReActAgent.builder().model(fast).build()
    other = ReActAgent.builder().model(slow).build()

    async def deltas(a: ReActAgent, sid: str, pause: bool) -> list[str]:
        out: list[str] = []
        async for ev in a.stream("go", ctx=RuntimeContext(session_id=sid)):
            if ev.type == "text_block_delta":
                out.append(ev.delta)
                if pause:
                    await asyncio.sleep(0.001)
        return out

    a, b = await asyncio.gather(deltas(agent, "a", False), deltas(other, "b", True))
    assert a == b == [f"t{k} " for k in range(30)]
    assert fast.closed and slow.closed


async def test_an_interrupt_of_a_run_read_by_its_consumer_raises_in_the_run_not_as_a_cancellation() -> None:
    # The interrupt lands in the consumer's read; middleware written with `except Exception` sees
    # AgentInterrupted pass, not a cancellation.
    model = Chunks(1, stall=True)
    agent = agent_of(model)
    events: list[Any] = []

    async def consume() -> None:
        async for ev in agent.stream("go"):
            events.append(ev)

    consumer = asyncio.create_task(consume())
    await asyncio.wait_for(model.waiting.wait(), 5)
    agent.interrupt()
    await asyncio.wait_for(consumer, 5)  # ends normally: the run ended as interrupted
    assert events[-2].result.generate_reason is GenerateReason.INTERRUPTED
    assert not open_blocks(events)
    assert issubclass(AgentInterrupted, Exception)
