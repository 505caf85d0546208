"""Human approval and interrupt of durable runs: a run asking for confirmation waits in its
workflow with no worker (the worker is even replaced), a signal resumes it; an interrupt cancels
the activity in flight on the worker and ends the run INTERRUPTED."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from durable_helpers import Workers, model_server, model_workers, requests, temporal_address, wait_lines
from temporalio.client import Client

from agentscope_py import GenerateReason, ToolResultState
from agentscope_py.durable import DurableAgent
from agentscope_py.events import ConfirmResult, RequireUserConfirm, ToolResultEnd

__all__ = ["model_server", "temporal_address"]  # fixtures, used by name


@pytest.fixture
def workers(temporal_address: str, model_server: tuple[str, Path], tmp_path: Path) -> Iterator[Workers]:
    yield from model_workers(temporal_address, model_server[0], tmp_path)


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    async with asyncio.timeout(15):
        while not await check():
            await asyncio.sleep(0.1)


async def test_approval_waits_in_the_workflow_across_a_worker_restart(
        temporal_address: str, model_server: tuple[str, Path], workers: Workers, tmp_path: Path) -> None:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    first = workers.start("durable_agents:build_asking", queue)
    client = await Client.connect(temporal_address)
    run = await DurableAgent(client, factory="durable_agents:build_asking", task_queue=queue).start("2 + 40?")
    await _until(run.waiting)
    asking = await run.asking()
    assert [(c.name, c.input) for c in asking] == [("add", {"a": 2, "b": 40})]
    assert not (tmp_path / "tool_log").exists()  # asked, not run
    first.kill()  # nothing holds the waiting run: its state is the workflow's history
    first.wait(5)
    workers.start("durable_agents:build_asking", queue)
    await run.confirm(ConfirmResult(tool_call_id=asking[0].id, confirmed=True))
    async with asyncio.timeout(20):
        reply = await run.result()
        events = await run.events()
    assert reply.text == "The answer is 42." and reply.generate_reason is GenerateReason.MODEL_STOP
    assert requests(model_server[1]) == 2  # the asking turn's model call was not made again
    assert len((tmp_path / "tool_log").read_text().split()) == 1
    assert [type(ev) for ev in events].count(RequireUserConfirm) == 1
    assert [(ev.tool_name, ev.state) for ev in events if isinstance(ev, ToolResultEnd)] == [
        ("add", ToolResultState.SUCCESS)]
    assert not await run.waiting()


async def test_interrupt_cancels_the_activity_and_ends_the_run_interrupted(
        temporal_address: str, model_server: tuple[str, Path], workers: Workers, tmp_path: Path) -> None:
    queue, tool_log = f"q-{uuid.uuid4().hex[:8]}", tmp_path / "tool_log"
    workers.start("durable_agents:build", queue, DURABLE_HANG_FIRST="1")
    client = await Client.connect(temporal_address)
    run = await DurableAgent(client, factory="durable_agents:build", task_queue=queue).start("2 + 40?")
    await asyncio.to_thread(wait_lines, tool_log, 1)  # the tool runs (and would for 60 s)
    await run.interrupt()
    async with asyncio.timeout(15):
        reply = await run.result()
        events = await run.events()
    assert reply.generate_reason is GenerateReason.INTERRUPTED
    assert [(ev.tool_name, ev.state) for ev in events if isinstance(ev, ToolResultEnd)] == [
        ("add", ToolResultState.INTERRUPTED)]
    assert requests(model_server[1]) == 1
    # the cancellation reached the tool on the worker (at its next heartbeat)
    await asyncio.to_thread(wait_lines, tool_log, 2, 5.0)
    assert tool_log.read_text().split()[-1] == "cancelled"


async def test_an_interrupt_sent_with_the_start_stops_the_run_before_its_model_is_called(
        temporal_address: str, model_server: tuple[str, Path], workers: Workers) -> None:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    client = await Client.connect(temporal_address)
    agent = DurableAgent(client, factory="durable_agents:build", task_queue=queue)
    run = await agent.start("2 + 40?")
    await run.interrupt()  # no worker yet: the signal waits in the history with the start
    workers.start("durable_agents:build", queue)
    async with asyncio.timeout(15):
        reply = await run.result()
    assert reply.generate_reason is GenerateReason.INTERRUPTED
    assert requests(model_server[1]) == 0
