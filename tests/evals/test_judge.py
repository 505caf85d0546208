"""`LLMJudge`: a scripted judge grades runs; its call is in no run's stream, usage or budget; a
verdict that does not parse is a failed result saying so."""

from __future__ import annotations

import json

import pytest

from agentscope_py.evals import Case, Contains, Dataset, LLMJudge
from agentscope_py.middleware import BudgetMiddleware
from agentscope_py.model import ModelRequest, ModelStep, ScriptedModel

from .helpers import calculator

pytestmark = pytest.mark.timeout(30)

CASE = Case("sum", "What is 1 + 2?", expected_output="3", metadata={"args": {"a": 1, "b": 2}})


def _verdict(score: float, passed: bool, reason: str) -> dict[str, object]:
    return {"score": score, "passed": passed, "reason": reason}


async def test_a_judge_answering_through_the_verdict_tool() -> None:
    judge_model = ScriptedModel([ModelStep.tool_call("verdict", _verdict(0.9, True, "correct and brief"))])
    judge = LLMJudge("The answer is the correct sum, stated briefly.", model=judge_model)
    report = await Dataset([CASE], [judge]).evaluate(calculator)
    result = report.cases[0].result("LLMJudge")
    assert (result.score, result.passed, result.reason) == (0.9, True, "correct and brief")
    request: ModelRequest = judge_model.requests[0]
    assert [t.name for t in request.tools] == ["verdict"]
    asked = request.messages[-1].text
    assert "correct sum" in asked and "<input>\nWhat is 1 + 2?" in asked and "<answer>\n3\n</answer>" in asked
    assert "<expected>\n3\n</expected>" in asked


async def test_a_judge_with_native_structured_output() -> None:
    reply = json.dumps(_verdict(0.2, False, "wrong sum"))
    judge_model = ScriptedModel([ModelStep.text(f"```json\n{reply}\n```")], supports_structured_output=True)
    report = await Dataset([CASE], [LLMJudge("Correct sum.", model=judge_model)]).evaluate(calculator)
    result = report.cases[0].results[0]
    assert (result.score, result.passed, result.reason) == (0.2, False, "wrong sum")
    assert judge_model.requests[0].structured_output is not None and not judge_model.requests[0].tools


@pytest.mark.parametrize("reply", [
    ModelStep.text("Looks fine to me."),
    ModelStep.tool_call("verdict", {"score": 3, "passed": True, "reason": "x"}),
    ModelStep.tool_call("verdict", {"score": 0.5}),
])
async def test_a_verdict_that_does_not_parse_is_a_failed_result_saying_so(reply: ModelStep) -> None:
    judge = LLMJudge("Correct sum.", model=ScriptedModel([reply]))
    report = await Dataset([CASE], [judge, Contains("3")]).evaluate(calculator)
    results = {r.evaluator: r for r in report.cases[0].results}
    failed = results["LLMJudge"]
    assert not failed.passed and failed.score == 0.0
    assert "the judge's output did not parse as a verdict" in (failed.reason or "")
    assert failed.error is not None and failed.error.startswith("unparsable judge output")
    assert results["Contains"].passed


async def test_the_judges_call_is_in_no_runs_stream_usage_or_budget() -> None:
    budget = BudgetMiddleware(user_tokens=10_000)
    judge_model = ScriptedModel([ModelStep.tool_call("verdict", _verdict(1.0, True, "ok"),
                                                     usage=None)])
    report = await Dataset([CASE], [LLMJudge("Correct sum.", model=judge_model)]).evaluate(
        lambda case: calculator(case, middlewares=(budget,)))
    attempt = report.cases[0].attempts[0]
    assert attempt.passed, report.render()
    assert attempt.model_calls == 2  # the agent's two calls, not the judge's
    run_tokens = attempt.tokens
    assert run_tokens is not None
    # The scripted judge reported its own usage (10 in, 1 out); none of it is in the run or budget.
    assert report.cases[0].results[0].details["usage"]["input_tokens"] == 10
    assert (await budget.store.get("eval")).tokens == run_tokens  # the user's budget: the run's tokens only
