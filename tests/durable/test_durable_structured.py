"""Structured output and MCP servers in durable runs (in-process workers, scripted models): the
output tool runs in the workflow (it records the output in the run) and the caller gets the
validated object; an MCP server's tools are listed and called by the workers, and its question
to the user (an elicitation) is answered through the run."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from durable_agents import City
from durable_helpers import activity_names, temporal_address
from pydantic import BaseModel
from temporalio.client import Client

from agentscope_py import GenerateReason
from agentscope_py.durable import MODEL_ACTIVITY, TOOL_ACTIVITY, DurableAgent, make_worker
from agentscope_py.events import AgentEvent, ConfirmResult, ToolResultEnd, ToolResultTextDelta
from agentscope_py.message import Msg, ToolResultState

__all__ = ["temporal_address"]  # a fixture, used by name


async def _run(address: str, factory: str, text: str, **start: Any) -> tuple[Msg, list[AgentEvent], list[Any]]:
    """One run on an in-process worker: its reply, its events, and its history's events."""
    client = await Client.connect(address)
    queue = f"q-{uuid.uuid4().hex[:8]}"
    async with make_worker(client, [factory], task_queue=queue):
        async with asyncio.timeout(20):
            run = await DurableAgent(client, factory=factory, task_queue=queue).start(text, **start)
            reply, events = await run.result(), await run.events()
        history = [event async for event in client.get_workflow_handle(run.id).fetch_history_events()]
    return reply, events, history


def _names(history: list[Any]) -> list[str]:
    return [e.activity_task_scheduled_event_attributes.activity_type.name for e in history
            if e.HasField("activity_task_scheduled_event_attributes")]


async def test_structured_output_returns_the_validated_object(temporal_address: str) -> None:
    msg, events, history = await _run(temporal_address, "durable_agents:build_structured",
                                      "Which city has the Eiffel tower?", structured_model=City)
    assert msg.generate_reason is GenerateReason.STRUCTURED_OUTPUT
    assert msg.metadata["structured_output"] == City(name="Paris", country="France")
    assert msg.structured(City).country == "France"
    # the first answer did not validate: the model saw the error and answered again
    assert [ev.state for ev in events if isinstance(ev, ToolResultEnd)] == [ToolResultState.ERROR,
                                                                            ToolResultState.SUCCESS]
    assert _names(history) == [MODEL_ACTIVITY, MODEL_ACTIVITY]  # the output tool ran in the workflow


async def test_a_structured_model_the_workers_cannot_import_fails_at_start(temporal_address: str) -> None:
    class Inner(BaseModel):
        x: int

    agent = DurableAgent(await Client.connect(temporal_address), factory="durable_agents:build_structured")
    with pytest.raises(ValueError, match="importable by the workers"):
        await agent.start("hi", structured_model=Inner)
    with pytest.raises(TypeError, match="pydantic BaseModel class"):
        await agent.start("hi", structured_model=dict)


@pytest.mark.mcp
async def test_an_mcp_elicitation_is_answered_through_the_durable_run(
        temporal_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentscope_py.durable import LIST_TOOLS_ACTIVITY

    log = tmp_path / "mcp.log"
    log.touch()
    monkeypatch.setenv("DURABLE_MCP_LOG", str(log))
    client = await Client.connect(temporal_address)
    queue = f"q-{uuid.uuid4().hex[:8]}"
    async with make_worker(client, ["durable_agents:build_mcp"], task_queue=queue):
        agent = DurableAgent(client, factory="durable_agents:build_mcp", task_queue=queue)
        async with asyncio.timeout(40):
            run = await agent.start("What colour do I like?")
            while not await run.waiting():
                await asyncio.sleep(0.1)
            assert [c.name for c in await run.asking()] == ["favourite_colour"]
            question = (await run.questions())["q1"]
            assert question["message"] == "What is your favourite colour?" and "colour" in question["schema"]["properties"]
            await run.confirm(ConfirmResult(tool_call_id="q1", confirmed=True, answer={"colour": "green"}))
            reply = await run.result()
            events = await run.events()
        names = await activity_names(client, run.id)
    assert reply.text == "noted"
    results = [ev for ev in events if isinstance(ev, ToolResultEnd)]
    assert [ev.state for ev in results] == [ToolResultState.RUNNING, ToolResultState.SUCCESS]
    texts = "".join(ev.delta for ev in events if isinstance(ev, ToolResultTextDelta))
    assert "the user likes green" in texts
    # the server's tools were listed by a worker (once per turn), and called as tool activities
    assert names.count(LIST_TOOLS_ACTIVITY) == 2 and names.count(TOOL_ACTIVITY) == 2


async def test_a_sub_agent_asking_inside_a_tool_activity_fails_the_call_once_with_a_clear_error(
        temporal_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DURABLE_TOOL_LOG", str(tmp_path / "tool_log"))
    reply, events, history = await _run(temporal_address, "durable_agents:build_subagent_asking", "add 2 and 40")
    attempts = [e.activity_task_started_event_attributes.attempt for e in history
                if e.HasField("activity_task_started_event_attributes")]
    assert reply.text == "could not"
    texts = "".join(ev.delta for ev in events if isinstance(ev, ToolResultTextDelta) and ev.source is None)
    assert "a sub-agent cannot wait for the user inside a durable tool call" in texts, texts
    assert _names(history).count(TOOL_ACTIVITY) == 1 and set(attempts) == {1}  # not retried: trying again cannot help
