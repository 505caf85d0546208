"""Double texting on durable runs (real processes: the Temporal dev server, Redis, a worker, a
serve process, the holding model server): while a session's workflow runs, a second input with
``multitask_strategy="reject"`` is a 409 with ``Retry-After`` (AG-UI: its RUN_ERROR code
``session_busy``), one with ``"interrupt"`` stops the running run — its turn ends interrupted,
every block closed — and runs right after it, and ``"rollback"`` is refused as not available."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from durable_helpers import Workers, temporal_address
from durable_live_helpers import Frame, Serves, held_model, sse, workers
from test_durable_live_serve import _answering, _text

__all__ = ["held_model", "temporal_address", "workers"]  # fixtures, used by name

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def queue() -> str:
    return f"q-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def serves(temporal_address: str, held_model: tuple[str, Path], redis_url: str) -> Iterator[Serves]:
    procs = Serves(temporal_address, redis_url, {"DURABLE_MODEL_URL": held_model[0]})
    yield procs
    procs.close()


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
        rollback = await http.post(url + "/v1/runs", json={"session_id": "s1", "input": "again?",
                                                           "multitask_strategy": "rollback"})
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
    assert rollback.status_code == 422 and "not available for durable runs" in rollback.text
    first = next(f.data["result"] for f in seen if f.data.get("type") == "agent_result")
    assert first["generate_reason"] == "interrupted"
    kinds = [f.data.get("type") for f in seen]
    assert kinds.count("text_block_start") == kinds.count("text_block_end"), kinds
    assert kinds.count("model_call_start") == kinds.count("model_call_end"), kinds
    assert _text(after) == "The answer is 42." and after[-1].data["type"] == "agent_end"
    assert all(isinstance(f, Frame) for f in after)
