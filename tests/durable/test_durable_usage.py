"""A durable run's usage counts a model call whose activity failed after the provider reported
its usage (the connection dropped after the usage chunk): once, whether Temporal ran the
activity again (the earlier attempt's usage comes back with the later one's result) or the run
failed (it comes back with the failure). The Temporal dev server is real; the worker runs in
this process, so the agents' finish hook hands the test each run's `AgentRun`."""

from __future__ import annotations

import asyncio
import uuid

import durable_usage_agents as agents
from durable_helpers import temporal_address
from temporalio.client import Client

from agentscope_py import Msg
from agentscope_py.durable import ActivityConfig, DurableAgent, DurableConfig, make_worker

__all__ = ["temporal_address"]  # a fixture, used by name

FAST_RETRY = DurableConfig(model=ActivityConfig(start_to_close=20.0, max_attempts=2, initial_interval=0.05))


async def _run(address: str, factory: str) -> tuple[Msg | None, BaseException | None]:
    client = await Client.connect(address)
    queue = f"q-{uuid.uuid4().hex[:8]}"
    agents.RUNS.clear()
    async with make_worker(client, [factory], task_queue=queue, config=FAST_RETRY):
        agent = DurableAgent(client, factory=factory, task_queue=queue)
        async with asyncio.timeout(30):
            run = await agent.start("go", user_id="u", session_id=uuid.uuid4().hex)
            try:
                return await run.result(), None
            except Exception as exc:
                return None, exc


async def test_a_call_retried_by_temporal_after_its_usage_was_read_counts_both_attempts(
        temporal_address: str) -> None:
    reply, error = await _run(temporal_address, "durable_usage_agents:build_retried")
    assert error is None and reply is not None
    assert reply.usage == agents.BILLED + agents.BILLED
    assert agents.RUNS[-1].usage == agents.BILLED + agents.BILLED and agents.RUNS[-1].error is None


async def test_a_run_whose_call_failed_after_its_usage_was_read_counts_it(temporal_address: str) -> None:
    reply, error = await _run(temporal_address, "durable_usage_agents:build_failing")
    assert reply is None and error is not None
    assert agents.RUNS[-1].error is not None and agents.RUNS[-1].usage == agents.BILLED


async def test_a_cancelled_call_that_read_its_usage_counts_it_once_its_cancellation_completed(
        temporal_address: str) -> None:
    # The hedge's backup answers first; the first attempt, cancelled, had read its usage on the
    # worker. The run goes on (the tool, then the answer): the cancellation completes before the
    # tool's activity starts, and its usage counts in the run's.
    reply, error = await _run(temporal_address, "durable_usage_agents:build_hedged")
    assert error is None and reply is not None and reply.text == "3"
    assert agents.RUNS[-1].usage == agents.BILLED + agents.BILLED + agents.BILLED  # the cancelled one, two answers
