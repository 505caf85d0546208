"""A session's queue in a store shared by several processes (`RedisStateStore`,
`SqliteStateStore`): what the stores' ``session_lock`` share.

Every input to a session takes a **ticket** in the store when it arrives (not when its process
gets round to it), so the order the session's runs take it in is the order the inputs reached the
store, whichever process each came through, and ``max_queued`` bounds the tickets of all
processes. A ticket's place: after every ticket queued before it; an interrupting one
(``"interrupt"`` / ``"rollback"``) ahead of the enqueued ones, behind the interrupting ones still
waiting (the gate's order in one process, `_session`). A ticket carries a lease its waiter renews
while it waits: a process that dies leaves nothing that blocks the queue past the lease.

An interrupting ticket, in the same atomic step, records a **stop** for the run holding the
session (the holder's token, and whether it asks for a rollback): the holder's process hears it
at once (a message, where the store has them) or at its next check, and interrupts the run. A
run that takes the session later is not stopped by it: the interrupting input is ahead of it.

`Waits` routes what a process hears for its own tickets: the wake of a waiter whose turn came,
the stop of a holder.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..errors import BusyError

__all__ = ["JUMP", "OnInterrupt", "Waits", "entered", "mode_of", "ticket_score", "wait_turn"]

OnInterrupt = Callable[[bool], None]
"""Called with ``rollback`` when another input interrupts the run holding the session."""

JUMP = 2**52
"""Subtracted from an interrupting ticket's number: ahead of every enqueued ticket, in arrival
order among the interrupting ones (numbers stay exact in a double up to 2**53)."""


def ticket_score(number: int, mode: str) -> int:
    """The place in the queue of the ticket ``number`` (the store's counter) of a ``mode`` input."""
    return number - JUMP if mode in ("interrupt", "rollback") else number


def mode_of(wait: bool, strategy: str | None) -> str:
    """The strategy a lock request queues as: ``wait=False`` is ``"reject"``."""
    if not wait:
        return "reject"
    return strategy or "enqueue"


class Waits:
    """This process's tickets in one store: an event per waiting ticket (set when its turn may
    have come), a callback per holding one (its run's interrupt)."""

    __slots__ = ("holders", "waiters")

    def __init__(self) -> None:
        self.waiters: dict[str, asyncio.Event] = {}
        self.holders: dict[str, OnInterrupt] = {}

    def expect(self, token: str, on_interrupt: OnInterrupt | None) -> asyncio.Event:
        """Register ``token`` before its first request reaches the store (what the store sends
        for it may come back before the request's own answer)."""
        event = self.waiters[token] = asyncio.Event()
        if on_interrupt is not None:
            self.holders[token] = on_interrupt
        return event

    def forget(self, token: str) -> None:
        self.waiters.pop(token, None)
        self.holders.pop(token, None)

    def wake(self, token: str) -> None:
        event = self.waiters.get(token)
        if event is not None:
            event.set()

    def stop(self, token: str, rollback: bool) -> None:
        callback = self.holders.get(token)
        if callback is not None:
            callback(rollback)

    def heard(self, message: str) -> None:
        """A message of the store's channel: ``wake <token>`` or ``stop <token><0|1>``."""
        kind, _, rest = message.partition(" ")
        if kind == "wake":
            self.wake(rest)
        elif kind == "stop" and rest:
            self.stop(rest[:-1], rest[-1] == "1")


def entered(taken: int, user_id: str, session_id: str, mode: str) -> bool:
    """What a store's step to take the session answered: 1 the session is this ticket's, 0 wait
    for the turn; -1 refused (a ``"reject"`` input, the session held), -2 the queue is full, each
    a `BusyError` (nothing of the input stays in the queue)."""
    if taken == -1:
        raise BusyError(user_id, session_id, strategy=mode)
    if taken == -2:
        raise BusyError(user_id, session_id, strategy=mode, reason="queue_full")
    return taken == 1


async def wait_turn(event: asyncio.Event, seconds: float) -> None:
    """Until ``event`` is set or ``seconds`` passed; cleared for the next wait."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        pass
    event.clear()
