"""The per-session FIFO gate: arrival order, other sessions in parallel, cancelled waiters, the
store's cross-process lock taken inside the gate, and a store that keeps the session's queue
itself (every input goes to it at once, and it carries the interrupts)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from agentscope_py._control import RunControl
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


class QueueingStore:
    """A store that keeps the session's queue itself (``session_queue``): its lock hears a stop
    for the run as the lock is taken, before the hold has registered the run's control (the
    message of an interrupting input in another process can arrive that early)."""

    def __init__(self) -> None:
        self.asked: dict[str, object] = {}

    async def session_queue(self, user_id: str, session_id: str) -> tuple[str | None, int]:
        return None, 0

    @contextlib.asynccontextmanager
    async def session_lock(self, user_id: str, session_id: str, **options: Any) -> AsyncIterator[None]:
        self.asked = options
        options["on_interrupt"](True)
        yield


async def test_a_stop_heard_before_the_run_registered_interrupts_it_once_it_does() -> None:
    store, control, gates = QueueingStore(), RunControl(), SessionGates()
    async with gates.hold(KEY, store, "interrupt", 7, control, "run-1"):
        assert control.interrupted and control.rollback
        assert gates.active[KEY] is control
    assert {k: v for k, v in store.asked.items() if k != "on_interrupt"} == {
        "wait": True, "holder": "run-1", "strategy": "interrupt", "max_queued": 7}
    assert gates._gates == {} and gates.active == {}


async def test_inputs_to_a_queueing_store_wait_in_its_queue_not_in_the_gate() -> None:
    """Two inputs of one process both go to the store's queue at once (their order is the
    store's): neither waits in the gate for the other."""
    entered = asyncio.Event()
    release = asyncio.Event()
    asked: list[str] = []

    class Store(QueueingStore):
        @contextlib.asynccontextmanager
        async def session_lock(self, user_id: str, session_id: str, **options: Any) -> AsyncIterator[None]:
            asked.append(str(options["holder"]))
            if len(asked) == 2:
                entered.set()
            await release.wait()
            yield

    gates, store = SessionGates(), Store()

    async def call(name: str) -> None:
        async with gates.hold(KEY, store, holder=name):
            pass

    tasks = [asyncio.create_task(call(n)) for n in ("a", "b")]
    await asyncio.wait_for(entered.wait(), 1)
    assert asked == ["a", "b"] and gates.busy(KEY)
    release.set()
    await asyncio.gather(*tasks)
    assert gates._gates == {}


async def test_a_turn_taken_at_once_is_the_gate_held_and_release_hands_it_to_the_next_input() -> None:
    gates = SessionGates()
    control = RunControl()
    assert gates.take(KEY, None, control)  # uncontended, a store with no lock: no wait at all
    assert gates.busy(KEY) and gates.active[KEY] is control
    assert not gates.take(KEY)  # held: a second input must hold (wait, refuse or interrupt)
    log: list[str] = []
    release = asyncio.Event()
    waiter = asyncio.create_task(hold_and_log(gates, "b", log, release))
    await asyncio.sleep(0.01)
    assert log == []
    gates.release(KEY, control)
    assert KEY not in gates.active
    await asyncio.sleep(0.01)
    assert log == ["b in"]
    release.set()
    await asyncio.wait_for(waiter, 1)
    assert gates._gates == {}

    class Locking:  # a store that serialises the session across processes
        @contextlib.asynccontextmanager
        async def session_lock(self, user_id: str, session_id: str) -> AsyncIterator[None]:
            yield

    assert not gates.take(KEY, Locking())  # its lock is taken by `hold`, never skipped
    assert gates._gates == {}
