"""Recorded runs: `first_divergence` names where today's agent departs from a recording, and
`fork` re-runs a recording from event k with another model, prompt or middleware, scoring both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentscope_py import ReActAgent
from agentscope_py.evals import Contains, RecordedRun, ToolTrajectory, compare_events, first_divergence, fork
from agentscope_py.middleware import MiddlewareBase
from agentscope_py.model import ModelStep, ScriptedModel

from .helpers import add, lookup

pytestmark = pytest.mark.timeout(30)

STEPS = [ModelStep.tool_call("add", {"a": 1, "b": 2}, id="t1", text="Adding."), ModelStep.text("It is 3.")]


def _agent(model: Any, *middlewares: Any, sys_prompt: str = "Add numbers.", tools: tuple[Any, ...] = (add, lookup)
           ) -> ReActAgent:
    return (ReActAgent.builder().name("calc").sys_prompt(sys_prompt).model(model).tools(*tools)
            .middlewares(list(middlewares)).build())


async def _recording() -> RecordedRun:
    return await RecordedRun.record(_agent(ScriptedModel(STEPS, name="gpt-x")), "What is 1 + 2?", note="v1")


async def test_a_recording_round_trips_and_replays_its_replies(tmp_path: Path) -> None:
    run = await _recording()
    assert run.agent == "calc" and run.model == "gpt-x" and run.output is not None and run.output.text == "It is 3."
    replies = run.replies()
    assert [(s.reply_text, [c.name for c in s.tool_calls]) for s in replies] == [("Adding.", ["add"]),
                                                                                  ("It is 3.", [])]
    assert replies[0].tool_calls[0].input == {"a": 1, "b": 2}
    run.save(tmp_path / "run.json")
    loaded = RecordedRun.load(tmp_path / "run.json")
    assert loaded.events == run.events and loaded.input == run.input and loaded.metadata == {"note": "v1"}
    with pytest.raises(ValueError, match="cannot read the recorded run"):
        RecordedRun.load(tmp_path / "missing.json")


async def test_the_same_agent_on_the_recorded_replies_does_not_diverge(tmp_path: Path) -> None:
    run = await _recording()
    run.save(tmp_path / "run.json")
    assert await first_divergence(run, _agent(run.scripted_model())) is None
    assert await first_divergence(tmp_path / "run.json", lambda: _agent(run.scripted_model())) is None


async def test_a_changed_tool_shows_where_behaviour_changed() -> None:
    run = await _recording()

    def add(a: int, b: int) -> int:  # today's add is off by one
        """Add two numbers."""
        return a + b + 1

    found = await first_divergence(run, _agent(run.scripted_model(), tools=(add, lookup)))
    assert found is not None
    assert (found.type, found.field, found.recorded, found.now) == ("tool_result_text_delta", "delta", "3", "4")
    assert run.events[found.index].type == "tool_result_text_delta"
    assert found.describe() == f"event {found.index} (tool_result_text_delta): delta: recorded '3', now '4'"


async def test_a_middleware_that_changes_behaviour_diverges_at_its_first_event() -> None:
    run = await _recording()

    class Shout(MiddlewareBase):
        def on_reasoning(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input).map(lambda e: e.model_copy(update={"delta": e.delta.upper()})
                                   if e.type == "text_block_delta" else e)

    found = await first_divergence(run, _agent(run.scripted_model(), Shout()))
    assert found is not None and (found.field, found.recorded, found.now) == ("delta", "Adding.", "ADDING.")


async def test_a_different_model_reply_and_a_failing_run_diverge() -> None:
    run = await _recording()
    other = ScriptedModel([ModelStep.tool_call("lookup", {"key": "x"}, id="t1", text="Adding."),
                           ModelStep.text("It is 3.")], name="gpt-x")
    found = await first_divergence(run, _agent(other))
    assert found is not None and found.type == "tool_call_start" and found.field == "tool_name"
    assert (found.recorded, found.now) == ("add", "lookup")
    broken = ScriptedModel([ModelStep.error(RuntimeError("down"))], name="gpt-x")
    failed = await first_divergence(run, _agent(broken))
    assert failed is not None and failed.error is not None and "down" in failed.error


def test_compare_events_reports_a_shorter_stream() -> None:
    from agentscope_py.events import AgentEnd, AgentStart

    start = AgentStart(reply_id="r1", name="a")
    found = compare_events([start, AgentEnd(reply_id="r1")], [start.model_copy(update={"reply_id": "r2"})])
    assert found is not None and (found.index, found.field, found.recorded, found.now) == (
        1, "(stream length)", "agent_end", "<end of stream>")


async def test_fork_with_another_model_scores_both_branches() -> None:
    run = await _recording()
    at = next(i for i, e in enumerate(run.events) if e.type == "model_call_end") + 1  # after the first reply
    better = ScriptedModel([ModelStep.text("The sum is 3, exactly.")], name="gpt-y")
    result = await fork(run, at, agent=_agent(ScriptedModel([])), model=better,
                        evaluators=[Contains("exactly"), ToolTrajectory(["add"])])
    assert result.replayed == 1 and result.error is None and result.output == "The sum is 3, exactly."
    assert [(r.evaluator, r.passed) for r in result.original] == [("Contains", False), ("ToolTrajectory", True)]
    assert [(r.evaluator, r.passed) for r in result.branch] == [("Contains", True), ("ToolTrajectory", True)]
    # The branch replays the recording up to the fork: it diverges at or after event k.
    assert result.divergence is not None and result.divergence.index >= at
    assert result.divergence.type == "model_call_start" and result.divergence.now == "gpt-y"
    table = result.render()
    assert "Contains        FAIL 0.00  PASS 1.00" in table and f"forked at event {at} (1 model call(s) replayed)" in table


async def test_fork_with_another_prompt_or_middleware_keeps_the_recorded_replies() -> None:
    run = await _recording()
    same = await fork(run, 0, agent=_agent(ScriptedModel([])), sys_prompt="Be terse.")
    assert same.divergence is None and same.output == "It is 3."  # the prompt only reaches the model

    class NoTools(MiddlewareBase):
        def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input.replace(tool_calls=()))

    changed = await fork(run, 0, agent=_agent(ScriptedModel([])), middlewares=[NoTools()],
                         evaluators=[ToolTrajectory(["add"])])
    assert changed.divergence is not None and changed.divergence.index > 0


async def test_fork_refuses_an_index_outside_the_run() -> None:
    run = await _recording()
    with pytest.raises(ValueError, match=r"at must be an event index in \[0, "):
        await fork(run, len(run.events) + 1, agent=_agent(ScriptedModel([])))
