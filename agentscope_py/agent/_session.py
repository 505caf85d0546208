"""Per-session coordination inside one process: the FIFO gate and the interrupt control."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["AgentInterrupted", "RunControl", "SessionGates"]


class AgentInterrupted(asyncio.CancelledError):
    """Raised inside a run that ``agent.interrupt(...)`` stopped. A CancelledError, so middleware
    treats it as cancellation (no retry, no fallback); the loop turns it into an INTERRUPTED
    reply."""


class RunControl:
    """The interrupt switch of one execution, and the tasks an interrupt must cancel."""

    __slots__ = ("interrupted", "tasks")

    def __init__(self) -> None:
        self.interrupted = False
        self.tasks: set[asyncio.Task[object]] = set()

    def interrupt(self) -> None:
        self.interrupted = True
        for task in list(self.tasks):
            task.cancel()

    def check(self) -> None:
        if self.interrupted:
            raise AgentInterrupted("the run was interrupted")


class SessionGates:
    """One FIFO lock per (user, session): calls on a session run one at a time, in arrival order;
    other sessions run in parallel. Entries are dropped when nobody holds or waits."""

    __slots__ = ("_gates", "active")

    def __init__(self) -> None:
        self._gates: dict[tuple[str, str], tuple[asyncio.Lock, list[int]]] = {}
        self.active: dict[tuple[str, str], RunControl] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: tuple[str, str]) -> AsyncIterator[None]:
        entry = self._gates.get(key)
        if entry is None:
            entry = self._gates[key] = (asyncio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                self._gates.pop(key, None)
