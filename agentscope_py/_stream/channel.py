"""`Channel`: the one bounded buffer between producer task(s) and one consumer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

__all__ = ["EMPTY", "Channel"]

EMPTY: Any = object()
"""What `Channel.take` returns when no item waits."""


class Channel:
    """A bounded buffer between producer task(s) and one consumer: the one buffer type of the
    runtime (the model call's prefetch, parallel tool calls, merges, the reactivex bridge).

    Internal API, used across the package; only this class writes its fields. A producer awaits
    `put` (which waits for room), or calls `push` (no waiting), or `append`s a batch and then
    calls `flush` (which wakes the consumer and says whether to await `room`); it ends with
    `finish(error)`. The consumer takes with `take` (or iterates `drain`), awaiting `wait` when
    nothing waits in it. One consumer only.

    ``items`` is a list, not a deque: few items wait here, and an empty list is a tenth of an
    empty deque's size, per open channel."""

    __slots__ = ("append", "done", "error", "items", "loop", "size", "spaces", "waiter")

    def __init__(self, size: int) -> None:
        self.items: list[Any] = []
        self.append = self.items.append
        """Add an item without waking the consumer or waiting for room (then `flush`)."""
        self.size = max(1, size)
        self.loop = asyncio.get_running_loop()
        self.waiter: asyncio.Future[None] | None = None  # the consumer waiting for an item
        self.spaces: list[asyncio.Future[None]] = []  # producers waiting for room
        self.done = False
        self.error: BaseException | None = None

    def wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    def flush(self) -> bool:
        """Wake the consumer for the items appended; True when the channel is full (the producer
        then awaits `room`)."""
        items = self.items
        waiter = self.waiter
        if waiter is not None and items:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)
        return len(items) >= self.size

    def push(self, item: Any) -> None:
        """Add ``item`` and wake the consumer, without waiting for room (a producer's last items,
        or one whose own source cannot be paused)."""
        self.items.append(item)
        self.wake()

    async def put(self, item: Any) -> None:
        if len(self.items) >= self.size:
            await self.room()
        self.items.append(item)
        self.wake()

    async def room(self) -> None:
        """Wait until there is room for one more item."""
        while len(self.items) >= self.size:
            room = self.loop.create_future()
            self.spaces.append(room)
            await room

    def finish(self, error: BaseException | None) -> None:
        if not self.done:
            self.done = True
            self.error = error
        self.wake()

    def take(self) -> Any:
        """The next item (making room for a waiting producer), or `EMPTY`."""
        items = self.items
        if not items:
            return EMPTY
        item = items.pop(0)
        spaces = self.spaces
        if spaces:
            room = spaces.pop(0)
            if not room.done():
                room.set_result(None)
        return item

    def arrival(self) -> asyncio.Future[None]:
        """A future done when an item arrives or the channel is finished: what `wait` awaits, for
        a consumer that waits on something else at the same time."""
        self.waiter = self.loop.create_future()
        return self.waiter

    async def wait(self) -> None:
        """Wait (the consumer) until an item arrives or the channel is finished."""
        await self.arrival()

    def end(self) -> None:
        """Called by the consumer once the channel is done and empty: raise its error, if any."""
        if self.error is not None:
            raise self.error

    async def drain(
        self, through: Callable[[asyncio.Future[None]], Awaitable[None]] | None = None,
    ) -> AsyncIterator[Any]:
        """The items as they arrive, then the channel's error if it has one. ``through``: what
        awaits an arrival instead of the consumer itself (`RunControl.wait`, which the run's
        interrupt cuts)."""
        take = self.take
        while True:
            item = take()
            if item is not EMPTY:
                yield item
            elif self.done:
                self.end()
                return
            elif through is None:
                await self.wait()
            else:
                await through(self.arrival())
