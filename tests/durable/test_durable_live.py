"""Live events of durable runs: published from the activities (the model call's deltas as they
come) and from the workflow, watched while the run goes, resumed from a position, and the same
whichever worker replays the run."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from durable_helpers import temporal_address
from durable_live_helpers import held_model, release
from temporalio.client import Client

from agentscope_py.durable import DurableAgent, MemoryEventLog, make_worker
from agentscope_py.events import AgentEvent, TextBlockDelta

__all__ = ["held_model", "temporal_address"]  # fixtures, used by name


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
