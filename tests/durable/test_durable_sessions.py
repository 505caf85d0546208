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
from durable_helpers import Workers, activity_names, model_server, requests, temporal_address, wait_lines
from temporalio.client import Client

from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.agent.state import AgentState
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
    assert await activity_names(client, two.id, two.handle.run_id) == [
        LOAD_STATE_ACTIVITY, MODEL_ACTIVITY, TOOL_ACTIVITY, MODEL_ACTIVITY, SAVE_STATE_ACTIVITY]
    assert one.id == two.id and one.run_id != two.run_id  # one workflow id per session, a run id per run
    latest = await agent.session("alice", "chat")  # found from the session alone (another process)
    assert latest.run_id == two.run_id and (await latest.result()).text == "The answer is 42."


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


async def test_a_session_another_writer_saved_meanwhile_fails_the_run_with_a_conflict(
        temporal_address: str, model_server: tuple[str, Path], workers: Workers, store: Path,
        tmp_path: Path) -> None:
    from temporalio.client import WorkflowFailureError

    queue, down = _queue(), tmp_path / "store_down"
    down.touch()
    workers.start(FACTORY, queue)
    client = await Client.connect(temporal_address)
    run = await DurableAgent(client, factory=FACTORY, task_queue=queue).start("2 + 40?", session_id="both")
    await asyncio.to_thread(wait_lines, down, 1)  # the run's save waits for the store
    async with SqliteStateStore(store) as db:  # a local agent saves the session meanwhile
        await db.save("default", "both", AgentState(user_id="default", session_id="both"), 0)
    down.unlink()
    async with asyncio.timeout(30):
        with pytest.raises(WorkflowFailureError) as caught:
            await run.result()
    assert "StateConflictError" in repr(caught.value.cause) or "moved" in str(caught.value.cause)
    assert await _context(store, "default", "both") == []  # the other writer's state stands


async def test_a_save_retried_after_it_succeeded_finds_its_own_state(
        store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from temporalio.testing import ActivityEnvironment

    from agentscope_py.durable._factory import check_factory
    from agentscope_py.durable._sessions import save_state_activity

    monkeypatch.setenv("DURABLE_STORE", str(store))
    monkeypatch.setenv("DURABLE_MODEL_URL", "http://127.0.0.1:9/v1")
    check_factory(FACTORY)  # this process's worker agent, on this test's store
    state = AgentState(user_id="u", session_id="s", summary="one turn")
    payload = {"factory": FACTORY, "user_id": "u", "session_id": "s", "state": state.to_json(), "version": 0}
    env = ActivityEnvironment()
    try:
        assert await env.run(save_state_activity, payload) == 1
        # the attempt that saved died before reporting it: the retry is the same save
        assert await env.run(save_state_activity, payload) == 1
        other = {**payload, "state": AgentState(user_id="u", session_id="s", summary="another").to_json()}
        with pytest.raises(Exception, match="moved") as caught:  # a different state at that version
            await env.run(save_state_activity, other)
        assert getattr(caught.value, "non_retryable", False)
    finally:
        check_factory(FACTORY)


@pytest.mark.redis
async def test_a_session_in_redis_is_shared_by_workers_on_other_processes(
        temporal_address: str, model_server: tuple[str, Path], workers: Workers, redis_url: str) -> None:
    from agentscope_py.agent.redis_store import RedisStateStore

    queue, prefix = _queue(), f"durable-{uuid.uuid4().hex[:8]}"
    env = {"DURABLE_REDIS_URL": redis_url, "DURABLE_PREFIX": prefix}
    first = workers.start("durable_agents:build_redis", queue, **env)
    client = await Client.connect(temporal_address)
    agent = DurableAgent(client, factory="durable_agents:build_redis", task_queue=queue)
    async with asyncio.timeout(30):
        assert (await agent.call("2 + 40?", user_id="bob", session_id="r")).text == "The answer is 42."
        first.kill()
        first.wait(5)
        workers.start("durable_agents:build_redis", queue, **env)
        assert (await agent.call("again?", user_id="bob", session_id="r")).text == "The answer is 42."
    assert _seen(model_server[1])[2][-5:] == [*TURN, "user"]
    async with RedisStateStore(redis_url, prefix=prefix) as db:
        state, version = await db.load("bob", "r")
    assert state is not None and [m.role for m in state.context] == TURN * 2 and version == 2


async def test_session_ids_are_distinct_and_a_bad_if_busy_fails_at_start(temporal_address: str) -> None:
    from agentscope_py.durable import session_workflow_id

    # a separator inside an id cannot make two sessions share a workflow (and so a gate)
    assert session_workflow_id("m:f", "a/b", "c") != session_workflow_id("m:f", "a", "b/c")
    agent = DurableAgent(await Client.connect(temporal_address), factory=FACTORY)
    with pytest.raises(ValueError, match="if_busy"):
        await agent.start("hi", if_busy="queue")  # type: ignore[arg-type]


async def test_an_answer_sent_while_the_asking_turn_still_saves_is_taken(
        temporal_address: str, model_server: tuple[str, Path], workers: Workers, store: Path,
        tmp_path: Path) -> None:
    from agentscope_py.events import ConfirmResult

    queue, down = _queue(), tmp_path / "store_down"
    down.touch()
    workers.start("durable_agents:build_sqlite_asking", queue)
    client = await Client.connect(temporal_address)
    run = await DurableAgent(client, factory="durable_agents:build_sqlite_asking", task_queue=queue).start("2 + 40?")
    await asyncio.to_thread(wait_lines, down, 1)  # the asking turn is over but not saved yet
    asking = await run.asking()  # (what a caller watching the events sees asking)
    assert [c.name for c in asking] == ["add"] and not await run.waiting()
    await run.confirm(ConfirmResult(tool_call_id=asking[0].id, confirmed=True))
    down.unlink()
    async with asyncio.timeout(30):
        assert (await run.result()).text == "The answer is 42."
    assert await _context(store, "default", "default") == TURN
    assert requests(model_server[1]) == 2
