"""A durable rollback takes the turn out of the sub-agents' sessions too, as a local one does
(tests/subagents/test_subagents_rollback.py): a sub-agent tool runs its whole sub-run in one tool
call's activity, on a worker, and the sessions it changed there — its own, and its own
sub-agents' — are put back as the rolled-back turn found them, whether its call had ended before
the interrupt, was running when it landed (its activity cancelled), or failed after saving its
turn. An interrupt without a rollback leaves the sub-agent's interrupted turn in its session. A
sub-agent that asks for approval inside the activity (no answer can reach it there) leaves a
usable session. A worker in this process, sessions in SQLite (`durable_subagent_agents`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from durable_helpers import activity_names, temporal_address
from temporalio.client import Client
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner
from test_durable_multitask import _holds, _worker, holding

from agentscope_py import GenerateReason, ToolResultState
from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.agent.state import AgentState
from agentscope_py.durable import AgentRunWorkflow, DurableAgent
from agentscope_py.events import ModelCallEnd, ToolResultEnd
from agentscope_py.message import ChatUsage, Msg

__all__ = ["holding", "temporal_address"]  # fixtures, used by name

pytestmark = pytest.mark.timeout(120)

FACTORY = "durable_subagent_agents:build"

HELPER_ENDS = {"hold after": ToolResultState.SUCCESS, "hold in helper": ToolResultState.INTERRUPTED,
               "refuse it": ToolResultState.ERROR}
"""How the lead's helper call ends in each rolled-back turn: it had ended, it ran when the
interrupt landed, it failed after saving its turn."""


@contextlib.asynccontextmanager
async def _agent(address: str, factory: str = FACTORY) -> AsyncIterator[tuple[DurableAgent, Client]]:
    async with _worker(address, factory) as (client, queue):
        yield DurableAgent(client, factory=factory, task_queue=queue), client


async def _sessions(store: Path) -> dict[str, AgentState | None]:
    async with SqliteStateStore(store) as db:
        return {sid: (await db.load("default", sid))[0] for sid in ("s", "s/helper", "s/helper/scribe")}


def _inputs(state: AgentState | None) -> list[str]:
    assert state is not None
    return [m.text for m in state.context if m.role == "user"]


async def test_a_durable_rollback_takes_the_turn_out_of_the_sub_agents_sessions(
        temporal_address: str, holding: tuple[Path, Path]) -> None:
    store, log = holding
    async with asyncio.timeout(90), _agent(temporal_address) as (agent, client):
        assert (await (await agent.start("one", session_id="s")).result()).text == "done one"
        kept = await _sessions(store)
        rolled_back = []
        for n, (word, after) in enumerate([("hold after", "two"), ("hold in helper", "three"),
                                           ("refuse it", "four")], 1):
            held = await agent.start(word, session_id="s")
            rolled_back.append(held)
            await _holds(log, n)  # the helper's call ended (or, "hold in helper", runs)
            nxt = await agent.start(after, session_id="s", multitask_strategy="rollback")
            rolled = await held.result()
            assert rolled.generate_reason is GenerateReason.INTERRUPTED and rolled.metadata["rolled_back"], word
            assert (await nxt.result()).text == f"done {after}"
            helper_end = [(e.source, e.state) for e in await held.events()
                          if type(e) is ToolResultEnd and e.tool_name == "helper"]
            assert helper_end == [(None, HELPER_ENDS[word])], (word, helper_end)
            now = await _sessions(store)
            for sid, before in kept.items():  # as the turn found them, and the next turn after
                assert before is not None
                state = now[sid]
                assert state is not None and state.context[:len(before.context)] == before.context, (word, sid)
                words = [w for w in _inputs(state)[len(_inputs(before)):]]
                assert words == [after if sid == "s" else f"remember {after}"], (word, sid, words)
            kept = now
            if word == "hold after":  # the put-back is a step of the history: a replay does not redo it
                names = await activity_names(client, held.handle.id, held.handle.result_run_id)
                assert "agentscope.put_back_sessions" in names, names
        histories = [await client.get_workflow_handle(run.handle.id, run_id=run.handle.result_run_id).fetch_history()
                     for run in rolled_back]
    # Each rolled-back run replays as it ran (its notes and its put-back come from its history).
    replayer = Replayer(workflows=[AgentRunWorkflow], workflow_runner=UnsandboxedWorkflowRunner())
    for history in histories:
        assert (await replayer.replay_workflow(history, raise_on_replay_failure=False)).replay_failure is None


async def test_an_interrupt_leaves_the_sub_agents_interrupted_turn_in_its_session(
        temporal_address: str, holding: tuple[Path, Path]) -> None:
    store, log = holding
    async with asyncio.timeout(60), _agent(temporal_address) as (agent, _):
        held = await agent.start("hold in helper", session_id="s")
        await _holds(log, 1)
        await held.interrupt()
        stopped = await held.result()
        sessions = await _sessions(store)
        assert (await (await agent.start("two", session_id="s")).result()).text == "done two"
        after = await _sessions(store)
    assert stopped.generate_reason is GenerateReason.INTERRUPTED and "rolled_back" not in stopped.metadata
    helper = sessions["s/helper"]
    assert _inputs(helper) == ["remember hold in helper"]
    assert helper is not None and helper.context[-1].generate_reason is GenerateReason.INTERRUPTED
    calls = [c.id for m in helper.context for c in m.tool_calls]
    answered = [b.id for m in helper.context for b in m.tool_results]
    assert sorted(calls) == sorted(answered) and len(calls) == 2  # the scribe's call and the hold, answered
    assert _inputs(sessions["s/helper/scribe"]) == ["remember hold in helper"]
    assert _inputs(after["s/helper"]) == ["remember hold in helper", "remember two"]


async def test_a_sub_agent_that_asks_inside_a_tool_call_leaves_a_usable_session(
        temporal_address: str, holding: tuple[Path, Path]) -> None:
    store, log = holding
    async with asyncio.timeout(60), _agent(temporal_address, "durable_subagent_agents:build_asking") as (agent, _):
        for word in ("one", "two"):
            assert (await (await agent.start(word, session_id="s")).result()).text == f"done {word}"
        kept = await _sessions(store)
        held = await agent.start("hold after", session_id="s")
        await _holds(log, 1)
        nxt = await agent.start("three", session_id="s", multitask_strategy="rollback")
        assert (await held.result()).metadata["rolled_back"]
        await nxt.result()
        after = await _sessions(store)
    # Each call's result is the pause's error, the second's too: the first's waiting call does
    # not refuse the next task (it is answered, as not run).
    lead = after["s"]
    assert lead is not None
    outputs = [str(b.output) for m in lead.context for b in m.tool_results]
    assert len(outputs) == 3 and all("a sub-agent cannot wait for the user inside a durable tool call" in out
                                     for out in outputs), outputs
    helper = kept["s/helper"]
    assert _inputs(helper) == ["remember one", "remember two"]
    assert helper is not None and not helper.pending_tool_calls
    results = [b for m in helper.context for b in m.tool_results]
    assert [b.state for b in results] == [ToolResultState.ERROR] * 2 and "Not run" in str(results[0].output)
    # The rolled-back turn's pause is taken out too (its answered calls included).
    state = after["s/helper"]
    assert state is not None and state.context[:len(helper.context)] == helper.context
    assert _inputs(state) == ["remember one", "remember two", "remember three"]


async def test_a_durable_runs_usage_counts_its_sub_agents(temporal_address: str, holding: tuple[Path, Path]) -> None:
    async with asyncio.timeout(60), _agent(temporal_address) as (agent, _):
        run = await agent.start("one", session_id="s")
        reply, events = await run.result(), await run.events()
    ends = [e for e in events if type(e) is ModelCallEnd]
    # The sub-agents' events name them as a local run's do (under the root's name).
    assert {e.source for e in ends} == {None, "lead/helper", "lead/helper/scribe"}
    assert all(e.usage is not None for e in ends)
    total = sum((e.usage for e in ends if e.usage is not None), ChatUsage())
    assert reply.usage == total, (reply.usage, total)  # the tree's, as a local run's reply counts it


async def test_the_roots_middleware_reaches_the_sub_agents_of_a_durable_run(
        temporal_address: str, holding: tuple[Path, Path]) -> None:
    from durable_subagent_agents import PATHS

    PATHS.clear()
    async with asyncio.timeout(60), _agent(temporal_address, "durable_subagent_agents:build_watched") as (agent, _):
        assert (await (await agent.start("one", session_id="s")).result()).text == "done one"
    # The lead's two rounds (in the workflow: replays may add some), the helper's two and the
    # scribe's one, in the tool call's activity: as a local run's (tests/subagents).
    assert PATHS.count("lead/helper") == 2 and PATHS.count("lead/helper/scribe") == 1, PATHS
    assert set(PATHS) == {"lead", "lead/helper", "lead/helper/scribe"}, PATHS


async def test_a_sub_agent_session_saved_since_the_turn_keeps_what_it_has(
        temporal_address: str, holding: tuple[Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    store, log = holding
    async with asyncio.timeout(60), _agent(temporal_address) as (agent, _):
        held = await agent.start("hold after", session_id="s")
        await _holds(log, 1)
        async with SqliteStateStore(store) as db:  # someone else saves the helper's session meanwhile
            state, version = await db.load("default", "s/helper")
            assert state is not None
            state.context.append(Msg.user("from elsewhere"))
            await db.save("default", "s/helper", state, version)
        await held.interrupt(rollback=True)
        assert (await held.result()).metadata["rolled_back"]
        sessions = await _sessions(store)
    assert _inputs(sessions["s"]) == []  # the caller's turn is taken back
    assert _inputs(sessions["s/helper"]) == ["remember hold after", "from elsewhere"]  # the helper's keeps it
    assert _inputs(sessions["s/helper/scribe"]) == []  # the scribe's, untouched since, is put back
    assert any("s/helper keeps the rolled-back turn" in r.getMessage() for r in caplog.records), caplog.text
