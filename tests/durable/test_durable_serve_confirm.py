"""Confirmations and the session interrupt of durable runs served by ``agentscope-py serve
--temporal`` (real processes: the Temporal dev server, Redis, workers, serve, the loopback model
server): a served run that asks ends its stream with the asking reply; ``POST /v1/runs`` with
``confirm`` (and AG-UI ``resume``) reaches the waiting workflow, and its stream is the same run
going on; a confirm with nothing waiting is refused; ``POST /v1/interrupt`` reaches the session's
workflow."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from durable_helpers import Workers, model_server, temporal_address, wait_lines, workers
from durable_live_helpers import Frame, Serves, sse
from server.test_agui_client import client_modules
from test_durable_live_serve import _verify

__all__ = ["client_modules", "model_server", "temporal_address", "workers"]  # fixtures, used by name

ASKING = "durable_agents:build_asking"
CALL = "call_add_1"  # the loopback model's tool call


@pytest.fixture
def served(temporal_address: str, model_server: tuple[str, Path], redis_url: str,
           workers: Workers) -> Iterator[Callable[..., str]]:
    """``served(factory, **worker_env)``: a worker and a serve process of ``factory`` on a task
    queue of their own, publishing to Redis; the serve process's URL."""
    procs = Serves(temporal_address, redis_url, {"DURABLE_MODEL_URL": model_server[0]})

    def start(factory: str = ASKING, **env: str) -> str:
        queue = f"q-{uuid.uuid4().hex[:8]}"
        worker = workers.spawn(factory, queue, "--events", redis_url, **env)
        url = procs.start(queue, factory)[0]
        workers.ready(worker)
        return url

    yield start
    procs.close()


async def _post(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[httpx.Response, list[Frame]]:
    async with http.stream("POST", url, json=body, headers={"accept": "text/event-stream"}) as answer:
        if answer.status_code != 200:
            await answer.aread()
            return answer, []
        return answer, [f async for f in sse(answer.aiter_lines())]


def _result(frames: list[Frame]) -> dict[str, Any]:
    found: dict[str, Any] = next(f.data["result"] for f in frames if f.data.get("type") == "agent_result")
    return found


def _text(frames: list[Frame]) -> str:
    return "".join(f.data["delta"] for f in frames if f.data.get("type") == "text_block_delta")


async def _asking(http: httpx.AsyncClient, url: str, session: str = "s1") -> tuple[str, list[Frame]]:
    """A run started on ``session``: its stream ends with the asking reply (the run waits)."""
    answer, frames = await _post(http, url + "/v1/runs", {"session_id": session, "input": "2 + 40?"})
    assert answer.status_code == 200, answer.text
    assert _result(frames)["generate_reason"] == "permission_asking"
    assert frames[-1].data["type"] == "agent_end"
    return answer.headers["x-run-id"], frames


async def test_approved_through_serve_the_same_run_goes_on_to_the_tools_result(
        served: Callable[..., str], tmp_path: Path) -> None:
    url = served()
    async with asyncio.timeout(60), httpx.AsyncClient(timeout=50) as http:
        run_id, asked = await _asking(http, url)
        assert not (tmp_path / "tool_log").exists()  # the tool waits for the answer
        both = await http.post(url + "/v1/runs", json={"session_id": "s1", "input": "and?",
                                                       "confirm": [{"tool_call_id": CALL, "confirmed": True}]})
        wrong = await http.post(url + "/v1/runs", json={"session_id": "s1",
                                                        "confirm": [{"tool_call_id": "nope", "confirmed": True}]})
        answer, rest = await _post(http, url + "/v1/runs", {"session_id": "s1",
                                                            "confirm": [{"tool_call_id": CALL, "confirmed": True}]})
        full = await http.get(f"{url}/v1/runs/{run_id}/events")
    assert both.status_code == 400 and "confirm" in both.json()["detail"], both.text  # one at a time
    assert wrong.status_code == 400 and wrong.json()["type"] == "invalid_confirm", wrong.text
    assert answer.status_code == 200 and answer.headers["x-run-id"] == run_id  # the same run goes on
    assert [f.id for f in asked + rest] == list(range(1, len(asked) + len(rest) + 1))  # numbered on
    assert _text(rest) == "The answer is 42." and _result(rest)["generate_reason"] != "permission_asking"
    assert rest[-1].data["type"] == "agent_end"
    assert (tmp_path / "tool_log").read_text().count("\n") == 1  # the tool ran once, after the answer
    whole = [f async for f in sse(_lines(full.text))]  # the run's own log: both pieces, under the same ids
    assert [(f.id, f.data["type"]) for f in whole] == [(f.id, f.data["type"]) for f in asked + rest]


async def _lines(text: str) -> AsyncIterator[str]:
    for line in [*text.splitlines(), ""]:
        yield line


async def test_denied_through_serve_the_tool_never_runs_and_the_run_ends(
        served: Callable[..., str], tmp_path: Path) -> None:
    url = served()
    async with asyncio.timeout(60), httpx.AsyncClient(timeout=50) as http:
        run_id, _ = await _asking(http, url)
        answer, rest = await _post(http, url + "/v1/runs", {"session_id": "s1", "confirm": [
            {"tool_call_id": CALL, "confirmed": False, "reason": "not now"}]})
        again = await http.post(url + "/v1/runs", json={"session_id": "s1",
                                                        "confirm": [{"tool_call_id": CALL, "confirmed": True}]})
    assert answer.status_code == 200 and answer.headers["x-run-id"] == run_id
    results = [f.data for f in rest if f.data.get("type") == "tool_result_end"]
    assert results and all(r["tool_call_id"] == CALL for r in results), [f.data.get("type") for f in rest]
    assert rest[-1].data["type"] == "agent_end" and _result(rest)["generate_reason"] != "permission_asking"
    assert not (tmp_path / "tool_log").exists()  # denied: never started
    assert again.status_code == 409 and again.json()["type"] == "not_waiting", again.text  # it ended


async def test_a_confirm_with_nothing_waiting_is_refused(served: Callable[..., str]) -> None:
    url = served()
    async with asyncio.timeout(30), httpx.AsyncClient(timeout=20) as http:
        never = await http.post(url + "/v1/runs", json={"session_id": "fresh",
                                                        "confirm": [{"tool_call_id": CALL, "confirmed": True}]})
        agui = await http.post(url + "/agui", json={
            "threadId": "fresh", "runId": "r-none", "messages": [], "tools": [], "context": [], "state": {},
            "forwardedProps": {}, "resume": [{"interruptId": CALL, "status": "resolved", "payload": {}}]})
    assert never.status_code == 409 and never.json()["type"] == "not_waiting", never.text
    assert "nothing to confirm" in never.json()["detail"]
    assert agui.status_code == 409 and agui.json()["type"] == "not_waiting", agui.text


async def test_approved_through_agui_the_resumed_stream_passes_the_official_verifier(
        served: Callable[..., str], client_modules: Path, tmp_path: Path) -> None:
    url, tag = served(), uuid.uuid4().hex[:8]
    history = [{"id": "u1", "role": "user", "content": "2 + 40?"}]
    body = {"threadId": "t1", "runId": f"r1-{tag}", "messages": history, "tools": [], "context": [],
            "state": {}, "forwardedProps": {}}
    async with asyncio.timeout(60), httpx.AsyncClient(timeout=50) as http:
        first, asked = await _post(http, url + "/agui", body)
        finished = asked[-1].data
        assert finished["type"] == "RUN_FINISHED", [f.data["type"] for f in asked]
        interrupts = finished["outcome"]["interrupts"]  # the approval the run waits for
        resume = [{"interruptId": i["id"], "status": "resolved", "payload": {"approved": True}} for i in interrupts]
        answer, rest = await _post(http, url + "/agui", {**body, "runId": f"r2-{tag}", "resume": resume})
    assert [i["id"] for i in interrupts] == [CALL]
    assert answer.status_code == 200 and answer.headers["x-run-id"] == first.headers["x-run-id"]
    events = [f.data for f in rest]
    assert events[0]["type"] == "RUN_STARTED" and events[-1]["type"] == "RUN_FINISHED"
    text = "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT")
    assert text == "The answer is 42."
    assert (tmp_path / "tool_log").read_text().count("\n") == 1
    assert _verify(client_modules, tmp_path, events) == "ok"


async def test_the_session_interrupt_reaches_its_durable_run(
        served: Callable[..., str], tmp_path: Path) -> None:
    url = served("durable_agents:build", DURABLE_TOOL_SLEEP="30")
    async with asyncio.timeout(40), httpx.AsyncClient(timeout=30) as http:
        idle = await http.post(url + "/v1/interrupt", json={"session_id": "s1"})
        async with http.stream("POST", url + "/v1/runs", json={"session_id": "s1", "input": "2 + 40?"}) as answer:
            run_id = answer.headers["x-run-id"]
            await asyncio.to_thread(wait_lines, tmp_path / "tool_log", 1)  # the tool sleeps
            stopped = await http.post(url + "/v1/interrupt", json={"session_id": "s1"})
            frames = [f async for f in sse(answer.aiter_lines())]
    assert idle.status_code == 200 and idle.json() == {"interrupted": False}  # nothing in flight
    assert stopped.json() == {"interrupted": True, "run_id": run_id}
    assert _result(frames)["generate_reason"] == "interrupted" and frames[-1].data["type"] == "agent_end"
