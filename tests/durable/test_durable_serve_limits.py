"""An answer's stream of a served durable run counts in the run limits as any run (real processes:
the Temporal dev server, Redis, a worker, the loopback model server; the app served in this
process by uvicorn on a loopback port, with ``Limits(max_runs_per_user=1)``): a user whose answer
is streaming gets 429 + Retry-After for another answer and for a new run — nothing is signalled
to the refused answer's workflow — and the slot is free once the answer's stream ended."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from durable_helpers import Workers, free_port, model_server, temporal_address, workers
from durable_live_helpers import Frame, sse

from agentscope_py.durable import RedisEventLog
from agentscope_py.server import DurableServing, Limits, create_app

__all__ = ["model_server", "temporal_address", "workers"]  # fixtures, used by name

FACTORY = "durable_agents:build_asking"
CALL = "call_add_1"


@contextlib.asynccontextmanager
async def _serving(temporal: str, redis_url: str, queue: str) -> AsyncIterator[str]:
    from durable_agents import build_asking

    runner = DurableServing(temporal, factory=FACTORY, events=RedisEventLog(redis_url), task_queue=queue)
    app = create_app(build_asking, runner=runner, limits=Limits(max_runs_per_user=1, retry_after=2))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(20):
            while not server.started:
                await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def _ask(http: httpx.AsyncClient, url: str, session: str) -> list[Frame]:
    """A run on ``session`` whose stream ends with the asking reply (the run waits)."""
    async with http.stream("POST", url + "/v1/runs", json={"session_id": session, "input": "2 + 40?"}) as answer:
        assert answer.status_code == 200, await answer.aread()
        frames = [f async for f in sse(answer.aiter_lines())]
    assert frames[-1].data["type"] == "agent_end"
    return frames


def _confirm(session: str) -> dict[str, Any]:
    return {"session_id": session, "confirm": [{"tool_call_id": CALL, "confirmed": True}]}


async def test_an_answer_counts_in_the_per_user_limit_and_frees_its_slot_when_it_ends(
        temporal_address: str, redis_url: str, workers: Workers, model_server: tuple[str, Path],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DURABLE_MODEL_URL", model_server[0])  # the app builds the agent here
    queue = f"q-{uuid.uuid4().hex[:8]}"
    workers.start(FACTORY, queue, "--events", redis_url, DURABLE_TOOL_SLEEP="3")  # the answered tool takes 3 s
    async with asyncio.timeout(90), _serving(temporal_address, redis_url, queue) as url, \
            httpx.AsyncClient(timeout=60) as http:
        await _ask(http, url, "a")  # each asking stream ended: its slot is free again
        await _ask(http, url, "b")
        async with http.stream("POST", url + "/v1/runs", json=_confirm("a")) as answering:
            assert answering.status_code == 200
            frames = sse(answering.aiter_lines())
            first = await anext(frames)  # the answer streams (its tool sleeps): it holds the slot
            other = await http.post(url + "/v1/runs", json=_confirm("b"))
            new = await http.post(url + "/v1/runs", json={"session_id": "c", "input": "hello"})
            rest = [f async for f in frames]
        after = await http.post(url + "/v1/runs", json=_confirm("b"))
    for refused in (other, new):
        assert refused.status_code == 429 and refused.json()["type"] == "too_many_runs", refused.text
        assert refused.headers["retry-after"] == "2"
    assert first.data["type"] != "error" and rest[-1].data["type"] == "agent_end"
    assert after.status_code == 200, after.text  # the slot was released with the answer's end
    assert _text(after.text) == "The answer is 42."
    assert (tmp_path / "tool_log").read_text().count("\n") == 2  # b answered once, after the refusal


def _text(body: str) -> str:
    return "".join(json.loads(line[6:]).get("delta", "") for line in body.splitlines()
                   if line.startswith("data: ") and '"text_block_delta"' in line)
