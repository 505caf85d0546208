"""Per-session coordination inside one process: the FIFO gate and the interrupt control."""

from __future__ import annotations

import asyncio
from typing import Any

from .._control import RunControl
from ..errors import AgentInterrupted

__all__ = ["AgentInterrupted", "RunControl", "SessionGates"]


Key = tuple[str, str]


class SessionGates:
    """One FIFO gate per (user, session): calls on a session run one at a time, in arrival order;
    other sessions run in parallel. A gate exists while held (its entry lists the waiters), so an
    uncontended call takes it without a lock object or a wait."""

    __slots__ = ("_gates", "active")

    def __init__(self) -> None:
        self._gates: dict[Key, list[asyncio.Future[None]]] = {}
        self.active: dict[Key, RunControl] = {}

    def hold(self, key: Key, store: object = None) -> _Hold:
        """``async with gates.hold(key, store):`` — wait for the session's turn, hold it inside; a
        store shared by several processes (Redis) serialises the session across them too, with
        its ``session_lock``, taken inside the gate."""
        return _Hold(self._gates, key, getattr(store, "session_lock", None))


class _Hold:
    """The async context manager of `SessionGates.hold` (a class: no generator per call)."""

    __slots__ = ("_gates", "_key", "_store_cm", "_store_lock")

    def __init__(self, gates: dict[Key, list[asyncio.Future[None]]], key: Key, store_lock: Any) -> None:
        self._gates = gates
        self._key = key
        self._store_lock = store_lock
        self._store_cm: Any = None

    async def __aenter__(self) -> None:
        waiters = self._gates.get(self._key)
        if waiters is None:
            self._gates[self._key] = []  # held, nobody waiting
        else:
            turn = asyncio.get_running_loop().create_future()
            waiters.append(turn)
            try:
                await turn
            except BaseException:
                if turn.done() and not turn.cancelled():
                    self._release()  # handed the gate, but cancelled before taking it: pass it on
                elif turn in waiters:
                    waiters.remove(turn)
                raise
        if self._store_lock is not None:
            cm = self._store_lock(*self._key)
            try:
                await cm.__aenter__()
            except BaseException:
                self._release()
                raise
            self._store_cm = cm

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            if self._store_cm is not None:
                await self._store_cm.__aexit__(*exc_info)
        finally:
            self._release()

    def _release(self) -> None:
        waiters = self._gates.get(self._key)
        while waiters:
            turn = waiters.pop(0)
            if not turn.done():  # a cancelled waiter is done already
                turn.set_result(None)
                return
        self._gates.pop(self._key, None)
