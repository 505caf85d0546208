"""Durable runs that wait for the caller: external tools (the caller executes them and sends the
results) and a tool's question to the user (`ToolInputRequired`, what an MCP elicitation
raises), each waiting in the workflow with no worker held, resumed across a worker restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from durable_helpers import Workers, activity_names, model_server, requests, temporal_address, waiting_run, workers
from temporalio.client import Client

from agentscope_py import GenerateReason, ToolResultState
from agentscope_py.durable import TOOL_ACTIVITY
from agentscope_py.errors import ResumeError
from agentscope_py.events import (
    ConfirmResult,
    ExternalExecutionResult,
    RequireExternalExecution,
    RequireUserConfirm,
    ToolResultEnd,
)
from agentscope_py.message import ToolResultBlock

__all__ = ["model_server", "temporal_address", "workers"]  # fixtures, used by name


async def test_an_external_tool_waits_for_the_caller_s_result_across_a_worker_restart(
        temporal_address: str, model_server: tuple[str, Path], workers: Workers) -> None:
    run, first, queue = await waiting_run(workers, "durable_agents:build_external")
    calls = await run.external()
    assert [(c.name, c.input) for c in calls] == [("add", {"a": 2, "b": 40})]
    assert await run.asking() == [] and await run.questions() == {}
    with pytest.raises(ResumeError, match="does not wait on"):
        await run.send_tool_results(ToolResultBlock(id="nope", name="add", output="1"))
    first.kill()  # nothing holds the waiting run
    first.wait(5)
    workers.start("durable_agents:build_external", queue)
    await run.send_tool_results(ToolResultBlock(id=calls[0].id, name="add", output="42"))
    async with asyncio.timeout(20):
        reply = await run.result()
        events = await run.events()
    assert reply.text == "The answer is 42." and reply.generate_reason is GenerateReason.MODEL_STOP
    assert requests(model_server[1]) == 2  # the first turn's model call was not made again
    assert [type(ev) for ev in events].count(RequireExternalExecution) == 1
    results = [ev for ev in events if isinstance(ev, ExternalExecutionResult)]
    assert [r.tool_results[0].output for r in results] == ["42"]
    assert TOOL_ACTIVITY not in await activity_names(await Client.connect(temporal_address), run.id)  # the caller ran it
    assert not await run.waiting()


async def test_a_tool_s_question_is_answered_through_the_durable_run(
        temporal_address: str, model_server: tuple[str, Path], workers: Workers, tmp_path: Path) -> None:
    run, first, queue = await waiting_run(workers, "durable_agents:build_questioning")
    asking = await run.asking()
    assert [c.name for c in asking] == ["add"]
    questions = await run.questions()
    assert questions[asking[0].id]["message"] == "In which base?"
    assert "base" in questions[asking[0].id]["schema"]["properties"]
    # the question ended the activity at once (not retried as a failure)
    assert len((tmp_path / "tool_log").read_text().split()) == 1
    first.kill()
    first.wait(5)
    workers.start("durable_agents:build_questioning", queue)
    await run.confirm(ConfirmResult(tool_call_id=asking[0].id, confirmed=True, answer={"base": 10}))
    async with asyncio.timeout(20):
        reply = await run.result()
        events = await run.events()
    assert reply.text == "The answer is 42 (base 10)."
    assert len((tmp_path / "tool_log").read_text().split()) == 2  # the call ran again, with the answer
    assert requests(model_server[1]) == 2
    assert [(ev.tool_name, ev.state) for ev in events if isinstance(ev, ToolResultEnd)] == [
        ("add", ToolResultState.RUNNING), ("add", ToolResultState.SUCCESS)]
    assert [type(ev) for ev in events].count(RequireUserConfirm) == 1


async def test_a_turn_waiting_on_an_approval_and_an_external_call_takes_both_answers_in_one_signal(
        temporal_address: str, workers: Workers) -> None:
    """Confirms and external results sent together (`DurableRun.confirm(..., tool_results=...)`,
    what the server sends for a request carrying both) are one input of the next turn; an answer
    for a call that does not wait on it refuses both."""
    run, _, _ = await waiting_run(workers, "durable_agents:build_mixed")
    assert [c.id for c in await run.asking()] == ["c-add"]
    assert [c.id for c in await run.external()] == ["c-click"]
    approve = ConfirmResult(tool_call_id="c-add", confirmed=True)
    with pytest.raises(ResumeError, match="does not wait on"):
        await run.confirm(approve, tool_results=[ToolResultBlock(id="c-add", name="add", output="1")])
    await run.confirm(approve, tool_results=[ToolResultBlock(id="c-click", name="click", output="clicked")])
    async with asyncio.timeout(30):
        reply = await run.result()
    assert reply.text == "done: add=42, click=clicked" and reply.generate_reason is GenerateReason.MODEL_STOP
    assert not await run.waiting()
