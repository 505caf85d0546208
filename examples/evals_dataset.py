"""Evaluate an agent: a dataset of cases, a trajectory check, a scripted judge, the report."""

import asyncio

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, tool
from agentscope_py.evals import Case, Contains, Dataset, LLMJudge, ToolTrajectory


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def make_agent(case: Case) -> ReActAgent:
    a, b = case.metadata["a"], case.metadata["b"]
    script = [ModelStep.tool_call("add", {"a": a, "b": b}), ModelStep.text(f"The sum is {a + b}.")]
    return ReActAgent.builder().name("calc").model(ScriptedModel(script)).tools(add).build()


async def main() -> None:
    cases = [Case(f"sum{i}", f"What is {i} + {i}?", expected_output=str(2 * i), metadata={"a": i, "b": i})
             for i in range(1, 4)]
    verdict = {"score": 1.0, "passed": True, "reason": "States the sum."}
    judge = LLMJudge("The answer states the sum.", model=ScriptedModel([ModelStep.tool_call("verdict", verdict)],
                                                                       loop=True))
    dataset = Dataset(cases, [Contains(), ToolTrajectory(["add"]), judge], name="sums")
    report = await dataset.evaluate(make_agent, concurrency=3, repeat=2)
    report.print()
    print(f"pass rate: {report.pass_rate:.0%}")

asyncio.run(main())
