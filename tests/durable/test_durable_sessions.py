"""A session's durable runs remember each other through the agent's own store (SQLite, on the
workers), across worker restarts; one run per session at a time; a save that fails is retried
until the store is back, and no turn is lost."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from durable_helpers import Workers, model_server, requests, temporal_address, wait_lines
from temporalio.client import Client

from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.durable import (
    LOAD_STATE_ACTIVITY,
    MODEL_ACTIVITY,
    SAVE_STATE_ACTIVITY,
    TOOL_ACTIVITY,
    DurableAgent,
    DurableSessionBusy,
)

__all__ = ["model_server", "temporal_address"]  # fixtures, used by name

FACTORY = "durable_agents:build_sqlite"
TURN = ["user", "assistant", "tool", "assistant"]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "sessions.db"


@pytest.fixture
def workers(temporal_address: str, model_server: tuple[str, Path], tmp_path: Path, store: Path) -> Iterator[Workers]:
    procs = Workers(temporal_address, {"DURABLE_MODEL_URL": model_server[0], "DURABLE_STORE": str(store),
                                       "DURABLE_TOOL_LOG": str(tmp_path / "tool_log"),
                                       "DURABLE_STORE_DOWN": str(tmp_path / "store_down")})
    yield procs
    procs.close()


def _queue() -> str:
    return f"q-{uuid.uuid4().hex[:8]}"


def _seen(count: Path) -> list[list[str]]:
    """The roles of the messages each model request carried."""
    return [json.loads(line) for line in Path(f"{count}.messages").read_text().splitlines()]


async def _context(store: Path, user_id: str, session_id: str) -> list[str]:
    async with SqliteStateStore(store) as db:
        state, _ = await db.load(user_id, session_id)
    return [] if state is None else [m.role for m in state.context]


async def _activities(client: Client, workflow_id: str, run_id: str) -> list[str]:
    names = []
    async for event in client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history_events():
        if event.HasField("activity_task_scheduled_event_attributes"):
            names.append(event.activity_task_scheduled_event_attributes.activity_type.name)
    return names


async def test_a_second_run_remembers_the_first_across_a_worker_restart(
        temporal_address: str, model_server: tuple[str, Path], workers: Workers, store: Path) -> None:
    queue = _queue()
    first = workers.start(FACTORY, queue)
    client = await Client.connect(temporal_address)
    agent = DurableAgent(client, factory=FACTORY, task_queue=queue)
    async with asyncio.timeout(30):
        one = await agent.start("2 + 40?", user_id="alice", session_id="chat")
        assert (await one.result()).text == "The answer is 42."
    first.kill()  # the session lives in the store, not in a worker
    first.wait(5)
    workers.start(FACTORY, queue)
    async with asyncio.timeout(30):
        two = await agent.start("and again?", user_id="alice", session_id="chat")
        assert (await two.result()).text == "The answer is 42."
        other = await agent.call("2 + 40?", user_id="alice", session_id="another")
    assert other.text == "The answer is 42."
    seen = _seen(model_server[1])
    # the second run's first model request carried the first run's turn before its own message
    assert seen[2][-5:] == [*TURN, "user"] and seen[2].count("user") == 2
    assert seen[4].count("user") == 1  # another session starts empty
    assert await _context(store, "alice", "chat") == TURN * 2
    # the session is loaded and saved by activities, around the turn's own steps
    assert await _activities(client, two.id, two.handle.run_id or "?") == [
        LOAD_STATE_ACTIVITY, MODEL_ACTIVITY, TOOL_ACTIVITY, MODEL_ACTIVITY, SAVE_STATE_ACTIVITY]
    assert one.id == two.id and one.run_id != two.run_id  # one workflow id per session, a run id per run


async def test_one_run_per_session_at_a_time(
        temporal_address: str, model_server: tuple[str, Path], workers: Workers, store: Path) -> None:
    queue = _queue()
    workers.start(FACTORY, queue, DURABLE_TOOL_SLEEP="1.5")
    client = await Client.connect(temporal_address)
    agent = DurableAgent(client, factory=FACTORY, task_queue=queue)
    async with asyncio.timeout(40):
        first = await agent.start("2 + 40?", session_id="busy", run_id="run-1")
        with pytest.raises(DurableSessionBusy) as caught:
            await agent.start("again?", session_id="busy")
        assert caught.value.run_id == "run-1" and caught.value.session_id == "busy"
        again = await agent.start("2 + 40?", session_id="busy", run_id="run-1")  # a retried start
        assert again.handle.run_id == first.handle.run_id
        # other sessions are not held up
        assert (await agent.call("2 + 40?", session_id="free")).text == "The answer is 42."
        waited = await agent.start("again?", session_id="busy", if_busy="wait")  # starts once run-1 ends
        assert (await waited.result()).text == "The answer is 42."
        assert (await first.result()).text == "The answer is 42."
    # both turns are in the session, one after the other (the second saw the first)
    assert await _context(store, "default", "busy") == TURN * 2
    assert requests(model_server[1]) == 6


async def test_a_failing_save_is_retried_until_the_store_is_back_and_no_turn_is_lost(
        temporal_address: str, model_server: tuple[str, Path], workers: Workers, store: Path,
        tmp_path: Path) -> None:
    queue, down = _queue(), tmp_path / "store_down"
    down.touch()
    first = workers.start(FACTORY, queue)
    client = await Client.connect(temporal_address)
    agent = DurableAgent(client, factory=FACTORY, task_queue=queue)
    run = await agent.start("2 + 40?", session_id="flaky")
    await asyncio.to_thread(wait_lines, down, 3)  # the save failed three times: the run waits
    assert requests(model_server[1]) == 2
    with pytest.raises(DurableSessionBusy):  # the turn is not saved yet: the session stays the run's
        await agent.start("again?", session_id="flaky")
    first.kill()  # even the worker goes; the retries go on with the next one
    first.wait(5)
    workers.start(FACTORY, queue)
    down.unlink()
    async with asyncio.timeout(30):
        assert (await run.result()).text == "The answer is 42."
    assert await _context(store, "default", "flaky") == TURN
    assert requests(model_server[1]) == 2  # the turn was not run again
