"""The operators that run producers in tasks: ``prefetch`` (one producer ahead of its consumer)
and ``merge`` (many producers into one consumer), both through a `Channel`."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

from .channel import EMPTY, Channel
from .operators import Maps, MapSource, aclose, aclosing

__all__ = ["Prefetch", "Producer", "merge"]

Producer = Callable[[], AsyncIterator[Any]]
"""What a prefetch runs in its task: an iterator factory."""


class Prefetch(MapSource):
    """The factory of a prefetched stream: each subscription starts ``source`` in a task of its
    own, in ``ctx``, ahead of the consumer by at most ``size`` items, and drains it applying the
    stream's maps in the drain (`MapSource`)."""

    __slots__ = ("ctx", "size", "source")

    def __init__(self, source: Producer, size: int, ctx: contextvars.Context) -> None:
        self.source = source
        self.size = size
        self.ctx = ctx

    def __call__(self) -> AsyncIterator[Any]:
        return _prefetch(self.source, self.size, self.ctx, ())

    def with_maps(self, maps: Maps) -> AsyncIterator[Any]:
        return _prefetch(self.source, self.size, self.ctx, maps)


async def _pump(channel: Channel, source: Producer) -> None:
    """The producer task of `_prefetch`: runs ``source`` into ``channel``."""
    error: BaseException | None = None
    try:
        it = source()
        try:
            async for item in it:
                channel.append(item)
                if channel.flush():
                    await channel.room()
        finally:
            await aclose(it)
    except BaseException as exc:  # handed to the consumer, which re-raises it
        error = exc
    finally:
        channel.finish(error)


async def _prefetch(source: Producer, size: int, ctx: contextvars.Context, maps: Maps) -> AsyncIterator[Any]:
    channel = Channel(size)
    items = channel.items
    task = channel.loop.create_task(_pump(channel, source), context=ctx)
    take, spaces, empty = channel.take, channel.spaces, EMPTY
    try:
        # Give the task its first step in this same loop turn: a source that is ready at once (a
        # cache, an in-process model) has filled the channel by then.
        await asyncio.sleep(0)
        while True:  # `Channel.drain`, with the maps applied
            item = (items.pop(0) if not spaces else take()) if items else empty
            if item is not empty:
                for fn in maps:
                    item = fn(item)
                yield item
            elif channel.done:
                channel.end()
                return
            else:
                channel.waiter = channel.loop.create_future()
                await channel.waiter
    finally:
        await _stopped(task)


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
            async with aclosing(stream.__aiter__()) as it:
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
