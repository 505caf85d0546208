"""The per-session FIFO gate: arrival order, other sessions in parallel, cancelled waiters, and
the store's cross-process lock taken inside the gate."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from agentscope_py.agent._session import SessionGates

KEY = ("u", "s")


async def hold_and_log(gates: SessionGates, name: str, log: list[str], release: asyncio.Event,
                       store: object = None) -> None:
    async with gates.hold(KEY, store):
        log.append(f"{name} in")
        await release.wait()
        log.append(f"{name} out")


async def test_holders_take_turns_in_arrival_order_and_the_entry_goes_away() -> None:
    gates = SessionGates()
    log: list[str] = []
    releases = [asyncio.Event() for _ in range(3)]
    tasks = [asyncio.create_task(hold_and_log(gates, n, log, r)) for n, r in zip("abc", releases, strict=True)]
    await asyncio.sleep(0.01)
    async with asyncio.timeout(1):
        async with gates.hold(("u", "other")):  # another session is not held up
            log.append("other")
    for r in reversed(releases):
        r.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert log == ["a in", "other", "a out", "b in", "b out", "c in", "c out"]
    assert gates._gates == {}


async def test_a_waiter_cancelled_while_waiting_leaves_the_line() -> None:
    gates = SessionGates()
    log: list[str] = []
    release_a, release_b, release_c = asyncio.Event(), asyncio.Event(), asyncio.Event()
    a = asyncio.create_task(hold_and_log(gates, "a", log, release_a))
    await asyncio.sleep(0)
    b = asyncio.create_task(hold_and_log(gates, "b", log, release_b))
    c = asyncio.create_task(hold_and_log(gates, "c", log, release_c))
    await asyncio.sleep(0.01)
    b.cancel()
    release_c.set()
    release_a.set()
    await asyncio.wait_for(asyncio.gather(a, c), 1)
    assert b.cancelled()
    assert log == ["a in", "a out", "c in", "c out"]
    assert gates._gates == {}


async def test_a_waiter_cancelled_after_its_turn_came_passes_the_gate_on() -> None:
    gates = SessionGates()
    log: list[str] = []
    release_a, release_c = asyncio.Event(), asyncio.Event()
    release_c.set()
    a = asyncio.create_task(hold_and_log(gates, "a", log, release_a))
    await asyncio.sleep(0)
    b = asyncio.create_task(hold_and_log(gates, "b", log, asyncio.Event()))
    c = asyncio.create_task(hold_and_log(gates, "c", log, release_c))
    await asyncio.sleep(0.01)
    release_a.set()
    while "a out" not in log:  # a released: b's turn is handed over, b has not resumed yet
        await asyncio.sleep(0)
    b.cancel()
    await asyncio.wait_for(asyncio.gather(a, c), 1)
    assert b.cancelled()
    assert log == ["a in", "a out", "c in", "c out"]
    assert gates._gates == {}


async def test_the_stores_session_lock_is_taken_inside_the_gate_and_released_on_error() -> None:
    log: list[str] = []

    class Store:
        @contextlib.asynccontextmanager
        async def session_lock(self, user_id: str, session_id: str) -> AsyncIterator[None]:
            log.append(f"lock {user_id}/{session_id}")
            try:
                yield
            finally:
                log.append("unlock")

    gates = SessionGates()
    try:
        async with gates.hold(KEY, Store()):
            log.append("body")
            raise ValueError("boom")
    except ValueError:
        pass
    assert log == ["lock u/s", "body", "unlock"]
    assert gates._gates == {}
