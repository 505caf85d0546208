"""Scripted agents the evaluation tests run: a calculator whose script each case chooses."""

from __future__ import annotations

from typing import Any

from agentscope_py import ReActAgent
from agentscope_py.evals import Case
from agentscope_py.model import ModelStep, ScriptedModel


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key}"


def calculator(case: Case, *, middlewares: tuple[Any, ...] = ()) -> ReActAgent:
    """Calls ``add`` with the case's ``metadata["args"]`` (if any), then answers
    ``metadata["answer"]`` (default: the expected output)."""
    steps = []
    if "args" in case.metadata:
        steps.append(ModelStep.tool_call("add", case.metadata["args"]))
    steps.append(ModelStep.text(str(case.metadata.get("answer", case.expected_output))))
    return (ReActAgent.builder().name("calc").model(ScriptedModel(steps)).tools(add, lookup)
            .middlewares(list(middlewares)).build())


async def run_context(steps: list[ModelStep], *, case: Case | None = None, middlewares: tuple[Any, ...] = (),
                      structured_model: type[Any] | None = None, model: Any = None) -> Any:
    """One run of a scripted agent as an `EvalContext` (what evaluators see)."""
    import time

    from agentscope_py.evals import EvalContext
    from agentscope_py.events import AgentResult

    case = case or Case("c", "question")
    agent = (ReActAgent.builder().name("calc").model(model or ScriptedModel(steps)).tools(add, lookup)
             .middlewares(list(middlewares)).build())
    events = []
    output = None
    started = time.perf_counter()
    async for event in agent.stream(case.input, structured_model=structured_model):
        events.append(event)
        if isinstance(event, AgentResult):
            output = event.result
    return EvalContext(case=case, events=events, output=output, duration=time.perf_counter() - started)
