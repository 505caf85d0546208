"""The operators that run producers in tasks: ``prefetch`` (one producer ahead of its consumer)
and ``merge`` (many producers into one consumer), both through a `Channel`."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Protocol

from .channel import EMPTY, Channel
from .context import step_in
from .operators import Maps, MapSource, Recovery, aclose

__all__ = ["Deferred", "Prefetch", "Producer", "Stepper", "merge"]

Deferred = tuple[Callable[[Any], Any], Any]
"""``(make, value)``: an item a deferring prefetch makes in the consumer's task, ``make(value)``."""



class Stepper(Protocol):
    """The producer of a stepped prefetch (``steps``), made by ``source(channel)``."""

    def step(self) -> Coroutine[Any, Any, bool]:
        """One read: its items into the channel (waiting for room first when it is full); False
        once the producer has ended (its last items put). A failure puts what it must and raises."""

    def close(self) -> Coroutine[Any, Any, None]:
        """The consumer left between steps, for good: release what the producer holds."""


Producer = Callable[[], AsyncIterator[Any]] | Callable[[Channel], Awaitable[None]] | Callable[[Channel], Stepper]
"""What a prefetch runs: an iterator factory, (``push``) a coroutine function that fills the
channel itself, or (``steps``) a factory of a `Stepper` over the channel."""


class Prefetch(MapSource):
    """The factory of a prefetched stream: each subscription starts ``source`` in a task of its
    own, in ``ctx``, ahead of the consumer by at most ``size`` items, and drains it applying the
    stream's maps in the drain (`MapSource`).

    With ``push``, ``source(channel)`` is the producer itself: a coroutine, run as the task, that
    appends items to the channel's ``items`` (calling `Channel.wake`, awaiting `Channel.room`
    when full), saving the generator step per item that a pump over an iterator takes.

    With ``deferred``, the producer may put a `Deferred` pair ``(make, value)`` in place of an
    item: the drain replaces it by ``make(value)``, in the consumer's task, before the maps. A
    producer faster than its consumer then buffers the cheap ``value`` and the item is made just
    before it is used (and dies young). Any tuple is taken for such a pair, so only producers
    that put no other tuples turn it on.

    With ``steps``, ``source(channel)`` is a `Stepper`, and no task is made while the consumer
    keeps up: when it waits for an item, it runs the producer's next `Stepper.step` itself, in
    its own task (inside ``ctx``), which saves the task wake-up, the future and the hand-over per
    item that a producer task costs. A consumer that leaves with an item and has not come back by
    the end of that loop turn (one check per loop turn, shared by all such prefetches: `_Turn`)
    hands the steps to a task from then on, which runs ahead of it as a producer task does. Only
    the step the consumer is inside ever runs in its task, so a producer that cancels its reader
    (a deadline, an interrupt) must do it only inside a step, and take that cancellation back
    (`agent._model_call.ModelEvents`)."""

    __slots__ = ("ctx", "deferred", "push", "size", "source", "steps")

    def __init__(
        self, source: Producer, size: int, ctx: contextvars.Context, push: bool = False, deferred: bool = False,
        steps: bool = False,
    ) -> None:
        self.source = source
        self.size = size
        self.ctx = ctx
        self.push = push
        self.deferred = deferred
        self.steps = steps

    def __call__(self) -> AsyncIterator[Any]:
        return _prefetch(self.source, self.size, self.ctx, (), self.push, self.deferred, None, self.steps)

    def with_maps(self, maps: Maps) -> AsyncIterator[Any]:
        return _prefetch(self.source, self.size, self.ctx, maps, self.push, self.deferred, None, self.steps)

    def recovering(self, maps: Maps, recovery: Recovery) -> AsyncIterator[Any]:
        return _prefetch(self.source, self.size, self.ctx, maps, self.push, self.deferred, recovery, self.steps)


async def _pump(channel: Channel, source: Callable[..., Any], push: bool) -> None:
    """The producer task of `_prefetch`: runs ``source`` into ``channel`` (a function, not a
    closure: a closure's cells are objects each model call would keep alive)."""
    error: BaseException | None = None
    try:
        if push:
            await source(channel)
            return
        items, size = channel.items, channel.size
        it = source()
        try:
            async for item in it:
                if len(items) < size:  # put() without the coroutine when there is room
                    items.append(item)
                    if channel.waiter is not None:
                        channel.wake()
                else:
                    await channel.put(item)
        finally:
            await aclose(it)
    except BaseException as exc:  # handed to the consumer, which re-raises it
        error = exc
    finally:
        channel.finish(error)


async def _prefetch(
    source: Callable[..., Any], size: int, ctx: contextvars.Context, maps: Maps, push: bool, deferred: bool,
    recovery: Recovery | None = None, steps: bool = False,
) -> AsyncIterator[Any]:
    channel = Channel(size)
    items = channel.items
    reader: _Reader | None = None
    task: asyncio.Task[None] | None = None
    if steps:
        reader = _Reader(channel, source(channel), ctx)
    else:
        task = channel.loop.create_task(_pump(channel, source, push), context=ctx)
    take, spaces, empty = channel.take, channel.spaces, EMPTY
    try:
        if task is not None:
            # Give the task its first step in this same loop turn: a source that is ready at once
            # (a cache, an in-process model) has filled the channel by then, so no waiter is needed.
            await asyncio.sleep(0)
        if recovery is not None:
            # Until the first item (`Recovery`): a failure goes to ``recovery``, not out. A loop of
            # its own, so the loop below (every item of every prefetch) stays as it is.
            n, passes, resume = recovery
            inner, outer = maps[:n], maps[n:]
            error: Exception | None = None
            while True:
                item = items.pop(0) if items and not spaces else take()
                if item is not empty:
                    try:
                        if deferred and type(item) is tuple:
                            item = item[0](item[1])
                        for fn in inner:
                            item = fn(item)
                    except Exception as exc:
                        error = exc
                        break
                    first = type(item) not in passes
                    for fn in outer:
                        item = fn(item)
                    if reader is not None:
                        if not reader.listed:
                            reader.leave()
                        reader.away = True
                    yield item
                    if reader is not None:
                        reader.away = False
                    if first:
                        break
                elif channel.done:
                    if not isinstance(channel.error, Exception):
                        channel.end()  # (a BaseException goes on; None: the stream is complete)
                        return
                    error = channel.error
                    break
                elif reader is not None and reader.task is None:
                    await reader.read()
                else:
                    channel.waiter = channel.loop.create_future()
                    await channel.waiter
            if error is not None:
                await _stop(reader, task)
                resumed = resume(error)
                try:
                    async for item in resumed:
                        yield item
                finally:
                    await aclose(resumed)
                return
        while True:  # channel.drain(), inlined: one async layer less per item
            # take(), inlined when no producer waits for room
            item = items.pop(0) if items and not spaces else take()
            if item is not empty:
                if deferred and type(item) is tuple:
                    item = item[0](item[1])
                for fn in maps:
                    item = fn(item)
                if reader is None:
                    yield item
                else:  # (see _Reader: away until it asks again; looked at when the turn ends)
                    if not reader.listed:
                        reader.leave()
                    reader.away = True
                    yield item
                    reader.away = False
            elif channel.done:
                channel.end()
                return
            elif reader is not None and reader.task is None:  # read here, in this task
                await reader.read()
            else:  # channel.wait(), inlined: a coroutine less per wake-up
                channel.waiter = channel.loop.create_future()
                await channel.waiter
    finally:
        # (tested here: a coroutine less when the producer has finished)
        if reader is not None:
            if not reader.ended():
                await reader.stop()
        elif task is not None and not task.done():
            await _stopped(task)


async def _stop(reader: _Reader | None, task: asyncio.Task[None] | None) -> None:
    if reader is not None:
        await reader.stop()
    elif task is not None:
        await _stopped(task)


class _Reader:
    """Who runs a stepped prefetch's producer (``steps``, see `Prefetch`): its consumer, in its own
    task while it waits for an item, until it leaves with one for longer than a loop turn; from
    then on a producer task (``task``)."""

    __slots__ = ("away", "channel", "ctx", "listed", "producer", "task", "turn")

    def __init__(self, channel: Channel, producer: Stepper, ctx: contextvars.Context) -> None:
        self.channel = channel
        self.producer = producer
        self.ctx = ctx
        self.task: asyncio.Task[None] | None = None
        self.away = False  # the consumer has an item and has not asked for the next one yet
        self.listed = False  # in this loop turn's `_Turn` (for good once a task reads)
        self.turn = _turn_of(channel.loop)

    async def read(self) -> None:
        """The consumer waits for an item: the producer's next step, here, inside ``ctx``."""
        channel = self.channel
        try:
            more = await step_in(self.ctx, self.producer.step())
        except Exception as exc:
            channel.finish(exc)  # the consumer takes what the step put (its closing items), then this
            return
        except BaseException as exc:  # (the consumer's own cancellation) goes on at once
            channel.finish(exc)
            raise
        if not more:
            channel.finish(None)

    def leave(self) -> None:
        """The consumer takes an item away (``away``): listed for the end of this loop turn."""
        self.away = True
        self.listed = True
        turn = self.turn
        turn.away.append(self)
        if turn.handle is None:
            turn.handle = self.channel.loop.call_soon(turn.check, context=turn.ctx)

    def hand_off(self) -> None:
        """The loop turn the consumer left in is over, and it is still away: a task runs the
        producer's steps from now on (ahead of the consumer, as a producer task does)."""
        if self.task is None and not self.channel.done:
            stepping = functools.partial(_stepping, self.producer)
            self.task = self.channel.loop.create_task(_pump(self.channel, stepping, True), context=self.ctx)

    def ended(self) -> bool:
        task = self.task
        return task.done() if task is not None else self.channel.done

    async def stop(self) -> None:
        """The consumer left for good (or the first attempt failed, `Recovery`)."""
        self.away = False
        task = self.task
        if task is not None:
            await _stopped(task)
        elif not self.channel.done:
            self.channel.finish(None)  # (no more steps: a hand-off now would find it done)
            await step_in(self.ctx, self.producer.close())


async def _stepping(producer: Stepper, channel: Channel) -> None:
    """A stepped prefetch's producer task (after a `_Reader.hand_off`): steps until it ends."""
    while await producer.step():
        pass


class _Turn:
    """The stepped prefetches of one loop whose consumer left with an item during the current loop
    turn: looked at once, by one callback when the turn is over, however many there are."""

    __slots__ = ("away", "ctx", "handle")

    def __init__(self) -> None:
        self.away: list[_Reader] = []
        self.handle: asyncio.Handle | None = None
        self.ctx = contextvars.Context()  # (the callback reads no context: no copy per turn)

    def check(self) -> None:
        self.handle = None
        away, self.away = self.away, []
        for reader in away:
            if reader.away:
                reader.hand_off()
            reader.listed = reader.task is not None  # (a task reads ahead: no need to look again)


# Per loop, its turn; weakly keyed, and a turn holds no loop (its pending callback does, while due).
_turns: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Turn] = weakref.WeakKeyDictionary()


def _turn_of(loop: asyncio.AbstractEventLoop) -> _Turn:
    turn = _turns.get(loop)
    if turn is None:
        turn = _turns[loop] = _Turn()
    return turn


async def _stopped(task: asyncio.Task[None]) -> None:
    """Cancel the producer task and wait for it to end."""
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


async def merge(
    sources: AsyncIterator[Any],
    inner_of: Callable[[Any], AsyncIterable[Any]],
    buffer: int,
    max_concurrent: int | None = None,
) -> AsyncIterator[Any]:
    """Run ``inner_of(item)`` for each item of ``sources`` concurrently, into one channel; an
    error anywhere cancels the rest."""
    channel = Channel(buffer)
    tasks: set[asyncio.Task[None]] = set()
    limit = asyncio.Semaphore(max_concurrent) if max_concurrent else None
    outer_done = False

    async def run_inner(stream: AsyncIterable[Any]) -> None:
        try:
            async with contextlib.aclosing(stream.__aiter__()) as it:  # type: ignore[type-var]
                async for item in it:
                    await channel.put(item)
        finally:
            if limit is not None:
                limit.release()

    def inner_done(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and not channel.done:
            channel.finish(task.exception())
        elif outer_done and not tasks and not channel.done:
            channel.finish(None)

    async def pump() -> None:
        nonlocal outer_done
        try:
            async for item in sources:
                inner = inner_of(item)
                if limit is not None:
                    await limit.acquire()
                t = channel.loop.create_task(run_inner(inner))
                tasks.add(t)
                t.add_done_callback(inner_done)
        except BaseException as exc:
            channel.finish(exc)
            raise
        finally:
            await aclose(sources)
        outer_done = True
        if not tasks and not channel.done:
            channel.finish(None)

    pump_task = channel.loop.create_task(pump())
    try:
        async for item in channel.drain():
            yield item
    finally:
        pending = [t for t in (pump_task, *tasks) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
