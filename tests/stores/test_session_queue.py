"""A session's queue in a store shared by several processes (Redis, one SQLite file): inputs take
the session in the order they reached the store whichever process (here: which store object, each
with its own connection and channel) they came through; the bound counts every process's; an
interrupting input goes first and stops the holder wherever it runs; a process that dies
(SIGKILL) leaves nothing blocking the queue past its lease; and two scripts calling
``agent.call`` on one store reach each other's runs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import BusyError, ModelStep, ReActAgent, RuntimeContext, ScriptedModel, tool
from agentscope_py.agent.sqlite_store import SqliteStateStore

pytestmark = pytest.mark.timeout(60)

PROC = Path(__file__).with_name("agent_proc.py")


class Stores:
    """Makes stores on one backend, as separate processes would have them."""

    def __init__(self, kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
        self.kind = kind
        self.made: list[Any] = []
        self._tmp_path = tmp_path
        self._request = request

    def __call__(self, **options: Any) -> Any:
        if self.kind == "sqlite":
            store: Any = SqliteStateStore(self._tmp_path / "queue.db", **options)
        else:
            from agentscope_py.agent.redis_store import RedisStateStore

            store = RedisStateStore(self._request.getfixturevalue("redis_url"),
                                    prefix=self._request.getfixturevalue("redis_prefix"), **options)
        self.made.append(store)
        return store


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Stores:
    return Stores(request.param, tmp_path, request)


@pytest.fixture
async def stores(make_store: Stores) -> AsyncIterator[list[Any]]:
    yield [make_store(), make_store()]
    for store in make_store.made:
        await store.close()


async def until(check: Callable[[], Any], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def waiting(store: Any, count: int, session: str = "s") -> Callable[[], Any]:
    async def check() -> bool:
        _, queued = await store.session_queue("u", session)
        return bool(queued == count)

    return check


async def take(store: Any, name: str, order: list[str], **options: Any) -> None:
    async with store.session_lock("u", "s", holder=name, **options):
        order.append(name)
        await asyncio.sleep(0.01)


async def test_inputs_take_the_session_in_arrival_order_whichever_process_they_came_through(
        stores: list[Any]) -> None:
    order: list[str] = []
    release = asyncio.Event()

    holder = asyncio.create_task(holding(stores[0], release, order, holder="first"))
    await until(lambda: _held(stores[1]))
    waiters = []
    for i in range(8):  # alternately through each process, each once the one before is queued
        waiters.append(asyncio.create_task(take(stores[i % 2], f"w{i}", order)))
        await until(waiting(stores[1], i + 1))
    assert await stores[0].session_queue("u", "s") == ("first", 8)
    release.set()
    await asyncio.wait_for(asyncio.gather(holder, *waiters), 20)
    assert order == ["first", *(f"w{i}" for i in range(8))]
    assert await stores[1].session_queue("u", "s") == (None, 0)


async def holding(store: Any, release: asyncio.Event, order: list[str] | None = None, **lock: Any) -> None:
    """Hold the session ``u/s`` until ``release`` is set (``"first"`` in ``order`` once held)."""
    async with store.session_lock("u", "s", **lock):
        if order is not None:
            order.append("first")
        await release.wait()


async def _held(store: Any) -> bool:
    return (await store.session_queue("u", "s"))[0] is not None


async def test_interrupting_inputs_go_first_and_stop_the_holder_in_its_process(stores: list[Any]) -> None:
    order: list[str] = []
    stops: list[bool] = []
    release = asyncio.Event()

    holder = asyncio.create_task(holding(stores[0], release, order, holder="first", on_interrupt=stops.append))
    await until(lambda: _held(stores[1]))
    queued = [asyncio.create_task(take(stores[1], "queued", order))]
    await until(waiting(stores[1], 1))
    queued.append(asyncio.create_task(take(stores[1], "interrupt", order, strategy="interrupt")))
    await until(lambda: _true(bool(stops)))
    assert stops == [False]  # heard in the holder's process, from the other one
    queued.append(asyncio.create_task(take(stores[0], "rollback", order, strategy="rollback")))
    await until(lambda: _true(True in stops))
    await until(waiting(stores[1], 3))
    release.set()
    await asyncio.wait_for(asyncio.gather(holder, *queued), 20)
    assert order == ["first", "interrupt", "rollback", "queued"]


async def _true(value: bool) -> bool:
    return value


async def test_the_bound_counts_the_inputs_waiting_in_every_process(stores: list[Any]) -> None:
    release = asyncio.Event()

    holder = asyncio.create_task(holding(stores[0], release))
    await until(lambda: _held(stores[1]))
    order: list[str] = []
    queued = [asyncio.create_task(take(stores[0], "a", order, max_queued=2))]
    await until(waiting(stores[1], 1))
    queued.append(asyncio.create_task(take(stores[1], "b", order, max_queued=2)))
    await until(waiting(stores[1], 2))
    for store in stores:
        with pytest.raises(BusyError) as full:
            await take(store, "c", order, max_queued=2)
        assert full.value.reason == "queue_full"
        with pytest.raises(BusyError) as busy:
            await take(store, "d", order, strategy="reject")
        assert busy.value.reason == "busy"
    release.set()
    await asyncio.wait_for(asyncio.gather(holder, *queued), 20)
    assert order == ["a", "b"]


async def test_a_waiter_cancelled_leaves_the_queue(stores: list[Any]) -> None:
    release = asyncio.Event()

    holder = asyncio.create_task(holding(stores[0], release))
    await until(lambda: _held(stores[1]))
    order: list[str] = []
    gone = asyncio.create_task(take(stores[1], "gone", order))
    await until(waiting(stores[1], 1))
    after = asyncio.create_task(take(stores[0], "after", order))
    await until(waiting(stores[1], 2))
    gone.cancel()
    await until(waiting(stores[1], 1))
    release.set()
    await asyncio.wait_for(asyncio.gather(holder, after), 5)
    assert order == ["after"] and gone.cancelled()


def _store_arg(make_store: Stores) -> list[str]:
    store = make_store.made[0]
    if make_store.kind == "sqlite":
        return ["--store", store.path]
    return ["--store", store.url, "--prefix", store.prefix]


@contextlib.contextmanager
def process(*args: str) -> Any:
    proc = subprocess.Popen([sys.executable, str(PROC), *args], stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("dies", ["holding", "waiting"])
async def test_a_process_killed_holding_or_waiting_blocks_the_queue_no_longer_than_its_lease(
        make_store: Stores, stores: list[Any], dies: str) -> None:
    """SIGKILL a process that holds the session, or that waits in its queue ahead of another
    input: the input behind it runs once the dead process's lease (1 s) ran out — when the store
    cannot know it died (the process records itself as of another host)."""
    release = asyncio.Event()
    mine: asyncio.Task[None] | None = None
    if dies == "waiting":
        mine = asyncio.create_task(holding(stores[0], release))
        await until(lambda: _held(stores[1]))
    with process("hold-lock", *_store_arg(make_store), "--lock-timeout", "1", "--other-host") as proc:
        if dies == "holding":
            assert proc.stdout is not None
            assert await asyncio.to_thread(proc.stdout.readline) == "locked\n"
        else:
            await until(waiting(stores[1], 1))
        order: list[str] = []
        behind = asyncio.create_task(take(stores[1], "behind", order))
        await until(waiting(stores[1], 2 if dies == "waiting" else 1))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed = time.monotonic()
        if dies == "waiting":  # its ticket stops counting once its lease ran out
            await until(waiting(stores[1], 1), 3)
            assert time.monotonic() - killed > 0.5
        release.set()
        await asyncio.wait_for(behind, 10)
        assert order == ["behind"]
        # Its lease (1 s) and a waiter's check or two, with a loaded machine's margin.
        assert time.monotonic() - killed < 4.0
    if mine is not None:
        await mine


@pytest.mark.parametrize("dies", ["holding", "waiting"])
async def test_a_process_known_dead_blocks_the_session_not_at_all_a_live_one_is_waited_for(
        make_store: Stores, dies: str) -> None:
    """A 30 s lease: a process of this host that holds the session (or waits in its queue ahead of
    another input) is waited for while it lives — stopped by SIGSTOP too, it is alive — and the
    input behind it takes the session within a second of its SIGKILL, not the lease."""
    ours, theirs = make_store(), make_store()
    release = asyncio.Event()
    order: list[str] = []

    mine = asyncio.create_task(holding(ours, release, holder="first")) if dies == "waiting" else None
    if mine is not None:
        await until(lambda: _held(theirs))
    with process("hold-lock", *_store_arg(make_store), "--lock-timeout", "30") as proc:
        assert proc.stdout is not None
        if dies == "holding":
            assert await asyncio.to_thread(proc.stdout.readline) == "locked\n"
        else:
            await until(waiting(theirs, 1))
        behind = asyncio.create_task(take(theirs, "behind", order))
        await until(waiting(theirs, 2 if dies == "waiting" else 1))
        proc.send_signal(signal.SIGSTOP)
        release.set()  # (waiting: the turn passes to the stopped process's ticket, ahead)
        if mine is not None:
            await mine
        await asyncio.sleep(1.0)
        assert not behind.done() and order == []  # alive, if stopped: its lock or ticket stands
        assert await theirs.session_queue("u", "s") == (("", 1) if dies == "holding" else (None, 2))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed = time.monotonic()
        await asyncio.wait_for(behind, 10)
        assert order == ["behind"]
        assert time.monotonic() - killed < 1.0
    await ours.close()
    await theirs.close()


@pytest.mark.parametrize("then", ["interrupt", "reject"])
async def test_a_holder_known_dead_is_no_holder(make_store: Stores, then: str) -> None:
    """A process of this host killed while it holds the session (a 30 s lease): the session has no
    holder at once; interrupting it interrupts nothing, and an input that refuses to wait
    (``reject``) takes it."""
    store = make_store()
    with process("hold-lock", *_store_arg(make_store), "--lock-timeout", "30") as proc:
        assert proc.stdout is not None
        assert await asyncio.to_thread(proc.stdout.readline) == "locked\n"
        assert await store.session_queue("u", "s") == ("", 0)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert await store.session_queue("u", "s") == (None, 0)
    if then == "interrupt":
        assert await store.interrupt_session("u", "s") is False
    else:
        async with asyncio.timeout(1.0), store.session_lock("u", "s", strategy="reject", holder="new"):
            assert await store.session_queue("u", "s") == ("new", 0)
    await store.close()


@pytest.mark.parametrize("strategy", ["interrupt", "rollback"])
async def test_a_script_interrupts_the_run_of_another_script_on_the_same_store(
        make_store: Stores, stores: list[Any], strategy: str) -> None:
    """Two scripts calling ``agent.call`` on one store: the second one's input, sent with
    ``multitask_strategy="interrupt"`` / ``"rollback"``, stops the first one's run (in this
    process) through the store."""
    started = asyncio.Event()

    @tool
    async def wait_long() -> str:
        """Wait a long time."""
        started.set()
        await asyncio.sleep(30)
        return "waited"

    model = ScriptedModel([ModelStep.tool_call("wait_long", {}), ModelStep.text("never")])
    agent = ReActAgent(model=model, tools=[wait_long], state_store=stores[0])
    first = asyncio.create_task(agent.call("first", ctx=RuntimeContext("u", "s")))
    await started.wait()
    with process("turn", *_store_arg(make_store), "--say", "second", "--reply", "done",
                 "--strategy", strategy) as proc:
        out, _ = await asyncio.to_thread(proc.communicate, None, 20)
    stopped = await asyncio.wait_for(first, 10)
    assert stopped.generate_reason == "interrupted"
    assert bool(stopped.metadata.get("rolled_back")) is (strategy == "rollback")
    second = json.loads(out.strip().splitlines()[-1])
    assert second["reply"] == "done"
    state, _ = await stores[1].load("u", "s")
    assert state is not None
    users = [m.text for m in state.context if m.role == "user"]
    assert users == (["second"] if strategy == "rollback" else ["first", "second"])


async def test_interrupt_session_stops_the_holder_in_another_process(stores: list[Any]) -> None:
    """``interrupt_session`` (what ``POST /v1/interrupt`` falls back to): the run holding the
    session, wherever it runs, hears it; no input takes a place in the queue."""
    stops: list[bool] = []
    release = asyncio.Event()

    assert await stores[1].interrupt_session("u", "s") is False  # nobody holds it
    holder = asyncio.create_task(holding(stores[0], release, on_interrupt=stops.append))
    await until(lambda: _held(stores[1]))
    assert await stores[1].interrupt_session("u", "s") is True
    await until(lambda: _true(bool(stops)))
    assert stops == [False]
    assert await stores[1].interrupt_session("u", "s", rollback=True) is True
    await until(lambda: _true(True in stops))
    assert await stores[1].session_queue("u", "s") == ("", 0)
    release.set()
    await holder


async def test_in_one_process_an_interrupting_call_stops_the_run_through_the_store(stores: list[Any]) -> None:
    """One agent on a store that keeps the queue: its own second call, with
    ``multitask_strategy="rollback"``, stops its first one through the store (the same path as
    from another process), and a call queued before it runs after it, whole."""
    started = asyncio.Event()

    @tool
    async def wait_long() -> str:
        """Wait a long time."""
        started.set()
        await asyncio.sleep(30)
        return "waited"

    def turn(request: Any) -> ModelStep:
        return ModelStep.tool_call("wait_long", {}) if request.messages[-1].text == "first" else ModelStep.text("ok")

    agent = ReActAgent(model=ScriptedModel([ModelStep(respond=turn)], loop=True), tools=[wait_long],
                       state_store=stores[0])
    first = asyncio.create_task(agent.call("first", ctx=RuntimeContext("u", "s")))
    await started.wait()
    queued = asyncio.create_task(agent.call("queued", ctx=RuntimeContext("u", "s")))
    await until(waiting(stores[1], 1))
    second = await asyncio.wait_for(agent.call("second", ctx=RuntimeContext("u", "s"),
                                              multitask_strategy="rollback"), 10)
    stopped, last = await asyncio.wait_for(asyncio.gather(first, queued), 10)
    assert stopped.generate_reason == "interrupted" and stopped.metadata["rolled_back"]
    assert second.text == "ok" and last.text == "ok"
    state, _ = await stores[1].load("u", "s")
    assert state is not None
    assert [m.text for m in state.context if m.role == "user"] == ["second", "queued"]


class _GatedPubSub:
    """A pubsub whose subscription is confirmed once ``gate`` is set."""

    def __init__(self, gate: asyncio.Event) -> None:
        self.gate = gate

    async def subscribe(self, channel: str) -> None:
        await self.gate.wait()

    async def get_message(self, timeout: float | None = None, ignore_subscribe_messages: bool = False) -> Any:  # noqa: ASYNC109 (redis-py's signature)
        if ignore_subscribe_messages:  # (the listening loop: nothing to hear)
            await asyncio.sleep(timeout or 0)
            return None
        return {"type": "subscribe"}

    async def aclose(self) -> None:
        pass


class _GatedClient:
    def __init__(self, gate: asyncio.Event) -> None:
        self.gate = gate

    def pubsub(self) -> _GatedPubSub:
        return _GatedPubSub(self.gate)


async def test_a_caller_cancelled_while_subscribing_the_listener_does_not_cancel_another_waiting_for_it() -> None:
    # Two runs of one process enter a Redis session queue at once; the first, which subscribes
    # the process's channel, is cancelled meanwhile: the second, not cancelled, subscribes itself.
    from agentscope_py.agent._redis_session_queue import Listener

    gate = asyncio.Event()
    listener = Listener(_GatedClient(gate), "agentscope:q:", 5.0)  # type: ignore[arg-type]
    first = asyncio.ensure_future(listener.ready())
    await asyncio.sleep(0)
    second = asyncio.ensure_future(listener.ready())
    await asyncio.sleep(0)
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first
    gate.set()
    await asyncio.wait_for(second, 5)
    assert listener._task is not None
    await listener.close()
