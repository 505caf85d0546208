"""The built-in evaluators over real (scripted) runs, your own evaluators, and evaluators that
fail: each is its own failed result, the others unaffected."""

from __future__ import annotations

import re
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from pydantic import BaseModel

from agentscope_py.evals import (
    Case,
    Contains,
    Dataset,
    Equals,
    EvalContext,
    EvalResult,
    Evaluator,
    HasEvent,
    HasMatchingSpan,
    Matches,
    MaxCost,
    MaxDuration,
    MaxModelCalls,
    MaxTokens,
    NoToolCall,
    StructuredEquals,
    ToolTrajectory,
    run_evaluator,
)
from agentscope_py.message import ChatUsage
from agentscope_py.middleware import ModelPrice, OtelTracingMiddleware
from agentscope_py.model import ModelStep

from .helpers import calculator, run_context

pytestmark = pytest.mark.timeout(30)


async def test_output_evaluators() -> None:
    ctx = await run_context([ModelStep.text("  The answer is 42.  ")],
                            case=Case("c", "q", expected_output="The answer is 42."))
    assert (await run_evaluator(Equals(), ctx)).passed
    assert not (await run_evaluator(Equals(strip=False), ctx)).passed
    assert (await run_evaluator(Equals("the answer is 42.", ignore_case=True), ctx)).passed
    wrong = await run_evaluator(Equals("43"), ctx)
    assert not wrong.passed and wrong.score == 0.0 and "'43'" in (wrong.reason or "")
    assert (await run_evaluator(Contains("42"), ctx)).passed
    partly = await run_evaluator(Contains(["42", "forty-two"]), ctx)
    assert not partly.passed and partly.score == 0.5 and "forty-two" in (partly.reason or "")
    assert (await run_evaluator(Matches(r"answer is \d+"), ctx)).passed
    assert not (await run_evaluator(Matches(r"^\d+$"), ctx)).passed
    with pytest.raises(re.error):
        Matches("(unclosed")


class Weather(BaseModel):
    city: str
    degrees: int
    sky: str


async def test_structured_equals_field_by_field() -> None:
    step = ModelStep.tool_call("generate_response", {"city": "Oslo", "degrees": 3, "sky": "grey"})
    ctx = await run_context([step], structured_model=Weather)
    assert isinstance(ctx.structured, Weather)
    assert (await run_evaluator(StructuredEquals(Weather(city="Oslo", degrees=3, sky="grey")), ctx)).passed
    off = await run_evaluator(StructuredEquals({"city": "Oslo", "degrees": 5, "sky": "blue"}), ctx)
    assert not off.passed and off.score == pytest.approx(1 / 3)
    assert "degrees: 3 != expected 5" in (off.reason or "") and off.details["fields"] == ["degrees", "sky"]
    assert (await run_evaluator(StructuredEquals('{"city": "Oslo"}'), ctx)).passed  # JSON, a subset
    assert (await run_evaluator(StructuredEquals({"city": "Oslo", "sky": "blue"}, fields=["city"]), ctx)).passed
    # Without a structured model the output text is read as JSON.
    text = await run_context([ModelStep.text('{"city": "Rome", "degrees": 20}')])
    assert (await run_evaluator(StructuredEquals({"city": "Rome"}), text)).passed
    plain = await run_context([ModelStep.text("not json")])
    failed = await run_evaluator(StructuredEquals({"city": "Rome"}), plain)
    assert not failed.passed and failed.error is not None and "not JSON" in failed.error


def _calls(*calls: tuple[str, dict[str, Any]]) -> list[ModelStep]:
    return [*(ModelStep.tool_call(name, args) for name, args in calls), ModelStep.text("done")]


@pytest.mark.parametrize(("expected", "mode", "args", "passed"), [
    ([("add", {"a": 1, "b": 2}), ("lookup", {"key": "k"})], "strict", "exact", True),
    ([("lookup", {"key": "k"}), ("add", {"a": 1, "b": 2})], "strict", "exact", False),
    ([("lookup", {"key": "k"}), ("add", {"a": 1, "b": 2})], "unordered", "exact", True),
    ([("add", {"a": 1, "b": 3}), ("lookup", {"key": "k"})], "unordered", "exact", False),
    ([("add", {"a": 1}), ("lookup", {})], "unordered", "subset", True),
    ([("add", {"a": 9}), ("lookup", {})], "unordered", "subset", False),
    (["lookup", "add"], "unordered", "ignore", True),
    (["add"], "superset", "ignore", True),
    (["add", "add"], "superset", "ignore", False),
    (["add"], "subset", "ignore", False),
    (["add", "lookup", "add"], "subset", "ignore", True),
    (["add"], "strict", "ignore", False),
])
async def test_tool_trajectory_modes(expected: list[Any], mode: Any, args: Any, passed: bool) -> None:
    ctx = await run_context(_calls(("add", {"a": 1, "b": 2}), ("lookup", {"key": "k"})))
    assert [c.name for c in ctx.tool_calls] == ["add", "lookup"]
    assert ctx.tool_calls[0].args == {"a": 1, "b": 2} and ctx.tool_calls[0].output == "3"
    result = await run_evaluator(ToolTrajectory(expected, mode=mode, args=args), ctx)
    assert result.passed is passed, result.reason
    if not passed:
        assert result.reason


async def test_tool_trajectory_matching_is_not_greedy() -> None:
    # With args="subset" the first expectation fits both calls; a greedy pass would take the call
    # the second expectation needs.
    ctx = await run_context(_calls(("add", {"a": 1, "b": 2}), ("add", {"a": 1, "b": 5})))
    expected = [("add", {"a": 1}), ("add", {"b": 2})]
    assert (await run_evaluator(ToolTrajectory(expected, mode="unordered", args="subset"), ctx)).passed


async def test_tool_trajectory_reads_the_cases_expected_tools() -> None:
    case = Case("c", "q", expected_tools=[{"name": "add", "args": {"a": 1, "b": 2}}])
    ctx = await run_context(_calls(("add", {"a": 1, "b": 2})), case=case)
    assert (await run_evaluator(ToolTrajectory(), ctx)).passed
    with pytest.raises(ValueError, match="mode must be one of"):
        ToolTrajectory([], mode="sideways")  # type: ignore[arg-type]


async def test_has_event_and_no_tool_call() -> None:
    ctx = await run_context(_calls(("add", {"a": 1, "b": 2})))
    assert (await run_evaluator(HasEvent("tool_result_end", where={"tool_name": "add", "state": "success"}), ctx)).passed
    assert not (await run_evaluator(HasEvent("tool_result_end", where={"state": "error"}), ctx)).passed
    assert (await run_evaluator(HasEvent("model_call_end", count=2, exactly=True), ctx)).passed
    assert (await run_evaluator(HasEvent("text_block_delta", where=lambda e: "done" in e.delta), ctx)).passed
    assert (await run_evaluator(NoToolCall("lookup"), ctx)).passed
    called = await run_evaluator(NoToolCall("add"), ctx)
    assert not called.passed and "'add' 1 time(s)" in (called.reason or "")
    assert not (await run_evaluator(NoToolCall(), ctx)).passed


async def test_cost_and_speed() -> None:
    usage = ChatUsage(input_tokens=1000, output_tokens=500)
    steps = [ModelStep.tool_call("add", {"a": 1, "b": 2}, usage=usage), ModelStep.text("3", usage=usage)]
    ctx = await run_context(steps)
    assert ctx.usage == ChatUsage(input_tokens=2000, output_tokens=1000)
    assert (await run_evaluator(MaxTokens(3000), ctx)).passed
    over = await run_evaluator(MaxTokens(2000), ctx)
    assert not over.passed and over.score == 0.5 and "total tokens 3000 > limit 2000" in (over.reason or "")
    assert not (await run_evaluator(MaxTokens(900, kind="output"), ctx)).passed
    assert (await run_evaluator(MaxModelCalls(2), ctx)).passed
    assert not (await run_evaluator(MaxModelCalls(1), ctx)).passed
    assert (await run_evaluator(MaxDuration(10), ctx)).passed
    assert not (await run_evaluator(MaxDuration(0), ctx)).passed
    # Priced as BudgetMiddleware prices: per million tokens, by the model reported ("scripted").
    prices = {"scripted": ModelPrice(input=1.0, output=10.0)}
    assert (await run_evaluator(MaxCost(0.012, prices=prices), ctx)).passed  # 2000*1 + 1000*10 = 0.012 $
    assert not (await run_evaluator(MaxCost(0.011, prices=prices), ctx)).passed
    assert (await run_evaluator(MaxCost(0.0), ctx)).passed  # no price: costs 0
    strict = await run_evaluator(MaxCost(1.0, strict=True), ctx)
    assert not strict.passed and "no price for model(s) scripted" in (strict.reason or "")


async def test_has_matching_span_sees_the_runs_own_spans(provider: TracerProvider) -> None:
    tracing = OtelTracingMiddleware(tracer_provider=provider)
    cases = [Case(f"c{i}", "q", expected_output="3", metadata={"args": {"a": 1, "b": 2}}) for i in range(4)]
    dataset = Dataset(cases, [HasMatchingSpan("execute_tool add", attributes={"gen_ai.tool.name": "add"}),
                              HasMatchingSpan(re.compile(r"^chat "), count=2),
                              HasMatchingSpan("invoke_agent calc", count=1)])
    report = await dataset.evaluate(lambda case: calculator(case, middlewares=(tracing,)), concurrency=4)
    assert report.pass_rate == 1.0, report.render()
    # Each run sees only its own spans, with the runs in parallel.
    missing = Dataset(cases[:1], [HasMatchingSpan("chat scripted", count=3)])
    again = await missing.evaluate(lambda case: calculator(case, middlewares=(tracing,)))
    reason = again.cases[0].results[0].reason or ""
    assert "2 span(s) match" in reason and "execute_tool add" in reason


async def test_has_matching_span_without_tracing_fails_saying_why() -> None:
    ctx = await run_context([ModelStep.text("x")])
    result = await run_evaluator(HasMatchingSpan("chat scripted"), ctx)
    assert not result.passed and "OtelTracingMiddleware" in (result.reason or "")


async def test_your_own_evaluators_functions_and_classes() -> None:
    class Polite(Evaluator):
        threshold = 0.8

        async def evaluate(self, ctx: EvalContext) -> float:
            return 0.9 if "please" in ctx.text else 0.1

    def short(ctx: EvalContext) -> bool:
        return len(ctx.text) < 20

    def graded(ctx: EvalContext) -> EvalResult:
        return EvalResult(0.7, True, "good enough")

    ctx = await run_context([ModelStep.text("yes please")])
    polite, brief, grade = [await run_evaluator(e, ctx) for e in (Polite(), short, graded)]
    assert (polite.evaluator, polite.passed, polite.score) == ("Polite", True, 0.9)
    assert (brief.evaluator, brief.passed) == ("short", True)
    assert (grade.evaluator, grade.score, grade.reason) == ("graded", 0.7, "good enough")
    assert not (await run_evaluator(lambda ctx: 0.3, ctx)).passed  # a float passes at 0.5


async def test_an_evaluator_that_raises_is_its_own_failed_result() -> None:
    def broken(ctx: EvalContext) -> bool:
        raise KeyError("no such field")

    def wrong_type(ctx: EvalContext) -> Any:
        return "yes"

    case = Case("c", "q", expected_output="3", metadata={"args": {"a": 1, "b": 2}})
    report = await Dataset([case], [broken, Equals(), wrong_type, lambda ctx: EvalResult(2.0, True)]).evaluate(
        calculator)
    results = {r.evaluator: r for r in report.cases[0].results}
    assert results["broken"].error == "KeyError: 'no such field'" and not results["broken"].passed
    assert "the evaluator raised KeyError" in (results["broken"].reason or "")
    assert results["Equals"].passed  # the others are unaffected
    assert "TypeError" in (results["wrong_type"].error or "")
    assert "must be in [0, 1]" in (results["<lambda>"].error or "")
    assert report.cases[0].attempts[0].error is None  # the run itself succeeded
