"""An interrupt stops the work of a durable run on its worker (real processes: the Temporal dev
server, a worker with the default model and tool schedules, ``serve --temporal`` on Redis): the
call in flight is cancelled on the worker within about a second, never runs to its end, the
session's next turn starts its own calls only after it, and the worker logs no more than one
plain line for it; a call interrupted on a worker that died is not run again."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from durable_helpers import Workers, model_server, requests, temporal_address, wait_lines, workers
from durable_live_helpers import Frame, Serves, queue, sse
from temporalio.client import Client

from agentscope_py import GenerateReason
from agentscope_py.durable import DurableAgent

__all__ = ["model_server", "queue", "temporal_address", "workers"]  # fixtures, used by name

CANCELLED_WITHIN = 1.5
"""Seconds from the interrupt to the cancellation recorded on the worker: the cancellation is
asked for at the next heartbeat the worker sends (at most 0.5 s apart), plus a loaded host's
scheduling."""

SLOW = "2"
"""Seconds the first call takes when nothing cancels it (below Temporal's default throttle of
8 s, so an uncancelled call ends, and the test sees it)."""


@pytest.fixture
def serves(temporal_address: str, model_server: tuple[str, Path], redis_url: str) -> Iterator[Serves]:
    procs = Serves(temporal_address, redis_url, {"DURABLE_MODEL_URL": model_server[0]})
    yield procs
    procs.close()


def _records(path: Path) -> list[tuple[str, int, float]]:
    """The calls' records: (start | cancelled | end, the call's number, when)."""
    found = []
    for line in path.read_text().splitlines():
        what, n, at = line.split()
        found.append((what, int(n), float(at)))
    return found


def _at(records: list[tuple[str, int, float]], what: str, n: int) -> float | None:
    return next((at for w, i, at in records if (w, i) == (what, n)), None)


def _printed(worker: subprocess.Popen[bytes]) -> list[str]:
    """What the worker has printed since it said it polls, read without waiting (it runs on: its
    own stop is not what is checked)."""
    assert worker.stdout is not None
    os.set_blocking(worker.stdout.fileno(), False)
    return (worker.stdout.read() or b"").decode(errors="replace").splitlines()


def _check_log(lines: list[str], cancellations: int) -> None:
    """At most one plain line per expected cancellation: no traceback, no colour codes."""
    assert not any("\x1b[" in line for line in lines), lines
    assert not any("Traceback" in line for line in lines), lines
    assert len(lines) <= cancellations, lines


async def _turn(http: httpx.AsyncClient, url: str) -> tuple[str, list[Frame]]:
    """A run on session s1 ("2 + 40?"), read to its end: its id and frames."""
    async with http.stream("POST", url + "/v1/runs", json={"session_id": "s1", "input": "2 + 40?"}) as answer:
        assert answer.status_code == 200, await answer.aread()
        return answer.headers["x-run-id"], [f async for f in sse(answer.aiter_lines())]


async def test_an_interrupted_tool_is_cancelled_on_the_worker_and_the_next_turn_waits_for_it(
        model_server: tuple[str, Path], workers: Workers, serves: Serves, queue: str, redis_url: str,
        tmp_path: Path) -> None:
    log = tmp_path / "tool_log"
    worker = workers.spawn("durable_agents:build_recording", queue, "--events", redis_url,
                           "--config", "durable_agents:RECORDING", DURABLE_TOOL_SLEEP=SLOW)
    url, _ = serves.start(queue, "durable_agents:build_recording")
    workers.ready(worker)
    async with asyncio.timeout(40), httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", url + "/v1/runs", json={"session_id": "s1", "input": "2 + 40?"}) as answer:
            run_id, frames = answer.headers["x-run-id"], sse(answer.aiter_lines())
            await asyncio.to_thread(wait_lines, log, 1)  # the tool runs on the worker
            asked = time.time()
            stopped = await http.post(f"{url}/v1/runs/{run_id}/interrupt", json={})
            assert stopped.json() == {"run_id": run_id, "interrupted": True}
            first = [f async for f in frames]
        _, second = await _turn(http, url)  # the next turn, at once (its tool does not wait)
    assert next(f.data["result"]["generate_reason"] for f in first if f.data.get("type") == "agent_result") \
        == "interrupted"
    assert [f.data["state"] for f in first if f.data.get("type") == "tool_result_end"] == ["interrupted"]
    assert second[-1].data["type"] == "agent_end"
    assert "The answer is 42." in "".join(f.data.get("delta", "") for f in second)
    # Past the time the first call would have taken: it never ended.
    started = _at(_records(log), "start", 1)
    assert started is not None
    await asyncio.sleep(max(0.0, started + float(SLOW) + 0.5 - time.time()))
    records = _records(log)
    cancelled = _at(records, "cancelled", 1)
    assert cancelled is not None and _at(records, "end", 1) is None, records
    assert cancelled - asked < CANCELLED_WITHIN, records
    second_start = _at(records, "start", 2)
    assert second_start is not None and second_start >= cancelled, records  # no overlap
    assert requests(model_server[1]) == 3  # one model call, then two: none was made twice
    _check_log(_printed(worker), 1)


async def test_an_interrupted_model_call_is_cancelled_on_the_worker(
        temporal_address: str, workers: Workers, queue: str, tmp_path: Path) -> None:
    log = tmp_path / "tool_log"
    worker = workers.start("durable_agents:build_recording_model", queue, "--config", "durable_agents:RECORDING",
                           DURABLE_TOOL_SLEEP=SLOW)
    client = await Client.connect(temporal_address)
    agent = DurableAgent(client, factory="durable_agents:build_recording_model", task_queue=queue)
    async with asyncio.timeout(30):
        run = await agent.start("2 + 40?")
        await asyncio.to_thread(wait_lines, log, 1)  # the model call runs on the worker
        asked = time.time()
        await run.interrupt()
        reply = await run.result()
        assert reply.generate_reason is GenerateReason.INTERRUPTED
        # the workflow closed once the call was cancelled: it is recorded already
        records = _records(log)
        assert [what for what, _, _ in records] == ["start", "cancelled"], records
        assert records[1][2] - asked < CANCELLED_WITHIN, records
        await asyncio.sleep(max(0.0, records[0][2] + float(SLOW) + 0.5 - time.time()))
    assert [what for what, _, _ in _records(log)] == ["start", "cancelled"]  # never its end
    _check_log(_printed(worker), 1)


async def test_a_call_interrupted_on_a_dead_worker_is_not_run_again(
        temporal_address: str, workers: Workers, queue: str, tmp_path: Path) -> None:
    log = tmp_path / "tool_log"
    first = workers.start("durable_agents:build_recording", queue, DURABLE_TOOL_SLEEP="30")  # heartbeat: 2 s
    client = await Client.connect(temporal_address)
    agent = DurableAgent(client, factory="durable_agents:build_recording", task_queue=queue)
    async with asyncio.timeout(30):
        run = await agent.start("2 + 40?")
        await asyncio.to_thread(wait_lines, log, 1)  # the tool runs on the worker
        first.kill()  # it dies with the call: nothing on it can be cancelled
        first.wait(5)
        asked = time.monotonic()
        await run.interrupt()
        # The next worker comes up after the dead call's heartbeat timeout (2 s) passed: Temporal
        # has scheduled its retry by then, before any workflow task saw the interrupt.
        await asyncio.sleep(3)
        workers.start("durable_agents:build_recording", queue, DURABLE_TOOL_SLEEP="30")
        reply = await run.result()
    # closed once the dead call's heartbeat timeout passed, and its call was not run again
    assert reply.generate_reason is GenerateReason.INTERRUPTED and time.monotonic() - asked < 15
    assert [what for what, _, _ in _records(log)] == ["start"], _records(log)


async def test_the_call_after_a_tool_that_timed_out_starts_once_it_was_cancelled(
        temporal_address: str, workers: Workers, queue: str, tmp_path: Path) -> None:
    log = tmp_path / "tool_log"
    # The tool sleeps 5 s: its 0.5 s timeout's cancellation reaches it at a heartbeat, which a
    # loaded host has delayed past SLOW's 2 s. An uncancelled call still ends, and the test sees
    # it: before its activity's start-to-close (the timeout plus 5 s) and Temporal's 8 s throttle.
    worker = workers.start("durable_agents:build_recording_timeout", queue, "--config", "durable_agents:RECORDING",
                           DURABLE_TOOL_SLEEP="5")
    client = await Client.connect(temporal_address)
    agent = DurableAgent(client, factory="durable_agents:build_recording_timeout", task_queue=queue)
    async with asyncio.timeout(30):
        reply = await agent.call("2 + 40?")
    assert reply.text == "It took too long."
    records = _records(log)  # the model's call, the tool's (cut off at 0.5 s), the model's again
    assert [(what, n) for what, n, _ in records] == [
        ("start", 1), ("end", 1), ("start", 2), ("cancelled", 2), ("start", 3), ("end", 3)], records
    _check_log(_printed(worker), 1)
