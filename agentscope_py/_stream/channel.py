"""`Channel`: the one bounded buffer between producer task(s) and one consumer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["EMPTY", "Channel"]

EMPTY: Any = object()
"""What `Channel.take` returns when no item waits."""


class Channel:
    """A bounded buffer between producer task(s) and one consumer: the one buffer type of the
    runtime (the model call's prefetch, parallel tool calls, merges, the reactivex bridge).

    Internal API, used across the package: a producer appends to ``items`` (or awaits `put`,
    which waits for room), calls `wake` after appending, awaits `room` when ``len(items) >= size``,
    and ends with `finish(error)`; the consumer takes with `take` (or iterates `drain`), waiting
    on ``waiter`` when empty. One consumer only."""

    __slots__ = ("done", "error", "items", "loop", "size", "spaces", "waiter")

    def __init__(self, size: int) -> None:
        self.items: list[Any] = []  # a list: 56 B when empty, a deque 624 B (few items wait here)
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

    async def wait(self) -> None:
        """Wait (the consumer) until an item arrives or the channel is finished."""
        self.waiter = self.loop.create_future()
        await self.waiter

    def end(self) -> None:
        """Called by the consumer once the channel is done and empty: raise its error, if any."""
        if self.error is not None:
            raise self.error

    async def drain(self) -> AsyncIterator[Any]:
        take = self.take
        while True:
            item = take()
            if item is not EMPTY:
                yield item
            elif self.done:
                self.end()
                return
            else:
                await self.wait()
