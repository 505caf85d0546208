"""Per-session coordination inside one process: the FIFO gate and the interrupt control."""

from __future__ import annotations

import asyncio

__all__ = ["AgentInterrupted", "RunControl", "SessionGates"]


def _current_task() -> asyncio.Task[object] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop
        return None


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
        current = _current_task()
        for task in list(self.tasks):
            # The task running the run itself is here while it runs a tool inline; called from
            # inside that tool, the flag alone stops the run once the tool returns.
            if task is not current:
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

    def hold(self, key: tuple[str, str]) -> _Hold:
        """``async with gates.hold(key):`` — wait for the session's turn, hold it inside."""
        return _Hold(self._gates, key)


class _Hold:
    """The async context manager of `SessionGates.hold` (a class: no generator per call)."""

    __slots__ = ("_gates", "_key", "_lock", "_users")

    def __init__(self, gates: dict[tuple[str, str], tuple[asyncio.Lock, list[int]]], key: tuple[str, str]) -> None:
        self._gates = gates
        self._key = key

    async def __aenter__(self) -> None:
        entry = self._gates.get(self._key)
        if entry is None:
            entry = self._gates[self._key] = (asyncio.Lock(), [0])
        self._lock, self._users = entry
        self._users[0] += 1
        try:
            await self._lock.acquire()
        except BaseException:
            self._leave()
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self._lock.release()
        self._leave()

    def _leave(self) -> None:
        users = self._users
        users[0] -= 1
        if users[0] == 0:
            self._gates.pop(self._key, None)
