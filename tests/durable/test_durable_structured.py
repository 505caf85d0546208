"""Structured output in durable runs: the output tool runs in the workflow (it records the
output in the run), the model calls are activities, and the caller gets the validated object."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from durable_agents import City
from durable_helpers import temporal_address
from pydantic import BaseModel
from temporalio.client import Client

from agentscope_py import GenerateReason
from agentscope_py.durable import MODEL_ACTIVITY, DurableAgent, make_worker
from agentscope_py.events import ToolResultEnd
from agentscope_py.message import ToolResultState

__all__ = ["temporal_address"]  # a fixture, used by name


async def test_structured_output_returns_the_validated_object(temporal_address: str) -> None:
    client = await Client.connect(temporal_address)
    queue = f"q-{uuid.uuid4().hex[:8]}"
    async with make_worker(client, ["durable_agents:build_structured"], task_queue=queue):
        agent = DurableAgent(client, factory="durable_agents:build_structured", task_queue=queue)
        async with asyncio.timeout(20):
            run = await agent.start("Which city has the Eiffel tower?", structured_model=City)
            msg = await run.result()
            events = await run.events()
        names = []
        async for event in client.get_workflow_handle(run.id).fetch_history_events():
            if event.HasField("activity_task_scheduled_event_attributes"):
                names.append(event.activity_task_scheduled_event_attributes.activity_type.name)
    assert msg.generate_reason is GenerateReason.STRUCTURED_OUTPUT
    assert msg.metadata["structured_output"] == City(name="Paris", country="France")
    assert msg.structured(City).country == "France"
    # the first answer did not validate: the model saw the error and answered again
    assert [ev.state for ev in events if isinstance(ev, ToolResultEnd)] == [ToolResultState.ERROR,
                                                                            ToolResultState.SUCCESS]
    assert names == [MODEL_ACTIVITY, MODEL_ACTIVITY]  # the output tool ran in the workflow


async def test_a_structured_model_the_workers_cannot_import_fails_at_start(temporal_address: str) -> None:
    class Inner(BaseModel):
        x: int

    agent = DurableAgent(await Client.connect(temporal_address), factory="durable_agents:build_structured")
    with pytest.raises(ValueError, match="importable by the workers"):
        await agent.start("hi", structured_model=Inner)
    with pytest.raises(TypeError, match="pydantic BaseModel class"):
        await agent.start("hi", structured_model=dict)
