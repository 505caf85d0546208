"""The model call as its consumer sees it, at the edges of its reads (`_model_call`): a
consumer that keeps up, one away for loop turns (nothing is read meanwhile), one that leaves
between reads; a cancellation, an interrupt or a deadline landing while the model call waits for its
provider, or while the consumer holds an event (or blocks the loop) and nobody waits; an
interrupt together with the consumer's own cancellation. Each ends with the model's stream
closed, every block the consumer saw opened also closed, the typed error (or the cancellation)
where it belongs, and the consumer's task carrying no cancellation it did not ask for."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from agentscope_py import AgentInterrupted, GenerateReason, ReActAgent, RuntimeContext
from agentscope_py._model_call import FAIR_TURN
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


async def test_the_model_is_read_only_when_the_consumer_asks() -> None:
    # Away for loop turns: the call reads nothing meanwhile (the model is read in the consumer's
    # task, when it asks for the next event); nothing is lost or reordered.
    model = Chunks(30)
    seen: list[str] = []
    async with contextlib.aclosing(agent_of(model).stream("go").__aiter__()) as events:  # type: ignore[type-var]
        async for ev in events:
            if ev.type != "text_block_delta":
                continue
            seen.append(ev.delta)
            if len(seen) == 2:
                before = model.produced
                for _ in range(10):
                    await asyncio.sleep(0)
                assert model.produced == before
    assert seen == [f"t{k} " for k in range(30)] and model.closed


async def test_a_consumer_that_leaves_between_reads_closes_the_model_stream() -> None:
    model = Chunks(50, stall=True)
    agent = agent_of(model)
    async with contextlib.aclosing(agent.stream("go").__aiter__()) as events:  # type: ignore[type-var]
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
    await asyncio.wait_for(model.waiting.wait(), 5)  # the call waits for its provider now
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(consumer, 5)
    assert model.cancelled and model.closed
    assert "text_block_delta" in got


async def test_an_interrupt_with_the_consumers_cancellation_stays_a_cancellation() -> None:
    # Both while the call waits for its provider: the run's task stays cancelled.
    model = Chunks(1, stall=True)
    agent = agent_of(model)
    consumer = asyncio.create_task(agent.call("go"))
    await asyncio.wait_for(model.waiting.wait(), 5)
    consumer.cancel()
    assert agent.interrupt()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(consumer, 5)
    assert model.closed


async def test_an_interrupt_while_the_consumer_holds_an_event_ends_the_call_before_more_text() -> None:
    # Called from the consumer's own task while it holds an event: the call ends (closing its
    # block, then AgentInterrupted) before any more text reaches the consumer.
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


async def test_a_deadline_while_the_call_waits_fails_it_and_leaves_the_consumer_uncancelled() -> None:
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


async def test_a_deadline_passing_while_the_consumer_blocks_the_loop_fails_the_call() -> None:
    # The consumer blocks the loop with an event in hand, past the deadline: the call fails once
    # the loop runs again, closing its block, and no later text reaches the consumer.
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


async def test_a_deadline_passing_while_the_consumer_awaits_elsewhere_cuts_only_the_next_read() -> None:
    # The deadline passes while the consumer, an event in hand, awaits something of its own: that
    # await is not cut (nothing is cancelled outside a read), and the call fails at its next read,
    # closing its block, before any more text.
    model = Chunks(4)
    agent = agent_of(model, TimeoutMiddleware(model_timeout=0.1))
    events: list[Any] = []
    slept = 0
    with pytest.raises(ModelTimeoutError, match=r"did not finish within 0\.1 s"):
        async for ev in agent.stream("go"):
            events.append(ev)
            if ev.type == "text_block_delta":
                await asyncio.sleep(0.15)
                slept += 1
    task = asyncio.current_task()
    assert slept == 1 and task is not None and task.cancelling() == 0
    assert [e.delta for e in events if e.type == "text_block_delta"] == ["t0 "]
    end = next(e for e in events if e.type == "model_call_end")
    assert end.error is not None and "ModelTimeoutError" in end.error
    assert not open_blocks(events) and model.closed and model.produced == 1


async def test_two_consumers_on_one_loop_each_get_their_own_call() -> None:
    # A fast and a slow consumer on one loop: each call keeps its order and its own reads.
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
    # The run ends as interrupted: its consumer's iteration ends normally, not cancelled.
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
    assert consumer.cancelling() == 0  # the read's cut was taken back
    assert events[-2].result.generate_reason is GenerateReason.INTERRUPTED
    assert not open_blocks(events)
    assert issubclass(AgentInterrupted, Exception)


@pytest.mark.skipif(not hasattr(asyncio, "eager_task_factory"),
                    reason="a task started inside another's step (eager tasks) exists from Python 3.12")
async def test_an_interrupt_cuts_the_read_of_an_eager_task_started_inside_the_reading_tasks_step() -> None:
    # The consumer reads the first text in its own task, then hands the iteration to a task it
    # starts eagerly: that task's first step takes the next read while the consumer's own
    # coroutine is running too. The interrupt cuts the task that waits in the read, and no other.
    model = Chunks(1, stall=True)
    agent = agent_of(model)
    events: list[Any] = []
    it = aiter(agent.stream("go"))
    while not events or events[-1].type != "text_block_delta":
        events.append(await anext(it))

    async def rest() -> None:
        async for ev in it:
            events.append(ev)

    eager_task_factory: Any = getattr(asyncio, "eager_task_factory")  # noqa: B009 (3.12+; mypy checks 3.11)
    reader = eager_task_factory(asyncio.get_running_loop(), rest())
    await asyncio.wait_for(model.waiting.wait(), 5)
    assert agent.interrupt()
    await asyncio.wait_for(reader, 5)
    this = asyncio.current_task()
    assert this is not None and this.cancelling() == 0 and reader.cancelling() == 0
    assert events[-2].result.generate_reason is GenerateReason.INTERRUPTED
    assert not open_blocks(events)


class Swallows(Chunks):
    """A model that, cut inside its read, swallows the cancellation and sends another chunk."""

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        try:
            yield ChatChunk(text="t0 ")
            self.waiting.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled = True
            yield ChatChunk(text="late ")
            yield ChatChunk(finish_reason="stop")
        finally:
            self.closed = True


async def test_an_interrupt_whose_cancellation_the_provider_swallows_still_ends_the_call() -> None:
    # The cut's cancellation is taken back even when the provider swallowed it: the call ends
    # interrupted after the chunk it got, and the consumer's task carries no cancellation.
    model = Swallows(1)
    agent = agent_of(model)
    events: list[Any] = []

    async def consume() -> None:
        async for ev in agent.stream("go"):
            events.append(ev)
        await asyncio.sleep(0)  # would raise if a cancellation were left on this task

    consumer = asyncio.create_task(consume())
    await asyncio.wait_for(model.waiting.wait(), 5)
    assert agent.interrupt()
    await asyncio.wait_for(consumer, 5)
    assert consumer.cancelling() == 0 and model.cancelled and model.closed
    assert events[-2].result.generate_reason is GenerateReason.INTERRUPTED
    assert not open_blocks(events)


async def test_an_interrupt_cuts_the_retrys_wait_before_the_first_chunk() -> None:
    # The wait between two attempts (the provider asked for 20 s) is part of the read: an
    # interrupt ends it at once, and the consumer's task is left uncancelled.
    from agentscope_py.errors import ModelError

    attempts: list[float] = []

    class Busy:
        name = "busy"

        async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
            attempts.append(time.monotonic())
            raise ModelError("overloaded", retryable=True, retry_after=20)
            yield ChatChunk()  # pragma: no cover

    agent = ReActAgent(model=Busy(), max_retries=3)
    consumer = asyncio.create_task(agent.call("go"))
    while not attempts:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    started = time.monotonic()
    assert agent.interrupt()
    reply = await asyncio.wait_for(consumer, 5)
    assert reply.generate_reason is GenerateReason.INTERRUPTED
    assert time.monotonic() - started < 2 and len(attempts) == 1
    assert consumer.cancelling() == 0


class NeverWaits:
    """An in-process model that hands its 500 chunks over without ever waiting."""

    name = "never-waits"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        for k in range(500):
            yield ChatChunk(text=f"t{k} ")


@pytest.mark.parametrize("mode", ["stream", "call"])
async def test_a_model_that_never_waits_still_lets_the_loop_run_while_it_streams(mode: str) -> None:
    # The read still lets the loop run every FAIR_TURN chunks, so other tasks (a server's clients)
    # are not held off for the reply: in stream(), counted by event; in call(), whose reply goes to
    # the loop with no event made, by chunk.
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    start = ticks
    seen: list[int] = []
    try:
        if mode == "stream":
            async for ev in agent_of(NeverWaits()).stream("go"):
                if ev.type == "text_block_delta":
                    seen.append(ticks)
        else:
            reply = await agent_of(NeverWaits()).call("go")
    finally:
        ticker.cancel()
    if mode == "stream":
        assert len(seen) == 500 and seen[-1] - seen[0] >= 500 // FAIR_TURN - 2
    else:
        assert reply.text == "".join(f"t{k} " for k in range(500))
        assert ticks - start >= 500 // FAIR_TURN - 2


async def test_a_consumer_that_leaves_while_the_next_read_waits_ends_it_through_the_providers_cleanup() -> None:
    # The consumer leaves holding an event while the provider waits for its next chunk: that read
    # is cancelled inside the provider, whose cleanup may itself await, and its stream is closed.
    cleaned: list[str] = []

    class Slow:
        name = "slow"

        async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
            try:
                yield ChatChunk(text="t0 ")
                yield ChatChunk(text="t1 ")
                await asyncio.sleep(30)
                yield ChatChunk(text="never ")
            except asyncio.CancelledError:
                await asyncio.sleep(0)  # a cleanup that awaits
                cleaned.append("cancelled")
                raise
            finally:
                cleaned.append("closed")

    agent = agent_of(Slow())
    async with contextlib.aclosing(agent.stream("go").__aiter__()) as events:  # type: ignore[type-var]
        async for ev in events:
            if ev.type == "text_block_delta" and ev.delta == "t1 ":
                break
    assert cleaned == ["cancelled", "closed"]
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    assert asyncio.all_tasks() == {task}


async def test_a_failure_after_the_first_chunk_is_not_retried_even_before_anything_was_handed_over() -> None:
    # The provider fails right after its first chunk, before it ever waits: the consumer has been
    # handed nothing yet, but the first chunk arrived, so the call fails with its blocks closed
    # (no retry, no fallback) and the run raises the provider's error.
    from agentscope_py.errors import ModelError

    attempts: list[int] = []

    class Breaks:
        name = "breaks"

        async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
            attempts.append(1)
            yield ChatChunk(text="half ")
            raise ModelError("connection reset", retryable=True)

    agent = ReActAgent(model=Breaks(), max_retries=3)
    events: list[Any] = []
    with pytest.raises(ModelError, match="connection reset"):
        async for ev in agent.stream("go"):
            events.append(ev)
    assert len(attempts) == 1
    kinds = [e.type for e in events]
    assert kinds[kinds.index("model_call_start"):kinds.index("model_call_end") + 1] == [
        "model_call_start", "text_block_start", "text_block_delta", "text_block_end", "model_call_end"]
    end = next(e for e in events if e.type == "model_call_end")
    assert end.error is not None and "connection reset" in end.error and end.discarded
    assert not open_blocks(events)


async def test_a_stream_that_is_no_generator_is_closed_after_it_ends_and_a_generator_once() -> None:
    # An async generator that ended has run its cleanup; another kind of stream (an SDK's response
    # stream) is closed by the call, once, after its end.
    class Stream:
        def __init__(self) -> None:
            self.chunks = [ChatChunk(text="hi"), ChatChunk(finish_reason="stop")]
            self.closed = 0

        def __aiter__(self) -> Stream:
            return self

        async def __anext__(self) -> ChatChunk:
            if not self.chunks:
                raise StopAsyncIteration
            return self.chunks.pop(0)

        async def aclose(self) -> None:
            self.closed += 1

    streams: list[Stream] = []

    class Sdk:
        name = "sdk"

        def stream(self, request: ModelRequest) -> Stream:
            streams.append(Stream())
            return streams[-1]

    reply = await agent_of(Sdk()).call("go")
    assert reply.text == "hi" and [s.closed for s in streams] == [1]
    model = Chunks(3)
    reply = await agent_of(model).call("go")
    assert reply.text == "t0 t1 t2 " and model.closed


async def test_a_read_hands_each_wake_up_over_without_raising() -> None:
    # A provider that waits before every chunk: each chunk is a hand-over of its own (its events
    # to the consumer, the provider's wait to the task). The hand-over ends the consumer's await
    # by returning, not by raising StopIteration: what the model call's frames raise does not grow
    # with the reply. (`_read` awaits the provider's own async generator, whose every chunk comes
    # as a StopIteration: the provider's, not the hand-over's.)
    model = Chunks(40)
    agent = ReActAgent.builder().model(model).build()
    raised: list[str] = []
    with _raised_in_model_call(raised):
        events = await agent.stream("hi").to_list()
    assert sum(e.type == "text_block_delta" for e in events) == 40
    assert model.produced == 40 and model.closed
    assert len(raised) <= 2, raised  # the call's end, once


@contextlib.contextmanager
def _raised_in_model_call(raised: list[str]) -> Iterator[None]:
    """Names, into ``raised``, each exception raised in a frame of `_model_call` other than
    `_read`'s. Python 3.12+ traces through `sys.monitoring`'s RAISE events: ``sys.settrace``
    there reports, as an ``exception`` event, also the StopIteration a generator's return into an
    ``await`` stands for, which nothing raises (sys.monitoring's STOP_ITERATION)."""

    def seen(code: Any, exc: BaseException) -> None:
        if code.co_filename.endswith("_model_call.py") and code.co_name != "_read":
            raised.append(f"{code.co_name}: {type(exc).__name__}")

    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:
        def trace(frame: Any, event: str, arg: Any) -> Any:
            if event == "exception":
                seen(frame.f_code, arg[1])
            return trace

        previous = sys.gettrace()  # (a coverage tracer, if any, gets its thread back)
        sys.settrace(trace)
        try:
            yield
        finally:
            sys.settrace(previous)
        return
    tool = next(i for i in range(6) if monitoring.get_tool(i) is None)
    monitoring.use_tool_id(tool, "test_model_call_edges")
    monitoring.register_callback(tool, monitoring.events.RAISE, lambda code, _offset, exc: seen(code, exc))
    monitoring.set_events(tool, monitoring.events.RAISE)
    try:
        yield
    finally:
        monitoring.set_events(tool, 0)
        monitoring.register_callback(tool, monitoring.events.RAISE, None)
        monitoring.free_tool_id(tool)
