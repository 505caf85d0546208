"""Live events of durable runs: published from the activities (the model call's deltas as they
come) and from the workflow, watched while the run goes, resumed from a position, and the same
whichever worker replays the run."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from durable_helpers import Workers, temporal_address
from durable_live_helpers import held_model, release, workers
from temporalio.client import Client

from agentscope_py.durable import DurableAgent, MemoryEventLog, RedisEventLog, make_worker
from agentscope_py.events import AgentEvent, TextBlockDelta

__all__ = ["held_model", "temporal_address", "workers"]  # fixtures, used by name


@pytest.fixture
def env(held_model: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DURABLE_MODEL_URL", held_model[0])
    monkeypatch.setenv("DURABLE_TOOL_LOG", str(tmp_path / "tool_log"))


def _text(events: list[AgentEvent]) -> str:
    return "".join(ev.delta for ev in events if isinstance(ev, TextBlockDelta))


async def test_the_first_delta_is_watched_before_the_run_ends(
        temporal_address: str, env: None, held_model: tuple[str, Path]) -> None:
    client = await Client.connect(temporal_address)
    queue, log = f"q-{uuid.uuid4().hex[:8]}", MemoryEventLog()
    async with make_worker(client, ["durable_agents:build"], task_queue=queue, events=log):
        agent = DurableAgent(client, factory="durable_agents:build", task_queue=queue, events=log)
        run = await agent.start("What is 2 + 40?")
        seen: list[AgentEvent] = []
        async with asyncio.timeout(20):
            async for ev in run.stream():
                seen.append(ev)
                if isinstance(ev, TextBlockDelta):
                    break
            # the model holds the rest of its answer: the run has not ended
            assert _text(seen) == "The answer "
            assert not [ev for ev in seen if ev.type == "agent_end"]
            release(held_model[0])
            async for ev in run.stream(after=len(seen)):  # resumed after what was seen
                seen.append(ev)
            reply = await run.result()
    assert reply.text == "The answer is 42."
    assert _text(seen) == "The answer is 42."
    assert seen[0].type == "agent_start" and seen[-1].type == "agent_end"
    # the live stream is the run's stream: the same events, under the same ids, as its result's
    out = await run.handle.result()
    assert [ev.model_dump(mode="json") for ev in seen] == out["events"]


async def test_a_worker_killed_mid_answer_the_watched_stream_has_no_duplicate_and_ends_balanced(
        temporal_address: str, held_model: tuple[str, Path], workers: Workers, redis_url: str,
        redis_prefix: str) -> None:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    first = workers.start("durable_agents:build", queue, "--events", redis_url)
    client = await Client.connect(temporal_address)
    log = RedisEventLog(redis_url, prefix="agentscope")  # the workers' prefix
    run = await DurableAgent(client, factory="durable_agents:build", task_queue=queue, events=log).start("2 + 40?")
    seen: list[AgentEvent] = []
    async with asyncio.timeout(40):
        stream = run.stream().__aiter__()
        while not _text(seen):  # up to the answer's first piece: the model holds the rest
            seen.append(await anext(stream))
        first.kill()  # SIGKILL mid-answer: its model call starts again on the next worker
        first.wait(5)
        workers.start("durable_agents:build", queue, "--events", redis_url)
        release(held_model[0])
        seen += [ev async for ev in stream]
        reply = await run.result()
    await log.close()
    assert reply.text == "The answer is 42."
    assert _text(seen) == "The answer is 42."  # the retried call's first piece was not shown again
    # the answer was asked for twice at least (cut off, then again; more if a heartbeat was late)
    roles = held_model[1].read_text().split()
    assert roles.count('"tool"') >= 2, roles
    kinds = [ev.type for ev in seen]
    for opened, closed in (("model_call_start", "model_call_end"), ("text_block_start", "text_block_end"),
                           ("tool_call_start", "tool_call_end"), ("tool_result_start", "tool_result_end")):
        assert kinds.count(opened) == kinds.count(closed) > 0, (opened, kinds)
    assert kinds[0] == "agent_start" and kinds[-1] == "agent_end"
    # what was watched is the run's stream, under the same ids, though two workers made it (the
    # replay's own events were made again: their clocks differ)
    assert _no_clock([ev.model_dump(mode="json") for ev in seen]) == _no_clock((await run.handle.result())["events"])


def _no_clock(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in ev.items() if k != "created_at"} for ev in events]


async def test_a_failing_run_is_watched_to_its_failure(temporal_address: str, env: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from temporalio.client import WorkflowFailureError

    from agentscope_py.durable import ActivityConfig, DurableConfig

    monkeypatch.setenv("DURABLE_MODEL_URL", "http://127.0.0.1:9/v1")  # nothing listens: connection refused
    client = await Client.connect(temporal_address)
    queue, log = f"q-{uuid.uuid4().hex[:8]}", MemoryEventLog()
    config = DurableConfig(model=ActivityConfig(max_attempts=2, initial_interval=0.1))
    seen: list[AgentEvent] = []
    async with make_worker(client, ["durable_agents:build"], task_queue=queue, events=log, config=config):
        run = await DurableAgent(client, factory="durable_agents:build", task_queue=queue, events=log).start("2+40?")
        async with asyncio.timeout(20):
            with pytest.raises(WorkflowFailureError):
                async for ev in run.stream():
                    seen.append(ev)
    assert seen and seen[0].type == "agent_start"  # what the run did, then its failure
    assert (await log.read(run.run_id, len(seen), 0)).ended == "failed"
