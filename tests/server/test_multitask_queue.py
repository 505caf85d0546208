"""The session's queue across two ``agentscope-py serve`` processes sharing their sessions (one
redis-server, or one SQLite file): enqueued inputs run in the order they arrived whichever process
took them, ``max_queued`` bounds the inputs waiting in both, an interrupting input stops the run
in flight and goes ahead of the inputs queued before it (never stopping one of them instead),
a process SIGKILLed while it holds the session or waits in its queue blocks it no longer than
its lease, and ``POST /v1/interrupt`` reaches the session's run in the other process."""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentscope_py.agent import RedisStateStore
from agentscope_py.agent.sqlite_store import SqliteStateStore

from .test_cli_serve import Serving
from .test_runs import parse

pytestmark = pytest.mark.timeout(120)

LEASE = 1.5
"""The stores' ``lock_timeout`` in the served processes: how long a dead process's lock or
tickets last."""

AGENTS = f'''
import asyncio
import os

from agentscope_py import ReActAgent, tool
from agentscope_py.message import ToolResultBlock
from agentscope_py.model.base import ChatChunk, ToolCallChunk


class TurnModel:
    """A call of ``work`` (for an input starting "slow": until the test says, else 2 steps), then
    a text."""

    name = "turns"

    async def stream(self, request):
        last = request.messages[-1]
        if any(isinstance(b, ToolResultBlock) for b in last.content):
            yield ChatChunk(text="done")
            yield ChatChunk(finish_reason="stop")
            return
        n = -1 if last.text.startswith("slow") else 2
        yield ChatChunk(tool_call=ToolCallChunk(index=0, id="call-" + os.urandom(4).hex(), name="work",
                                                arguments='{{"n": %d}}' % n))
        yield ChatChunk(finish_reason="tool_calls")


@tool(idempotent=True)  # (it only waits: a run killed in it leaves no call in doubt)
async def work(n: int) -> str:
    """Work for ``n`` steps; -1: until the file TURN_RELEASE exists."""
    if n < 0:
        while not os.path.exists(os.environ["TURN_RELEASE"]):
            await asyncio.sleep(0.02)
    for _ in range(n):
        await asyncio.sleep(0.05)
    return "worked"


def build():
    where = os.environ["TURN_STORE"]
    if where.startswith("redis://"):
        from agentscope_py.agent import RedisStateStore

        store = RedisStateStore(where, prefix=os.environ["TURN_PREFIX"], lock_timeout={LEASE})
    else:
        from agentscope_py.agent.sqlite_store import SqliteStateStore

        store = SqliteStateStore(where, lock_timeout={LEASE})
    return ReActAgent(model=TurnModel(), tools=[work], state_store=store,
                      max_queued=int(os.environ.get("TURN_MAX_QUEUED", "100")))
'''


@pytest.fixture(params=[pytest.param("redis", marks=pytest.mark.redis), "sqlite"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def where(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, str]:
    if backend == "redis":
        return {"TURN_STORE": request.getfixturevalue("redis_url"), "TURN_PREFIX": request.getfixturevalue("redis_prefix")}
    return {"TURN_STORE": str(tmp_path / "sessions.db")}


@pytest.fixture
def start(tmp_path: Path, where: dict[str, str], backend: str) -> Iterator[Callable[..., list[Serving]]]:
    (tmp_path / "queue_agents.py").write_text(textwrap.dedent(AGENTS))
    started: list[Serving] = []

    def two(**env: str) -> list[Serving]:
        # With Redis, the run logs are shared too (a run's events through either process).
        shared = ["--redis", where["TURN_STORE"], "--redis-prefix", where["TURN_PREFIX"]] if backend == "redis" else []
        servers = [Serving("queue_agents:build", *shared, "--log-level", "warning", cwd=tmp_path,
                           env={"PYTHONPATH": os.getcwd(), "TURN_RELEASE": str(tmp_path / "release"), **where, **env})
                   for _ in range(2)]
        started.extend(servers)
        for s in servers:
            s.wait_for_url()
        return servers

    yield two
    for s in started:
        if s.proc.poll() is None:
            print(f"serve on {s.port}:", s.stop())


@pytest.fixture
async def store(backend: str, where: dict[str, str]) -> AsyncIterator[Any]:
    shared: Any = (RedisStateStore(where["TURN_STORE"], prefix=where["TURN_PREFIX"]) if backend == "redis"
                   else SqliteStateStore(where["TURN_STORE"]))
    yield shared
    await shared.close()


async def until(check: Callable[[], Any], seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def queue_is(store: Any, holder: bool, waiting: int) -> Callable[[], Any]:
    async def check() -> bool:
        name, queued = await store.session_queue("default", "s")
        return (name is not None) == holder and queued == waiting

    return check


def release(tmp_path: Path) -> None:
    """The "slow" runs' tool returns."""
    (tmp_path / "release").touch()


def send(client: httpx.AsyncClient, server: Serving, text: str, strategy: str = "enqueue") -> asyncio.Task[Any]:
    return asyncio.create_task(client.post(f"{server.url}/v1/runs", json={"session_id": "s", "input": text,
                                                                          "multitask_strategy": strategy}))


def result(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    found = [d["result"] for _, _, d in parse(response.text) if d.get("type") == "agent_result"]
    assert len(found) == 1, response.text[-500:]
    return found[0]


async def users(store: Any) -> list[str]:
    state, _ = await store.load("default", "s")
    assert state is not None
    return [m.text for m in state.context if m.role == "user"]


async def test_enqueued_inputs_run_in_arrival_order_whichever_process_took_them(
        start: Callable[..., list[Serving]], store: Any, tmp_path: Path) -> None:
    a, b = start()
    async with httpx.AsyncClient(timeout=60) as client:
        first = send(client, a, "slow first")
        await until(queue_is(store, True, 0))
        queued = []
        for i in range(6):  # alternately through each process, each once the one before is queued
            queued.append(send(client, (a, b)[i % 2], f"m{i}"))
            await until(queue_is(store, True, i + 1))
        release(tmp_path)
        answers = await asyncio.gather(first, *queued)
    assert all(result(r)["generate_reason"] == "model_stop" for r in answers)
    assert await users(store) == ["slow first", *(f"m{i}" for i in range(6))]


async def test_max_queued_bounds_the_inputs_waiting_in_every_process(start: Callable[..., list[Serving]],
                                                                    store: Any, tmp_path: Path) -> None:
    a, b = start(TURN_MAX_QUEUED="2")
    async with httpx.AsyncClient(timeout=60) as client:
        first = send(client, a, "slow first")
        await until(queue_is(store, True, 0))
        queued = [send(client, a, "m0")]
        await until(queue_is(store, True, 1))
        queued.append(send(client, b, "m1"))
        await until(queue_is(store, True, 2))
        for server in (a, b):  # one each: neither process's own count is full
            refused = await client.post(f"{server.url}/v1/runs", json={"session_id": "s", "input": "one more"})
            assert refused.status_code == 409 and refused.json()["type"] == "session_busy", refused.text
            assert "queue of waiting inputs is full" in refused.json()["detail"]
            assert refused.headers["retry-after"]
        release(tmp_path)
        answers = await asyncio.gather(first, *queued)
    assert [result(r)["generate_reason"] for r in answers] == ["model_stop"] * 3
    assert await users(store) == ["slow first", "m0", "m1"]


@pytest.mark.parametrize("strategy", ["interrupt", "rollback"])
async def test_an_interrupt_stops_the_run_in_flight_not_an_input_queued_in_its_process(
        start: Callable[..., list[Serving]], store: Any, strategy: str) -> None:
    """The run in flight runs in one process; an input queued before the interrupting one waits
    in the other (its run started, but has not taken the session): the interrupt stops the run in
    flight, and goes ahead of the queued input, which then runs whole."""
    a, b = start()
    async with httpx.AsyncClient(timeout=60) as client:
        first = send(client, a, "slow first")
        await until(queue_is(store, True, 0))
        queued = send(client, b, "queued")
        await until(queue_is(store, True, 1))
        interrupting = send(client, b, "interrupting", strategy)
        one, two, three = await asyncio.gather(first, interrupting, queued)
    stopped = result(one)
    assert stopped["generate_reason"] == "interrupted"
    assert bool(stopped["metadata"].get("rolled_back")) is (strategy == "rollback")
    assert result(two)["generate_reason"] == "model_stop"
    assert result(three)["generate_reason"] == "model_stop"  # not stopped: it had not run
    expected = ["interrupting", "queued"] if strategy == "rollback" else ["slow first", "interrupting", "queued"]
    assert await users(store) == expected


@pytest.mark.parametrize("dies", ["holding", "waiting"])
async def test_a_process_killed_while_it_holds_or_waits_blocks_the_session_no_longer_than_its_lease(
        start: Callable[..., list[Serving]], store: Any, dies: str, tmp_path: Path) -> None:
    a, b = start()
    async with httpx.AsyncClient(timeout=60) as client:
        first = send(client, a, "slow first")
        await until(queue_is(store, True, 0))
        if dies == "holding":
            behind = send(client, b, "behind")
            await until(queue_is(store, True, 1))
            victim = a
        else:
            doomed = send(client, b, "doomed")
            await until(queue_is(store, True, 1))
            behind = send(client, a, "behind")
            await until(queue_is(store, True, 2))
            victim = b
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        killed = time.monotonic()
        release(tmp_path)
        answer = await behind
        took = time.monotonic() - killed
        dropped = [first if dies == "holding" else doomed]
        for cut in await asyncio.gather(*dropped, return_exceptions=True):
            assert isinstance(cut, httpx.HTTPError | httpx.Response)
    assert result(answer)["generate_reason"] == "model_stop"
    # holding: the lock's lease, then the run (0.1 s); waiting: the dead ticket's lease (the slow
    # run ends at once).
    assert took < LEASE + 2.0, took
    texts = await users(store)
    assert texts[-1] == "behind" and "doomed" not in texts


async def test_a_session_interrupt_through_the_other_process_stops_its_run(start: Callable[..., list[Serving]],
                                                                           store: Any) -> None:
    """``POST /v1/interrupt`` by session, sent to a process that does not run the session's run:
    the run stops where it runs, through the store."""
    a, b = start()
    async with httpx.AsyncClient(timeout=60) as client:
        first = send(client, a, "slow first")
        await until(queue_is(store, True, 0))
        stopped = await client.post(f"{b.url}/v1/interrupt", json={"session_id": "s"})
        assert stopped.json() == {"interrupted": True}
        assert result(await first)["generate_reason"] == "interrupted"
        idle = await client.post(f"{b.url}/v1/interrupt", json={"session_id": "s"})
        assert idle.json() == {"interrupted": False}
