"""Durable runs watched through ``agentscope-py serve --temporal`` (real processes: the Temporal
dev server, Redis, workers, serve processes, the holding model server): the first delta reaches
the client while the model still holds its answer; a client resumes with ``Last-Event-ID``
through another serve process after the first one died (nothing marks the run lost); the
interrupt endpoint reaches the workflow, and the session's next run starts once the interrupted
model call has ended; a worker killed mid-answer leaves the AG-UI stream without duplicated text
and balanced, as the official client's verifier says."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
from durable_helpers import Workers, temporal_address
from durable_live_helpers import Frame, Serves, held_model, queue, release, serves, sse, workers
from server.test_agui_client import NODE, client_modules
from server.test_agui_nested import VERIFY_SCRIPT

__all__ = ["client_modules", "held_model", "queue", "serves", "temporal_address", "workers"]  # fixtures, used by name


def _text(frames: list[Frame], kind: str = "text_block_delta", key: str = "delta") -> str:
    return "".join(f.data[key] for f in frames if f.data.get("type") == kind)


async def _until(frames: AsyncIterator[Frame], seen: list[Frame], done: Callable[[Frame], bool]) -> None:
    async for frame in frames:
        seen.append(frame)
        if done(frame):
            return
    raise AssertionError(f"the stream ended first: {[f.data.get('type') for f in seen]}")


@contextlib.asynccontextmanager
async def _answering(http: httpx.AsyncClient, url: str) -> AsyncIterator[tuple[str, AsyncIterator[Frame], list[Frame]]]:
    """A run started on session s1 and read up to its first delta (the model holds the rest):
    its id, the rest of its frames, and the frames seen."""
    seen: list[Frame] = []
    async with http.stream("POST", url + "/v1/runs", json={"session_id": "s1", "input": "2 + 40?"}) as answer:
        frames = sse(answer.aiter_lines())
        await _until(frames, seen, lambda f: f.data.get("type") == "text_block_delta")
        yield answer.headers["x-run-id"], frames, seen


async def test_watched_live_through_serve_and_resumed_through_another_after_the_first_died(
        held_model: tuple[str, Path], workers: Workers, serves: Serves, queue: str, redis_url: str) -> None:
    worker = workers.spawn("durable_agents:build", queue, "--events", redis_url)
    (first, first_proc), (second, _) = serves.start_all(queue, 2)
    workers.ready(worker)
    seen: list[Frame] = []
    async with asyncio.timeout(40), httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", first + "/v1/runs", json={"session_id": "s1", "input": "2 + 40?"}) as answer:
            assert answer.status_code == 200
            run_id = answer.headers["x-run-id"]
            await _until(sse(answer.aiter_lines()), seen, lambda f: f.data.get("type") == "text_block_delta")
        # the answer's first piece arrived while the model holds the rest: the run goes on
        assert _text(seen) == "The answer " and "agent_end" not in [f.data.get("type") for f in seen]
        first_proc.kill()  # the serve process that started the run dies: the run is not its
        first_proc.wait(5)
        last = seen[-1].id
        async with http.stream("GET", f"{second}/v1/runs/{run_id}/events",
                               headers={"Last-Event-ID": str(last)}) as answer:
            assert answer.status_code == 200  # reconnected while the model still holds its answer
            release(held_model[0])
            rest = [f async for f in sse(answer.aiter_lines())]
    assert [f.id for f in seen + rest] == list(range(1, len(seen) + len(rest) + 1))  # no gap, no repeat
    assert _text(seen + rest) == "The answer is 42."
    assert all(f.event is None for f in rest), [f.data for f in rest if f.event]  # no error (no "lost")
    assert rest[-1].data["type"] == "agent_end"
    assert seen[0].data["metadata"]["run_id"] == run_id


async def test_the_interrupt_endpoint_reaches_the_workflow(
        held_model: tuple[str, Path], workers: Workers, serves: Serves, queue: str, redis_url: str) -> None:
    worker = workers.spawn("durable_agents:build", queue, "--events", redis_url)
    url, _ = serves.start(queue)
    workers.ready(worker)
    async with asyncio.timeout(40), httpx.AsyncClient(timeout=30) as http:
        async with _answering(http, url) as (run_id, frames, seen):
            stopped = await http.post(f"{url}/v1/runs/{run_id}/interrupt", json={})
            assert stopped.status_code == 200 and stopped.json() == {"run_id": run_id, "interrupted": True}
            seen += [f async for f in frames]  # the model still holds its answer: the interrupt ends it
        again = await http.post(f"{url}/v1/runs/{run_id}/interrupt", json={})
        # the session's next run, at once: it starts once the cancelled model call has ended
        async with http.stream("POST", url + "/v1/runs", json={"session_id": "s1", "input": "2 + 40?"}) as answer:
            assert answer.status_code == 200, await answer.aread()
            after = [f async for f in sse(answer.aiter_lines())]
    result = next(f.data["result"] for f in seen if f.data.get("type") == "agent_result")
    assert result["generate_reason"] == "interrupted"
    kinds = [f.data.get("type") for f in seen]  # what the cut-off answer opened was closed
    assert kinds.count("text_block_start") == kinds.count("text_block_end") == 1, kinds
    assert kinds.count("model_call_start") == kinds.count("model_call_end") == 2, kinds
    assert seen[-1].data["type"] == "agent_end"
    assert again.json() == {"run_id": run_id, "interrupted": False, "status": "interrupted"}  # how it ended
    assert _text(after) == "The answer is 42." and after[-1].data["type"] == "agent_end"


async def test_a_second_run_on_a_busy_session_is_refused_and_the_first_goes_on(
        held_model: tuple[str, Path], workers: Workers, serves: Serves, queue: str, redis_url: str) -> None:
    worker = workers.spawn("durable_agents:build", queue, "--events", redis_url)
    url, _ = serves.start(queue)
    workers.ready(worker)
    async with asyncio.timeout(40), httpx.AsyncClient(timeout=30) as http:
        async with _answering(http, url) as (first_id, frames, seen):
            # (without a strategy, the agent's default, "enqueue", would wait for the first run)
            busy = await http.post(url + "/v1/runs", json={"session_id": "s1", "input": "again?",
                                                           "multitask_strategy": "reject"})
            other = await http.post(url + "/v1/runs", json={"session_id": "s2", "input": "2 + 40?",
                                                            "detach": True})
            release(held_model[0])
            seen += [f async for f in frames]
        assert busy.status_code == 409 and busy.json()["type"] == "session_busy", busy.text
        assert first_id in busy.json()["detail"]  # it names the run in flight
        assert other.status_code == 200  # another session is not held up
        after = await http.post(url + "/v1/runs", json={"session_id": "s1", "input": "2 + 40?"})
    assert _text(seen) == "The answer is 42." and seen[-1].data["type"] == "agent_end"
    assert after.status_code == 200  # the session is free once its run ended


async def test_a_worker_killed_mid_answer_the_agui_stream_is_whole_and_balanced(
        held_model: tuple[str, Path], workers: Workers, serves: Serves, queue: str, redis_url: str,
        client_modules: Path, tmp_path: Path) -> None:
    worker = workers.spawn("durable_agents:build", queue, "--events", redis_url)
    url, _ = serves.start(queue)
    workers.ready(worker)
    body = {"threadId": "t1", "runId": f"r-{queue}", "messages": [{"id": "u1", "role": "user", "content": "2 + 40?"}],
            "tools": [], "context": [], "state": {}, "forwardedProps": {}}
    seen: list[Frame] = []
    async with asyncio.timeout(60), httpx.AsyncClient(timeout=50) as http:
        async with http.stream("POST", url + "/agui", json=body, headers={"accept": "text/event-stream"}) as answer:
            frames = sse(answer.aiter_lines())
            await _until(frames, seen, lambda f: f.data.get("type") == "TEXT_MESSAGE_CONTENT")
            worker.kill()  # SIGKILL mid-answer: the model call starts again on the next worker
            worker.wait(5)
            workers.start("durable_agents:build", queue, "--events", redis_url)
            release(held_model[0])
            seen += [f async for f in frames]
        resumed = await http.get(f"{url}/agui/runs/{body['runId']}/events", headers={"Last-Event-ID": "2"})
    events = [f.data for f in seen]
    assert _text(seen, "TEXT_MESSAGE_CONTENT") == "The answer is 42."  # the retried call's first piece once
    assert events[0]["type"] == "RUN_STARTED" and events[-1]["type"] == "RUN_FINISHED"
    assert _verify(client_modules, tmp_path, events) == "ok"
    # a client resuming makes the same frames, under the same ids
    assert [json.loads(line[6:]) for line in resumed.text.splitlines() if line.startswith("data: ")] == events[2:]


def _verify(client_modules: Path, tmp_path: Path, events: list[dict[str, Any]]) -> str:
    """The official client's ``verifyEvents`` verdict on the stream ("ok" or its error)."""
    (tmp_path / "node_modules").symlink_to(client_modules, target_is_directory=True)
    (tmp_path / "verify.mjs").write_text(VERIFY_SCRIPT)
    done = subprocess.run([str(NODE), "verify.mjs"], cwd=tmp_path, input=json.dumps([events]), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    verdict: str = json.loads(done.stdout.strip().splitlines()[-1])[0]
    return verdict
