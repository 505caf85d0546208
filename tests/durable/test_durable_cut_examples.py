"""The smallest cases test_durable_cuts.py found, each pinned (a worker in this process, the agent
of durable_cuts_agents.py on a SQLite store):

- an interrupt that lands after the run ended leaves it as it ended (it raised Temporal's
  ``RPCError`` "workflow execution already completed");
- a workflow replayed after its session was saved (a worker killed, or its cache evicted, between
  the save and the workflow's close) returns the reply the session holds, under the id the run's
  events gave it (its replay made ids of its own)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from durable_helpers import temporal_address
from temporalio.client import Client

from agentscope_py import Msg
from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.durable import DurableAgent, make_worker
from agentscope_py.events import AgentResult

__all__ = ["temporal_address"]  # a fixture, used by name

FACTORY = "durable_cuts_agents:build"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CUTS_STORE", str(tmp_path / "sessions.db"))
    monkeypatch.setenv("CUTS_EFFECTS", str(tmp_path / "effects"))
    monkeypatch.setenv("CUTS_MODEL_DELAY", "0")
    monkeypatch.setenv("CUTS_TOOL_SLEEP", "0")
    return tmp_path / "sessions.db"


@contextlib.asynccontextmanager
async def _agent(address: str, **worker_options: Any) -> AsyncIterator[DurableAgent]:
    client = await Client.connect(address)
    queue = f"q-{uuid.uuid4().hex[:8]}"
    async with make_worker(client, [FACTORY], task_queue=queue, **worker_options):
        yield DurableAgent(client, factory=FACTORY, task_queue=queue)


async def test_an_interrupt_after_the_run_ended_leaves_it_as_it_ended(temporal_address: str, store: Path) -> None:
    async with _agent(temporal_address) as agent:
        run = await agent.start("plan c0", session_id="s")
        reply = await run.result()
        await run.interrupt()
        await run.interrupt(rollback=True)
        assert (await run.result()).text == reply.text == "done c0"
        assert (await agent.call("plan c1", session_id="s")).text == "done c1"  # the session runs on


async def test_a_replayed_run_returns_the_reply_its_session_holds(temporal_address: str, store: Path) -> None:
    # No workflow cache: every workflow task replays the run from its history, as a new worker
    # does after a kill.
    async with _agent(temporal_address, max_cached_workflows=0) as agent:
        asked = Msg.user("plan c0 lookup")
        run = await agent.start(asked, session_id="s")
        reply = await run.result()
        [seen] = [ev.result for ev in await run.events() if type(ev) is AgentResult]
    async with SqliteStateStore(store) as db:
        state, _ = await db.load("default", "s")
    assert state is not None
    held = state.context[-1]
    assert (held.text, held.id) == (reply.text, reply.id) == (seen.text, seen.id)  # one reply, one id
    assert state.context[0].id == asked.id  # the caller's message keeps its id
