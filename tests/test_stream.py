"""EventStream: cold, fused, closes what it opens, carries errors, interoperates with Rx."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator
from typing import Any

import pytest
import reactivex
from reactivex import operators as ops

from agentscope_py import EventStream
from agentscope_py._stream.channel import EMPTY
from agentscope_py.stream import Channel, aclosing, to_stream


class Producer:
    """A cold source that records subscriptions, items produced and whether it was closed."""

    def __init__(self, n: int = 5, fail_at: int | None = None, tick: bool = False) -> None:
        self.n, self.fail_at, self.tick = n, fail_at, tick
        self.subscriptions = 0
        self.produced = 0
        self.closed = 0

    async def gen(self) -> AsyncIterator[int]:
        self.subscriptions += 1
        try:
            for i in range(self.n):
                if self.tick:
                    await asyncio.sleep(0)
                if self.fail_at is not None and i == self.fail_at:
                    raise ValueError(f"boom at {i}")
                self.produced += 1
                yield i
        finally:
            self.closed += 1

    def stream(self) -> EventStream[int]:
        return EventStream.from_async_iterable(self.gen)


async def test_stream_is_cold_and_reiterable() -> None:
    p = Producer(3)
    s = p.stream().map(lambda x: x * 10)
    assert p.subscriptions == 0
    assert await s.to_list() == [0, 10, 20]
    assert await s.to_list() == [0, 10, 20]
    assert p.subscriptions == 2 and p.closed == 2


async def test_fused_operators_apply_in_order() -> None:
    s = EventStream.of(1, 2, 3, 4, 5, 6)
    seen: list[int] = []
    out = await s.filter(lambda x: x % 2 == 0).do(seen.append).map(lambda x: x + 1).filter(lambda x: x > 3).to_list()
    assert out == [5, 7] and seen == [2, 4, 6]


async def test_break_closes_the_producer_promptly() -> None:
    p = Producer(1000, tick=True)
    s = p.stream().map(lambda x: x).filter(lambda x: True).concat_map(lambda x: (x,)).take_while(lambda x: True)
    async with contextlib.aclosing(s):
        async for item in s:
            if item == 3:
                break
    assert p.closed == 1 and p.produced == 4


async def test_bare_break_finalises_within_a_few_ticks() -> None:
    p = Producer(1000, tick=True)
    async for item in p.stream().map(lambda x: x):
        if item == 2:
            break
    for _ in range(5):
        await asyncio.sleep(0)
    assert p.closed == 1


async def test_errors_propagate_through_layers_and_close_the_producer() -> None:
    p = Producer(10, fail_at=3)
    s = p.stream().map(lambda x: x).concat_map(lambda x: EventStream.of(x)).take(100)
    got: list[int] = []
    with pytest.raises(ValueError, match="boom at 3"):
        async for x in s:
            got.append(x)
    assert got == [0, 1, 2] and p.closed == 1


async def test_error_in_a_mapper_closes_the_producer() -> None:
    p = Producer(10)

    def bad(x: int) -> int:
        if x == 2:
            raise KeyError("mapper")
        return x

    with pytest.raises(KeyError):
        await p.stream().map(bad).to_list()
    assert p.closed == 1


async def test_catch_continues_with_the_fallback() -> None:
    p = Producer(5, fail_at=2)
    out = await p.stream().catch(lambda exc: EventStream.of(f"fallback:{exc}")).to_list()
    assert out == [0, 1, "fallback:boom at 2"]


async def test_catch_does_not_catch_cancellation() -> None:
    async def gen() -> AsyncIterator[int]:
        yield 1
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await EventStream.from_async_iterable(gen).catch(lambda e: EventStream.of(2)).to_list()


async def test_retry_has_per_subscription_state() -> None:
    attempts = 0

    async def flaky() -> AsyncIterator[str]:
        nonlocal attempts
        attempts += 1
        if attempts % 3 != 0:  # fails twice, then succeeds, on every subscription
            raise ConnectionError("flaky")
        yield "ok"

    s = EventStream.from_async_iterable(flaky).retry(2)
    assert await s.to_list() == ["ok"]
    assert attempts == 3
    assert await s.to_list() == ["ok"]  # the same composed stream behaves the same again
    assert attempts == 6
    with pytest.raises(ConnectionError):
        await EventStream.from_async_iterable(flaky).retry(1).to_list()


async def test_take_zero_never_subscribes_and_take_closes() -> None:
    p = Producer(100)
    assert await p.stream().take(0).to_list() == []
    assert p.subscriptions == 0
    assert await p.stream().take(2).to_list() == [0, 1]
    assert p.closed == 1 and p.produced == 2


async def test_take_while_and_finally_run_once() -> None:
    calls: list[str] = []
    s = EventStream.of(1, 2, 3, 1).take_while(lambda x: x < 3).finally_(lambda: calls.append("done"))
    assert await s.to_list() == [1, 2]
    assert calls == ["done"]
    with pytest.raises(ValueError):
        await EventStream.error(ValueError("x")).finally_(lambda: calls.append("err")).to_list()
    async for _ in EventStream.of(1, 2, 3).finally_(lambda: calls.append("closed")):
        break
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert calls == ["done", "err", "closed"]


async def test_constructors() -> None:
    assert await EventStream.from_iterable(range(3)).to_list() == [0, 1, 2]
    assert await EventStream.empty().to_list() == []
    assert await EventStream.concat(EventStream.of(1), [2, 3], EventStream.of(4)).to_list() == [1, 2, 3, 4]
    made: list[int] = []
    d = EventStream.defer(lambda: made.append(1) or EventStream.of(len(made)))
    assert made == []
    assert await d.to_list() == [1] and await d.to_list() == [2]
    assert await EventStream.of(1, 2).last() == 2
    with pytest.raises(LookupError):
        await EventStream.empty().last()


async def test_concat_map_inserts_and_drops() -> None:
    out = await EventStream.of(1, 2, 3).concat_map(lambda x: () if x == 2 else (x, -x)).to_list()
    assert out == [1, -1, 3, -3]


async def test_flat_map_and_merge_run_concurrently() -> None:
    async def slow(tag: str, delay: float) -> AsyncIterator[str]:
        await asyncio.sleep(delay)
        yield tag

    s = EventStream.of(("a", 0.05), ("b", 0.0)).flat_map(lambda t: EventStream.from_async_iterable(lambda: slow(*t)))
    assert await s.to_list() == ["b", "a"]
    merged = await EventStream.merge(EventStream.from_async_iterable(lambda: slow("x", 0.03)), EventStream.of("y")).to_list()
    assert merged == ["y", "x"]
    with pytest.raises(ValueError):
        await EventStream.merge(EventStream.of(1), EventStream.error(ValueError("m"))).to_list()


async def test_subscribe_and_dispose(no_leaked_tasks: None) -> None:
    got: list[int] = []
    done = asyncio.Event()
    sub = EventStream.of(1, 2, 3).subscribe(got.append, on_completed=done.set)
    await asyncio.wait_for(done.wait(), 1)
    assert got == [1, 2, 3]
    p = Producer(10_000, tick=True)
    sub = p.stream().subscribe(lambda x: None)
    await asyncio.sleep(0.01)
    sub.dispose()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert sub.disposed and p.closed == 1 and p.produced < 10_000
    errors: list[BaseException] = []
    sub = EventStream.error(RuntimeError("e")).subscribe(on_error=errors.append)
    await sub
    assert [str(e) for e in errors] == ["e"]


async def test_to_stream_rejects_non_streams() -> None:
    with pytest.raises(TypeError, match="expected a stream"):
        to_stream(42)


VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


async def test_prefetch_runs_in_the_build_time_context_and_leaks_nothing(no_leaked_tasks: None) -> None:
    seen: list[str] = []

    async def producer() -> AsyncIterator[int]:
        seen.append(VAR.get())
        VAR.set("producer")  # stays in the producer's task
        yield 1
        yield 2

    token = VAR.set("built")
    s = EventStream.from_async_iterable(producer).prefetch(1)
    VAR.reset(token)
    assert await s.to_list() == [1, 2]
    assert seen == ["built"] and VAR.get() == "unset"
    p = Producer(10_000, tick=True)
    async for _ in p.stream().prefetch(4):
        break
    for _ in range(5):  # finaliser task, then the producer task's cancellation
        await asyncio.sleep(0)
    assert p.closed == 1 and p.produced < 100


async def test_prefetch_carries_errors() -> None:
    with pytest.raises(ValueError, match="boom at 1"):
        await Producer(3, fail_at=1).stream().prefetch(2).to_list()


async def test_operators_after_prefetch_run_on_the_consumer_side(no_leaked_tasks: None) -> None:
    consumer = asyncio.current_task()
    tasks: list[Any] = []

    def note(x: int) -> int:
        tasks.append(asyncio.current_task())
        return x

    maps_only = Producer(4).stream().prefetch(2).map(note).map(lambda x: x * 10)
    assert await maps_only.to_list() == [0, 10, 20, 30]
    assert tasks and all(t is consumer for t in tasks)
    mixed = Producer(6).stream().prefetch(2).map(lambda x: x + 1).filter(lambda x: x % 2 == 0).do(note)
    assert await mixed.to_list() == [2, 4, 6]


async def test_a_failing_map_after_prefetch_stops_the_producer(no_leaked_tasks: None) -> None:
    p = Producer(10_000, tick=True)

    def fail_at_3(x: int) -> int:
        if x == 3:
            raise ValueError("map failed")
        return x

    with pytest.raises(ValueError, match="map failed"):
        await p.stream().prefetch(4).map(fail_at_3).to_list()
    for _ in range(3):
        await asyncio.sleep(0)
    assert p.closed == 1 and p.produced < 100


async def test_a_channel_wakes_its_waiting_consumer_once_per_flush_and_says_when_it_is_full() -> None:
    channel = Channel(2)
    assert channel.flush() is False and channel.take() is EMPTY  # nothing appended, nobody woken
    waiting = asyncio.ensure_future(channel.wait())
    await asyncio.sleep(0)
    channel.append("a")
    assert not waiting.done()  # appended, not yet flushed: the consumer sleeps on
    assert channel.flush() is False
    await asyncio.sleep(0)
    assert waiting.done()
    channel.append("b")
    assert channel.flush() is True  # two of two: the producer must wait for room
    room = asyncio.ensure_future(channel.room())
    await asyncio.sleep(0)
    assert not room.done()
    assert channel.take() == "a"
    await asyncio.sleep(0)
    assert room.done()

    arrival = channel.arrival()  # a consumer that waits on something else too
    channel.push("c")  # added and woken at once, without waiting for room
    assert arrival.done() and channel.take() == "b" and channel.take() == "c"
    channel.finish(ValueError("the producer failed"))
    assert [item async for item in _drained(channel, raises=ValueError)] == []


async def _drained(channel: Channel, raises: type[BaseException]) -> AsyncIterator[Any]:
    with pytest.raises(raises):
        async for item in channel.drain():
            yield item


# -- reactivex and aioreactive interop -----------------------------------------------------------


async def test_pipe_runs_sync_rx_operators_inline_and_closes_the_producer() -> None:
    p = Producer(1000)
    out = await p.stream().pipe(ops.filter(lambda x: x % 2 == 0), ops.map(lambda x: x * 10), ops.scan(lambda a, x: a + x, 0),
                                ops.take(3)).to_list()
    assert out == [0, 20, 60]
    assert p.closed == 1 and p.produced <= 6


async def test_pipe_carries_errors_both_ways() -> None:
    out = await Producer(5, fail_at=2).stream().pipe(ops.catch(reactivex.of(-1))).to_list()
    assert out == [0, 1, -1]
    with pytest.raises(ValueError):
        await Producer(5, fail_at=2).stream().pipe(ops.map(lambda x: x)).to_list()


async def test_pipe_time_based_operator_on_the_loop() -> None:
    async def spaced() -> AsyncIterator[int]:
        for i in range(3):
            yield i
            await asyncio.sleep(0.05)

    out = await EventStream.from_async_iterable(spaced).pipe(ops.delay(0.01), ops.map(lambda x: x + 1)).to_list()
    assert out == [1, 2, 3]
    batched = await EventStream.from_async_iterable(spaced).pipe(ops.buffer_with_count(2)).to_list()
    assert batched == [[0, 1], [2]]


@pytest.mark.parametrize("operators", [
    (ops.delay(0.01), ops.retry(3)),
    (ops.debounce(0.01), ops.retry(2)),
    (ops.retry(2),),
    (ops.delay(0.01), ops.catch(lambda error, source: source)),
], ids=["delay-retry", "debounce-retry", "retry", "delay-catch-resubscribe"])
async def test_a_resubscription_after_the_upstream_failed_gets_its_error_again(operators: Any) -> None:
    # The upstream is pulled once: a retry after its error sees that error again (and gives up)
    # instead of waiting for items that never come.
    failing = Producer(5, fail_at=2, tick=True)
    with pytest.raises(ValueError, match="boom at 2"):
        await asyncio.wait_for(failing.stream().pipe(*operators).to_list(), 2)
    assert failing.subscriptions == 1 and failing.closed == 1


async def test_a_resubscription_after_the_upstream_completed_gets_its_completion_again() -> None:
    ended = Producer(2, tick=True)
    out = await asyncio.wait_for(ended.stream().pipe(ops.delay(0.01), ops.repeat(3)).to_list(), 2)
    assert out == [0, 1] and ended.subscriptions == 1 and ended.closed == 1


async def test_to_and_from_observable() -> None:
    p = Producer(3)
    obs = p.stream().to_observable()
    got: list[Any] = []
    done = asyncio.Event()
    obs.pipe(ops.map(lambda x: x * 2)).subscribe(got.append, on_completed=done.set)
    await asyncio.wait_for(done.wait(), 1)
    assert got == [0, 2, 4] and p.closed == 1
    back = EventStream.from_observable(reactivex.of(1, 2, 3))
    assert await back.to_list() == [1, 2, 3] and await back.to_list() == [1, 2, 3]
    with pytest.raises(ValueError):
        await EventStream.from_observable(reactivex.throw(ValueError("rx"))).to_list()
    retried = Producer(3, fail_at=1)
    errors: list[BaseException] = []
    failed = asyncio.Event()
    retried.stream().to_observable().pipe(ops.retry(3)).subscribe(on_error=lambda e: (errors.append(e), failed.set()))
    await asyncio.wait_for(failed.wait(), 1)
    assert retried.subscriptions == 3


async def test_aioreactive_adapters() -> None:
    import aioreactive as rx

    p = Producer(4)
    aobs = p.stream().to_async_observable()
    got: list[int] = []
    done = asyncio.Event()

    async def asend(x: int) -> None:
        got.append(x)

    async def aclose() -> None:
        done.set()

    await aobs.subscribe_async(rx.AsyncAnonymousObserver(asend, None, aclose))
    await asyncio.wait_for(done.wait(), 1)
    assert got == [0, 1, 2, 3] and p.closed == 1
    # From an aioreactive observable (built over our own stream), with backpressure and errors.
    back = EventStream.from_async_observable(Producer(3).stream().to_async_observable())
    assert await back.to_list() == [0, 1, 2]
    with pytest.raises(ValueError):
        await EventStream.from_async_observable(Producer(3, fail_at=1).stream().to_async_observable()).to_list()
    assert await to_stream(rx.from_iterable([7, 8])).to_list() == [7, 8]


async def test_aclosing_closes_the_iterator_however_the_block_ends() -> None:
    closed: list[str] = []

    async def gen(name: str) -> AsyncIterator[int]:
        try:
            yield 1
            yield 2
        finally:
            closed.append(name)

    async with aclosing(gen("early")) as it:
        assert await it.__anext__() == 1
    with pytest.raises(ValueError):
        async with aclosing(gen("error")) as it:
            await it.__anext__()
            raise ValueError
    assert closed == ["early", "error"]


async def test_aclosing_takes_an_iterator_without_aclose() -> None:
    class Plain:
        def __init__(self) -> None:
            self.n = 0

        def __aiter__(self) -> Plain:
            return self

        async def __anext__(self) -> int:
            self.n += 1
            if self.n > 2:
                raise StopAsyncIteration
            return self.n

    async with aclosing(Plain()) as it:
        assert [x async for x in it] == [1, 2]
