"""The smallest cases of what tests/server/test_kills_random.py found, each pinned: serve processes
SIGKILLed at random moments, and their Redis killed and started again, mid-run."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from agentscope_py import ModelStep, ReActAgent, ScriptedModel
from agentscope_py.agent import InMemoryStateStore
from agentscope_py.errors import StateConflictError, StateStoreError
from agentscope_py.server import RedisRunLog, create_app

from .conftest import agui_events, run_input, scripted_agent, user
from .test_runs import parse


class DownAtTheSave(InMemoryStateStore):
    """Loads; its saves fail as a Redis that went away does (the message names the host)."""

    def __init__(self, error: Exception | None = None) -> None:
        super().__init__()
        self.error = error or StateStoreError("saving session u/s to Redis failed: ConnectionError: Error 111 "
                                              "connecting to 10.0.0.7:6379. Connection refused.")

    async def save(self, user_id: str, session_id: str, state: Any, expected_version: int) -> int:
        raise self.error


def test_a_store_that_fails_under_a_run_ends_it_with_a_typed_clear_error_not_an_internal_one() -> None:
    """Redis killed mid-run: the save at the run's end fails. The client's last frame says the
    session store failed (code ``StateStoreUnavailable``, as a store failing before the run says
    it) and that the turn may be missing; the store's own message, with its host, stays in the log."""
    agent = scripted_agent(ModelStep.text("hello"), loop=True, state_store=DownAtTheSave())
    with TestClient(create_app(agent)) as client:
        native = parse(client.post("/v1/runs", json={"session_id": "s", "input": "hi"}).text)
        agui = agui_events(client.post("/agui", json=run_input("t", user("hi"))).text)
    _, event, last = native[-1]
    assert event == "error" and last["code"] == "StateStoreUnavailable", last
    assert agui[-1]["type"] == "RUN_ERROR" and agui[-1]["code"] == "StateStoreUnavailable", agui[-1]
    for message in (last["message"], agui[-1]["message"]):
        assert message.startswith("the session store failed during the run, so its turn may not be saved")
        assert "10.0.0.7" not in message and "request id req_" in message


def test_a_conflict_at_the_save_says_another_run_saved_the_session() -> None:
    """Redis restarted empty under a run: the session's lock went with it, so a new input through
    another process ran the session while the first run, stopped, saved its interrupted turn; the
    new run's save then met a newer version. Its client hears that (``StateConflictError``: this
    turn was not saved, send it again), not "the run failed on the server"."""
    agent = scripted_agent(ModelStep.text("hello"), loop=True,
                           state_store=DownAtTheSave(StateConflictError("u", "s", 0, 1)))
    with TestClient(create_app(agent)) as client:
        native = parse(client.post("/v1/runs", json={"session_id": "s", "input": "hi"}).text)
        agui = agui_events(client.post("/agui", json=run_input("t", user("hi"))).text)
    _, event, last = native[-1]
    assert event == "error" and last["code"] == "StateConflictError", last
    assert agui[-1]["type"] == "RUN_ERROR" and agui[-1]["code"] == "StateConflictError", agui[-1]
    for message in (last["message"], agui[-1]["message"]):
        assert message.startswith("another run saved this session while this one ran")
        assert "this turn was not saved; send it again" in message and "version" not in message


@pytest.mark.redis
@pytest.mark.timeout(60)
async def test_a_run_the_log_lost_while_it_ran_says_so_not_that_its_log_expired(
        live: Any, redis_url: str, redis_prefix: str) -> None:
    """A Redis restarted without its data (here: the run's keys deleted) under a run in progress:
    the log refuses the run's next batch, as it does a run marked lost, and the run stops. Its own
    client hears why — the log lost the run, which was stopped — not that its log "expired while
    it was read", which a running run's log never does."""
    import redis as sync_redis

    model = ScriptedModel([ModelStep.text("".join(f"w{i} " for i in range(40)), chunks=40, delay=0.05)], loop=True)
    agent = ReActAgent.builder().model(model).build()
    server = live(create_app(agent, run_log=RedisRunLog(redis_url, prefix=redis_prefix)))
    async with httpx.AsyncClient(timeout=30) as client, client.stream(
            "POST", f"{server.url}/v1/runs", json={"session_id": "s", "input": "go"}) as r:
        run_id = r.headers["x-run-id"]
        body = ""
        async for chunk in r.aiter_text():
            body += chunk
            if body.count("\n\n") == 5:  # (the batch writes come every 20 ms: both keys are there)
                store = sync_redis.Redis.from_url(redis_url)
                assert store.delete(f"{redis_prefix}:run:{run_id}", f"{redis_prefix}:run:{run_id}:log") == 2
                store.close()
    _, event, last = parse(body)[-1]
    assert event == "error" and last["code"] == "RunLogExpired", last
    assert last["message"].startswith("the run log lost this run while it ran"), last["message"]
    state, _ = await agent.state_store.load("default", "s")
    assert state is not None and state.context[-1].generate_reason == "interrupted"
