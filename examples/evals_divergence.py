"""Replay a recorded run against today's agent: the first divergent event, then a fork with another model."""

import asyncio

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, tool
from agentscope_py.evals import Contains, RecordedRun, first_divergence, fork


@tool(name="add")
def add_v1(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


@tool(name="add")
def add_v2(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b + 1  # a regression


def agent(tool_fn, model) -> ReActAgent:
    return ReActAgent.builder().name("calc").model(model).tools(tool_fn).build()


async def main() -> None:
    script = [ModelStep.tool_call("add", {"a": 1, "b": 2}), ModelStep.text("The sum is 3.")]
    recorded = await RecordedRun.record(agent(add_v1, ScriptedModel(script)), "What is 1 + 2?")
    divergence = await first_divergence(recorded, agent(add_v2, recorded.scripted_model()))
    print(f"first divergence: {divergence}")
    at = next(i for i, e in enumerate(recorded.events) if e.type == "model_call_end") + 1
    other = ScriptedModel([ModelStep.text("1 + 2 = 3")], name="other-model")
    branch = await fork(recorded, at, agent=agent(add_v1, ScriptedModel([])), model=other,
                        evaluators=[Contains("sum")])
    print(f"recorded: {branch.original[0].passed}, fork: {branch.branch[0].passed}")

asyncio.run(main())
