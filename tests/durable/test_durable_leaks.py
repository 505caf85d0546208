"""Secrets in durable runs: with PII redaction on the agent, a run whose input, thinking, text, tool
result and structured output carry addresses, and every place the run writes searched for them —
Temporal's workflow history (every event, every payload), the workflow's queries, what
`DurableRun.result()` and `events()` return, the live events in Redis and the session the run
saved in Redis (every key under the test's prefix, every value). What stays raw on purpose is
docs/safety.md's "Where a secret goes": Temporal's history holds what crosses into the workflow
as it came — the run's input as the caller sent it, each model call's reply and each tool's
output as they were made, before the workflow's middleware redacts them — and a payload codec
(Temporal's encryption seam) is what keeps them out of the server's storage."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import uuid
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from durable_helpers import temporal_address
from durable_leak_agents import SECRETS, WORKFLOW_REDACTIONS, Contact
from redis_keys import redis_values
from temporalio.api.common.v1 import Payload
from temporalio.client import Client, WorkflowFailureError, WorkflowHistory
from temporalio.converter import DataConverter, PayloadCodec
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner

from agentscope_py.durable import AgentRunWorkflow, DurableAgent, MemoryEventLog, RedisEventLog, make_worker
from agentscope_py.events import AgentEvent

__all__ = ["temporal_address"]  # a fixture, used by name

INPUT = "input.7f3a@example.com"
CARD = "4111 1111 1111 1111"


@pytest.fixture
def prefix(monkeypatch: pytest.MonkeyPatch, redis_url: str, redis_prefix: str) -> str:
    """The test's own key prefix (`redis_prefix`) in the Redis at ``redis_url``, for the agents' stores."""
    monkeypatch.setenv("DURABLE_REDIS_URL", redis_url)
    monkeypatch.setenv("DURABLE_PREFIX", redis_prefix)
    return redis_prefix


class Deflate(PayloadCodec):
    """A payload codec standing in for an encrypting one: every payload leaves the process
    compressed (no plain text of it reaches the server), and comes back as it was."""

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [Payload(metadata={"encoding": b"binary/deflate"}, data=zlib.compress(p.SerializeToString()))
                for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        out = []
        for p in payloads:
            if p.metadata.get("encoding") == b"binary/deflate":
                p = Payload.FromString(zlib.decompress(p.data))
            out.append(p)
        return out


async def _sinks(address: str, factory: str, prefix: str, text: str, codec: PayloadCodec | None = None,
                 **start: Any) -> dict[str, str]:
    """One run on an in-process worker (live events in Redis), and every sink it wrote, as text:
    the history as the server stores it (with ``codec``, the workers' and the caller's payload
    codec, encoded)."""
    converter = dataclasses.replace(DataConverter.default, payload_codec=codec)
    client = await Client.connect(address, data_converter=converter)
    queue = f"q-{uuid.uuid4().hex[:8]}"
    url = os.environ["DURABLE_REDIS_URL"]
    log = RedisEventLog(url, prefix=prefix)
    try:
        async with make_worker(client, [factory], task_queue=queue, events=log):
            async with asyncio.timeout(30):
                run = await DurableAgent(client, factory=factory, task_queue=queue, events=log).start(
                    text, user_id="ada", session_id="s1", **start)
                reply, events = await run.result(), await run.events()
            handle = client.get_workflow_handle(run.id)
            sinks = {"result": reply.model_dump_json(), "events": repr([ev.model_dump() for ev in events])}
            for query in ("waiting", "asking", "questions", "external"):
                sinks[f"query {query}"] = repr(await handle.query(query))
            async for event in handle.fetch_history_events():
                name = f"history {event.event_id} {event.WhichOneof('attributes')}"
                sinks[name] = event.SerializeToString().decode("utf-8", "replace")
    finally:
        await log.close()
    sinks.update({f"redis {key}": value for key, value in (await redis_values(url, prefix)).items()})
    return sinks


def _leaks(sinks: dict[str, str], secrets: list[str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name, text in sinks.items():
        hit = [secret for secret in secrets if secret in text]
        if hit:
            found[name] = hit
    return found


def _history_leaks(leaks: dict[str, list[str]]) -> dict[str, list[str]]:
    """The history events among ``leaks``, by kind (their ids vary with the run's timing)."""
    kinds: dict[str, list[str]] = {}
    for name, secrets in leaks.items():
        assert name.startswith("history "), f"{name} holds {secrets}"
        kinds.setdefault(name.split()[-1], []).extend(secrets)
    return kinds


async def test_a_redacted_durable_run_leaves_no_secret_but_its_input_and_tool_output_in_the_history(
        temporal_address: str, prefix: str) -> None:
    sinks = await _sinks(temporal_address, "durable_leak_agents:build_leaky", prefix, f"I am {INPUT}, card {CARD}.")
    redis = " ".join(text for name, text in sinks.items() if name.startswith("redis "))
    assert "[REDACTED_CREDIT_CARD]" in redis  # the session (the input, redacted) and the live events are there
    assert "[REDACTED_EMAIL]" in sinks["result"]
    # Outside the history nothing holds a secret: the result, the events, the queries, the live
    # events and the session in Redis. The model call's activity redacts the reply it returns
    # (thinking, text), so the history holds only what crossed into the workflow raw: the input
    # (the workflow's start) and the tool's output (the tool call's activity result).
    assert _history_leaks(_leaks(sinks, [INPUT, CARD, *SECRETS.values()])) == {
        "workflow_execution_started_event_attributes": [INPUT, CARD],
        "activity_task_completed_event_attributes": [SECRETS["tool_result"]]}


async def test_a_redacted_durable_structured_output_leaves_no_secret(temporal_address: str, prefix: str) -> None:
    sinks = await _sinks(temporal_address, "durable_leak_agents:build_structured", prefix, "Who is Ada?",
                         structured_model=Contact)
    assert "[REDACTED_EMAIL]" in sinks["result"]  # metadata["structured_output"] too
    assert _leaks(sinks, [SECRETS["structured"]]) == {}


async def test_a_blocked_durable_reply_ends_as_locally_and_stays_out_of_the_history(temporal_address: str,
                                                                                     prefix: str) -> None:
    client = await Client.connect(temporal_address)
    queue, factory = f"q-{uuid.uuid4().hex[:8]}", "durable_leak_agents:build_blocking"
    log = MemoryEventLog()
    seen: list[AgentEvent] = []
    async with make_worker(client, [factory], task_queue=queue, events=log), asyncio.timeout(30):
        run = await DurableAgent(client, factory=factory, task_queue=queue, events=log).start("hi")
        with pytest.raises(WorkflowFailureError) as failed:
            async for event in run.stream():
                seen.append(event)
        history = [event async for event in client.get_workflow_handle(run.id).fetch_history_events()]
    assert "GuardrailTripped: guardrail pii:credit_card tripped" in str(failed.value.cause)
    # the events of a local run: the trip, then every block closed
    assert [e.type for e in seen] == ["agent_start", "model_call_start", "text_block_start", "guardrail_tripped",
                                      "text_block_end", "model_call_end", "agent_end"]
    ends = [e for e in history if e.HasField("workflow_execution_failed_event_attributes")]
    assert len(ends) == 1
    assert not any(CARD.encode() in event.SerializeToString() for event in history)


async def test_with_a_payload_codec_the_history_holds_no_secret(temporal_address: str, prefix: str) -> None:
    sinks = await _sinks(temporal_address, "durable_leak_agents:build_leaky", prefix, f"I am {INPUT}, card {CARD}.",
                         codec=Deflate())
    assert "[REDACTED_EMAIL]" in sinks["result"]  # the run went as without it
    assert _leaks(sinks, [INPUT, CARD, *SECRETS.values()]) == {}


OLD_HISTORY = Path(__file__).parent / "data" / "history_redacted_in_workflow.json"
"""A run of ``durable_leak_agents:build_counted`` recorded by workers that ran the redaction in
the workflow (its model calls' results hold the raw replies), with no `REDACTION_PATCH` marker."""


async def test_a_history_without_the_marker_keeps_redacting_in_the_workflow(temporal_address: str) -> None:
    replayer = Replayer(workflows=[AgentRunWorkflow], workflow_runner=UnsandboxedWorkflowRunner())
    WORKFLOW_REDACTIONS.clear()
    old = WorkflowHistory.from_json("old", OLD_HISTORY.read_text())
    assert (await replayer.replay_workflow(old, raise_on_replay_failure=False)).replay_failure is None
    assert len(WORKFLOW_REDACTIONS) == 2  # both model calls' raw results redacted by the workflow's chain
    # A run recorded now has the marker: its activities redact, on replay too.
    client = await Client.connect(temporal_address)
    queue, factory = f"q-{uuid.uuid4().hex[:8]}", "durable_leak_agents:build_counted"
    async with make_worker(client, [factory], task_queue=queue), asyncio.timeout(30):
        run = await DurableAgent(client, factory=factory, task_queue=queue).start("hello")
        assert "[REDACTED_EMAIL]" in (await run.result()).text
        new = await client.get_workflow_handle(run.id).fetch_history()
    WORKFLOW_REDACTIONS.clear()
    assert (await replayer.replay_workflow(new, raise_on_replay_failure=False)).replay_failure is None
    assert WORKFLOW_REDACTIONS == []
