"""Double texting on durable runs. Served (real processes: the Temporal dev server, Redis, a
worker, a serve process, the holding model server): while a session's workflow runs, a second
input with ``multitask_strategy="reject"`` is a 409 with ``Retry-After`` (AG-UI: its RUN_ERROR
code ``session_busy``), one with ``"interrupt"`` stops the running run — its turn ends
interrupted, every block closed — and runs right after it. In code (`DurableAgent.start`, a
worker in this process, a SQLite store): each strategy, the agent's default, the queue bound,
and ``"rollback"`` taking the interrupted turn out of the session, its events marked; served
with no strategy in the request, the agent's default applies."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from durable_helpers import Workers, free_port, temporal_address
from durable_live_helpers import Frame, Serves, held_model, queue, serves, sse, workers
from temporalio.client import Client
from test_durable_live_serve import _answering, _text

from agentscope_py import GenerateReason
from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.durable import DurableAgent, DurableSessionBusy, MemoryEventLog, make_worker
from agentscope_py.events import AgentEnd, AgentResult
from agentscope_py.server import DurableServing, create_app

__all__ = ["held_model", "queue", "serves", "temporal_address", "workers"]  # fixtures, used by name

pytestmark = pytest.mark.timeout(120)


async def test_reject_is_a_409_and_interrupt_runs_next_on_a_durable_session(
        held_model: tuple[str, Path], workers: Workers, serves: Serves, queue: str, redis_url: str) -> None:
    worker = workers.spawn("durable_agents:build", queue, "--events", redis_url)
    url, _ = serves.start(queue)
    workers.ready(worker)
    async with asyncio.timeout(60), httpx.AsyncClient(timeout=30) as http, \
            _answering(http, url) as (first_id, frames, seen):
        rejected = await http.post(url + "/v1/runs", json={"session_id": "s1", "input": "again?",
                                                           "multitask_strategy": "reject"})
        agui = await http.post(url + "/agui", json={
            "threadId": "s1", "runId": "agui-2", "state": {}, "tools": [], "context": [],
            "forwardedProps": {"multitask_strategy": "reject"},
            "messages": [{"id": "m2", "role": "user", "content": "again?"}]})
        # The interrupting input: its run starts once the first one's turn ended interrupted.
        async with http.stream("POST", url + "/v1/runs", json={"session_id": "s1", "input": "2 + 40?",
                                                                "multitask_strategy": "interrupt"}) as answer:
            assert answer.status_code == 200, await answer.aread()
            after = [f async for f in sse(answer.aiter_lines())]
        seen += [f async for f in frames]
    assert rejected.status_code == 409 and rejected.headers["retry-after"] == "1", rejected.text
    assert rejected.json()["type"] == "session_busy" and first_id in rejected.json()["detail"]
    assert agui.status_code == 409 and agui.headers["retry-after"] == "1", agui.text
    agui_events = [json.loads(line[6:]) for line in agui.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in agui_events] == ["RUN_STARTED", "RUN_ERROR"]
    assert agui_events[1]["code"] == "session_busy"
    first = next(f.data["result"] for f in seen if f.data.get("type") == "agent_result")
    assert first["generate_reason"] == "interrupted"
    kinds = [f.data.get("type") for f in seen]
    assert kinds.count("text_block_start") == kinds.count("text_block_end"), kinds
    assert kinds.count("model_call_start") == kinds.count("model_call_end"), kinds
    assert _text(after) == "The answer is 42." and after[-1].data["type"] == "agent_end"
    assert all(isinstance(f, Frame) for f in after)


HOLDING = "durable_agents:build_holding"


@pytest.fixture
def holding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """The holding agents' SQLite store and tool log (the worker and the app are in this process)."""
    store, log = tmp_path / "sessions.db", tmp_path / "tool_log"
    monkeypatch.setenv("DURABLE_STORE", str(store))
    monkeypatch.setenv("DURABLE_TOOL_LOG", str(log))
    return store, log


@contextlib.asynccontextmanager
async def _worker(address: str, factory: str, events: MemoryEventLog | None = None,
                  ) -> AsyncIterator[tuple[Client, str]]:
    """A worker in this process on a queue of its own: the client and the queue."""
    client = await Client.connect(address)
    queue = f"q-{uuid.uuid4().hex[:8]}"
    async with make_worker(client, [factory], task_queue=queue, events=events):
        yield client, queue


async def _holds(log: Path, n: int) -> None:
    """Until the ``n``-th ``hold`` call has started on the worker (its run holds the session)."""
    async with asyncio.timeout(15):
        while not log.exists() or len(log.read_text().splitlines()) < n:  # noqa: ASYNC240 - a tiny test file
            await asyncio.sleep(0.02)


async def _inputs(store: Path, session_id: str) -> list[str]:
    """The user messages the session remembers, in order."""
    async with SqliteStateStore(store) as db:
        state, _ = await db.load("default", session_id)
    assert state is not None
    return [m.text for m in state.context if m.role == "user"]


async def test_durable_start_rejects_enqueues_interrupts_and_rolls_back(
        temporal_address: str, holding: tuple[Path, Path]) -> None:
    store, log = holding
    async with asyncio.timeout(60), _worker(temporal_address, HOLDING) as (client, queue):
        agent = DurableAgent(client, factory=HOLDING, task_queue=queue)
        first = await agent.start("first", session_id="s")
        await _holds(log, 1)
        with pytest.raises(DurableSessionBusy) as refused:  # the agent's default: "reject"
            await agent.start("refused", session_id="s")
        assert refused.value.reason == "busy" and refused.value.run_id == first.run_id
        full = DurableAgent(client, factory=HOLDING, task_queue=queue, max_queued=0)
        with pytest.raises(DurableSessionBusy) as overflow:
            await full.start("refused", session_id="s", multitask_strategy="enqueue")
        assert overflow.value.reason == "queue_full"
        with pytest.raises(ValueError, match="multitask_strategy must be one of"):
            await agent.start("refused", session_id="s", multitask_strategy="switch")  # type: ignore[arg-type]

        queued = asyncio.create_task(agent.start("queued", session_id="s", multitask_strategy="enqueue"))
        await asyncio.sleep(0.5)
        assert not queued.done()  # it waits while the first run holds the session
        await first.interrupt()
        assert (await (await queued).result()).text == "done: queued"
        assert await _inputs(store, "s") == ["first", "queued"]

        held = await agent.start("first", session_id="s")
        await _holds(log, 2)
        second = await agent.start("second", session_id="s", multitask_strategy="rollback")
        rolled = await held.result()
        assert (await second.result()).text == "done: second"
        events = await held.events()

        interrupting = DurableAgent(client, factory=HOLDING, task_queue=queue, multitask_strategy="interrupt")
        kept = await interrupting.start("first", session_id="s")
        await _holds(log, 3)
        third = await interrupting.start("third", session_id="s")  # the agent's default: "interrupt"
        stopped = await kept.result()
        assert (await third.result()).text == "done: third"
    assert rolled.generate_reason is GenerateReason.INTERRUPTED and rolled.metadata["rolled_back"]
    ends = [ev for ev in events if type(ev) is AgentEnd]
    assert [ev.metadata for ev in ends] == [{"rolled_back": True}]
    assert next(ev for ev in events if type(ev) is AgentResult).result.metadata["rolled_back"]
    kinds = [ev.type for ev in events]  # every block the rolled-back run opened is closed
    assert kinds.count("tool_call_start") == kinds.count("tool_result_end") == 1, kinds
    assert stopped.generate_reason is GenerateReason.INTERRUPTED and "rolled_back" not in stopped.metadata
    # The rolled-back turn is gone from the session as if it never ran; the interrupted one stays.
    assert await _inputs(store, "s") == ["first", "queued", "second", "first", "third"]


async def test_a_served_input_without_a_strategy_takes_the_agents_default(
        temporal_address: str, holding: tuple[Path, Path]) -> None:
    from durable_agents import build_holding_rollback

    store, log = holding
    factory = "durable_agents:build_holding_rollback"
    events = MemoryEventLog()
    async with asyncio.timeout(60), _worker(temporal_address, factory, events) as (client, queue):
        app = create_app(build_holding_rollback, runner=DurableServing(client, factory=factory, events=events,
                                                                       task_queue=queue))
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        try:
            while not server.started:
                await asyncio.sleep(0.05)
            first = await DurableAgent(client, factory=factory, task_queue=queue).start("first", session_id="s")
            await _holds(log, 1)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                refused = await http.post("/v1/runs", json={"session_id": "s", "input": "x",
                                                            "multitask_strategy": "reject"})
                second = await http.post("/v1/runs", json={"session_id": "s", "input": "second"})
        finally:
            server.should_exit = True
            await serving
        rolled = await first.result()
    assert refused.status_code == 409, refused.text  # the request's own strategy comes first
    assert second.status_code == 200, second.text
    assert _text([Frame(0, None, json.loads(line[6:])) for line in second.text.splitlines()
                  if line.startswith("data: ")]) == "done: second"
    assert rolled.generate_reason is GenerateReason.INTERRUPTED and rolled.metadata["rolled_back"]
    assert await _inputs(store, "s") == ["second"]
