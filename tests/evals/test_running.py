"""Running a dataset: a fresh agent and session per run, bounded concurrency, repeat with pass@k
and flakiness, per-case timeouts, failures that stop nothing, the progress bar only in a
terminal; and the report: table, JSON, compare."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import pytest

from agentscope_py import ReActAgent
from agentscope_py.evals import (
    Case,
    CaseTimeout,
    Contains,
    Dataset,
    EvalContext,
    EvaluationReport,
    ToolTrajectory,
)
from agentscope_py.evals._progress import Progress
from agentscope_py.events import AgentStart
from agentscope_py.message import ChatUsage
from agentscope_py.middleware import ModelPrice
from agentscope_py.model import ChatChunk, ModelStep, ScriptedModel

from .helpers import calculator

pytestmark = pytest.mark.timeout(30)


def _cases(n: int) -> list[Case]:
    return [Case(f"c{i}", f"{i} + 1?", expected_output=str(i + 1), metadata={"args": {"a": i, "b": 1}})
            for i in range(n)]


async def test_a_fresh_agent_and_session_per_run() -> None:
    built: list[ReActAgent] = []
    sessions: list[str | None] = []

    def factory(case: Case) -> ReActAgent:
        built.append(calculator(case))
        return built[-1]

    def session(ctx: EvalContext) -> bool:
        sessions.extend(e.session_id for e in ctx.events if isinstance(e, AgentStart))
        return True

    report = await Dataset(_cases(3), [Contains(), session]).evaluate(factory, repeat=2)
    assert report.pass_rate == 1.0 and len(report.attempts) == 6
    assert len({id(a) for a in built}) == 6
    assert len(set(sessions)) == 6 and all(s and s.startswith("eval-c") for s in sessions)


async def test_a_factory_without_arguments_and_an_async_one() -> None:
    async def factory() -> ReActAgent:
        return ReActAgent.builder().model(ScriptedModel([ModelStep.text("hi")])).build()

    report = await Dataset([Case("a", "x", expected_output="hi")], [Contains()]).evaluate(factory)
    assert report.pass_rate == 1.0
    report = await Dataset([Case("a", "x", expected_output="hi")], [Contains()]).evaluate(
        lambda: ReActAgent.builder().model(ScriptedModel([ModelStep.text("hi")])).build())
    assert report.pass_rate == 1.0


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_runs_in_parallel_up_to_the_concurrency(concurrency: int) -> None:
    active = 0
    peak = 0

    async def slow(x: int) -> int:
        """Slow."""
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.02)
        active -= 1
        return x

    def factory(case: Case) -> ReActAgent:
        steps = [ModelStep.tool_call("slow", {"x": 1}), ModelStep.text("ok")]
        return ReActAgent.builder().model(ScriptedModel(steps)).tools(slow).build()

    report = await Dataset(_cases(8), [lambda ctx: ctx.text == "ok"]).evaluate(factory, concurrency=concurrency)
    assert report.pass_rate == 1.0 and peak == concurrency


async def test_repeat_gives_pass_at_k_and_flakiness() -> None:
    runs: dict[str, int] = {}

    def factory(case: Case) -> ReActAgent:
        n = runs[case.name] = runs.get(case.name, 0) + 1
        answer = {"steady": "yes", "flaky": "yes" if n % 2 else "no", "broken": "no"}[case.name]
        return ReActAgent.builder().model(ScriptedModel([ModelStep.text(answer)])).build()

    cases = [Case(name, "q", expected_output="yes") for name in ("steady", "flaky", "broken")]
    report = await Dataset(cases, [Contains()]).evaluate(factory, repeat=4, concurrency=2)
    steady, flaky, broken = report.cases
    assert (steady.passed, steady.pass_at_k, steady.flaky, steady.pass_rate) == (True, True, False, 1.0)
    assert (flaky.passed, flaky.pass_at_k, flaky.flaky, flaky.pass_rate) == (False, True, True, 0.5)
    assert (broken.passed, broken.pass_at_k, broken.flaky) == (False, False, False)
    assert report.pass_rate == pytest.approx(6 / 12) and report.pass_at_k == pytest.approx(2 / 3)
    assert [c.name for c in report.flaky] == ["flaky"]
    assert "2/4" in report.render() and "pass@4 66.7%" in report.render() and "flaky: flaky" in report.render()


async def test_a_failing_or_hanging_case_never_stops_the_others() -> None:
    slow_models: list[ScriptedModel] = []

    def factory(case: Case) -> ReActAgent:
        if case.name == "factory_fails":
            raise RuntimeError("no agent today")
        if case.name == "model_fails":
            return ReActAgent.builder().model(ScriptedModel([ModelStep.error(ValueError("bad gateway"))])).build()
        if case.name == "hangs":
            slow_models.append(ScriptedModel([ModelStep.text("late", chunks=5, delay=5.0)]))
            return ReActAgent.builder().model(slow_models[-1]).build()
        return calculator(case)

    cases = [*_cases(3), Case("factory_fails", "q"), Case("model_fails", "q"), Case("hangs", "q", timeout=0.2)]
    report = await Dataset(cases, [Contains("")]).evaluate(factory, concurrency=6)
    by_name = {c.name: c.attempts[0] for c in report.cases}
    assert all(by_name[f"c{i}"].passed for i in range(3))
    assert by_name["factory_fails"].error == "RuntimeError: no agent today"
    assert by_name["model_fails"].error is not None and "bad gateway" in by_name["model_fails"].error
    assert by_name["hangs"].error == "CaseTimeout: case 'hangs' timed out after 0.2 s"
    assert 0.2 <= by_name["hangs"].duration < 2.0
    assert slow_models[0].closed_streams == 1  # the timed-out run was closed, its model request too
    assert report.pass_rate == pytest.approx(3 / 6)
    assert issubclass(CaseTimeout, TimeoutError)
    # The failing runs keep their events in the report; the passing ones do not.
    assert by_name["hangs"].events and by_name["hangs"].events[0]["type"] == "agent_start"
    assert by_name["c0"].events is None


async def test_a_run_that_raises_cancelled_error_of_its_own_is_its_failure_alone() -> None:
    # The run's CancelledError is its own failure (test_running_cuts.py draws it at random): raised
    # on, it would end the evaluation with no report and the other runs in flight.
    class Cancels:
        name = "cancels"

        async def stream(self, request: Any) -> Any:
            await asyncio.sleep(0)
            raise asyncio.CancelledError
            yield  # (an async generator)

    def factory(case: Case) -> ReActAgent:
        return ReActAgent(model=Cancels()) if case.name == "cancels" else calculator(case)

    before = asyncio.all_tasks()
    report = await Dataset([*_cases(3), Case("cancels", "q")], [Contains("")]).evaluate(factory, concurrency=4)
    assert asyncio.all_tasks() <= before
    by_name = {c.name: c.attempts[0] for c in report.cases}
    assert all(by_name[f"c{i}"].passed for i in range(3))
    assert by_name["cancels"].error == (
        "CancelledError: the run raised CancelledError; nothing cancelled the evaluation")


async def test_an_evaluation_that_fails_leaves_no_run_in_flight() -> None:
    # A failure outside the runs (here pricing a usage no float holds, from a model of one's own)
    # ends the evaluation with it; the runs in flight are closed first, not left running.
    class Counts:
        name = "counts"

        async def stream(self, request: Any) -> Any:
            yield ChatChunk(text="ok", usage=ChatUsage(input_tokens=10**400), finish_reason="stop")

    slow_models: list[ScriptedModel] = []

    def factory(case: Case) -> ReActAgent:
        if case.name == "counts":
            return ReActAgent(model=Counts())
        slow_models.append(ScriptedModel([ModelStep.text("late", delay=5.0)]))
        return ReActAgent(model=slow_models[-1])

    before = asyncio.all_tasks()
    cases = [Case("a", "q"), Case("b", "q"), Case("counts", "q")]
    with pytest.raises(OverflowError):
        await Dataset(cases, [Contains("")]).evaluate(factory, concurrency=3, prices={"counts": ModelPrice(1, 1)})
    assert asyncio.all_tasks() <= before
    assert [m.closed_streams for m in slow_models] == [1, 1]


async def test_an_empty_dataset_gives_an_empty_report() -> None:
    def factory() -> ReActAgent:
        raise AssertionError("no case: no agent is built")

    report = await Dataset([], [Contains("")]).evaluate(factory, concurrency=4)
    assert report.cases == [] and report.pass_rate == 0.0


async def test_a_models_own_timeout_is_not_the_cases() -> None:
    def factory() -> ReActAgent:
        return ReActAgent.builder().model(ScriptedModel([ModelStep.error(TimeoutError("model slow"))])).build()

    report = await Dataset([Case("a", "q")], [Contains("")]).evaluate(factory, timeout=10)
    assert report.cases[0].attempts[0].error == "TimeoutError: model slow"


def test_the_progress_bar_draws_only_in_a_terminal() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, pipe = Terminal(), io.StringIO()
    for out in (tty, pipe):
        bar = Progress(3, label="d", file=out, interval=0.0)
        for passed in (True, False, True):
            bar.advance(passed)
        bar.close()
    assert "3/3, 1 failed" in tty.getvalue() and "[" in tty.getvalue()
    assert pipe.getvalue() == ""


async def test_evaluate_draws_no_bar_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    await Dataset(_cases(2), [Contains()]).evaluate(calculator)
    assert capsys.readouterr().err == ""
    await Dataset(_cases(2), [Contains()]).evaluate(calculator, progress=True)
    assert "2/2" in capsys.readouterr().err


async def test_bad_arguments_are_refused() -> None:
    dataset = Dataset(_cases(1), [Contains()])
    with pytest.raises(ValueError, match="concurrency must be an int >= 1"):
        await dataset.evaluate(calculator, concurrency=0)
    with pytest.raises(ValueError, match="repeat must be an int >= 1"):
        await dataset.evaluate(calculator, repeat=0)
    with pytest.raises(TypeError, match="agent_factory must be a function"):
        await dataset.evaluate("pkg:factory")  # type: ignore[arg-type]


async def test_the_report_aggregates_renders_and_round_trips_as_json() -> None:
    cases = _cases(3)
    cases[2] = cases[2].model_copy(update={"metadata": {"args": {"a": 2, "b": 1}, "answer": "four"}})
    report = await Dataset(cases, [Contains(), ToolTrajectory(["add"])], name="sums").evaluate(calculator)
    assert report.pass_rate == pytest.approx(2 / 3) and [c.name for c in report.failures] == ["c2"]
    assert report.mean_score == pytest.approx((1 + 1 + 0.5) / 3)
    assert report.tokens > 0 and report.p50_duration > 0 and report.p95_duration >= report.p50_duration
    table = report.render()
    assert "c2    FAIL   0.50" in table and "FAIL c2: Contains: output 'four' lacks '3'" in table
    out = io.StringIO()
    report.print(out)
    assert out.getvalue().strip() == table
    data = json.loads(report.to_json())
    assert data["summary"]["pass_rate"] == pytest.approx(2 / 3) and data["cases"][2]["attempts"][0]["events"]
    again = EvaluationReport.from_json(report.to_json())
    assert again.render().splitlines()[:5] == table.splitlines()[:5]
    assert again.case("c2").result("Contains").reason == report.case("c2").result("Contains").reason


async def test_compare_lists_regressions_and_improvements_case_by_case(tmp_path: Any) -> None:
    def answers(wrong: set[str]) -> Any:
        def factory(case: Case) -> ReActAgent:
            text = "nope" if case.name in wrong else str(case.expected_output)
            return ReActAgent.builder().model(ScriptedModel([ModelStep.text(text)])).build()
        return factory

    dataset = Dataset(_cases(4), [Contains()])
    baseline = await dataset.evaluate(answers({"c1"}))
    baseline.save(tmp_path / "old.json")
    now = await Dataset([*_cases(3), Case("new", "q", expected_output="q")], [Contains()]).evaluate(
        answers({"c2"}))
    diff = now.compare(EvaluationReport.load(tmp_path / "old.json"))
    assert [c.case for c in diff.regressions] == ["c2"] and diff.regressions[0].worse == ["Contains"]
    assert [c.case for c in diff.improvements] == ["c1"] and diff.improvements[0].better == ["Contains"]
    assert diff.added == ["new"] and diff.removed == ["c3"]
    text = diff.render()
    assert "REGRESSED c2: pass 100% -> 0%" in text and "IMPROVED  c1: pass 0% -> 100%" in text
    assert json.loads(json.dumps(diff.to_json()))["regressions"][0]["case"] == "c2"
    with pytest.raises(ValueError, match="cannot read the evaluation report"):
        (tmp_path / "junk.json").write_text("{}")
        EvaluationReport.load(tmp_path / "junk.json")


async def test_cancelling_the_evaluation_is_not_taken_for_a_timeout() -> None:
    def slow() -> ReActAgent:
        return ReActAgent.builder().model(ScriptedModel([ModelStep.text("late", delay=5.0)])).build()

    task = asyncio.create_task(Dataset([Case("a", "q"), Case("b", "q")], [Contains("")]).evaluate(slow, timeout=30))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
