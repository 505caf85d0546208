"""Registering sub-agents: register_agent / as_tool, the task string or an input model (its schema
is the tool's), structured output back to the caller, session modes, clear errors for bad
arguments, and the depth and cycle limits (at build time where possible, else at run time)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, Field
from subagent_helpers import agent, model_of

from agentscope_py import RuntimeContext, Toolkit, ToolResultState
from agentscope_py.errors import SubAgentCycleError, SubAgentDepthError, SubAgentError
from agentscope_py.model import ModelStep


class Query(BaseModel):
    city: str = Field(description="Which city")
    days: int = 3


class Forecast(BaseModel):
    city: str
    high: int


async def test_register_agent_adds_the_sub_agent_as_a_task_tool() -> None:
    child = agent("child", [ModelStep.text("hi")])
    kit = Toolkit()
    t = kit.register_agent(child, name="helper", description="Helps.")
    assert kit.names == ["helper"] and t.description == "Helps."
    assert t.parameters["properties"]["task"]["type"] == "string"
    assert t.parameters["required"] == ["task"]
    assert child.as_tool().name == "child"  # the agent's name by default
    assert "child" in child.as_tool().description


async def test_an_input_model_is_the_tools_schema_and_the_sub_agent_gets_it_rendered() -> None:
    child = agent("child", [ModelStep.text("sunny")])
    t = child.as_tool(input_model=Query)
    assert set(t.parameters["properties"]) == {"city", "days"} and t.parameters["required"] == ["city"]
    root = agent("root", [ModelStep.tool_call("child", {"city": "Oslo"}), ModelStep.text("ok")], t)
    await root.call("go")
    task = model_of(child).requests[0].messages[-1].text
    assert Query.model_validate_json(task) == Query(city="Oslo", days=3)


async def test_invalid_arguments_for_the_input_model_are_an_error_result_the_model_sees() -> None:
    child = agent("child", [])
    root = agent("root", [ModelStep.tool_call("child", {"days": "x"}), ModelStep.text("ok")],
                 child.as_tool(input_model=Query, render=lambda q: f"weather in {q.city}"))  # type: ignore[attr-defined]
    await root.call("go")
    result = model_of(root).requests[1].messages[-1].tool_results[0]
    assert result.state is ToolResultState.ERROR and "city" in result.text and "days" in result.text
    assert model_of(child).requests == []


async def test_structured_output_returns_to_the_caller_as_json() -> None:
    child = agent("child", [ModelStep.tool_call("generate_response", {"city": "Oslo", "high": 21}),
                            ModelStep.text("done")])
    root = agent("root", [ModelStep.tool_call("child", {"task": "forecast Oslo"}), ModelStep.text("ok")],
                 child.as_tool(output_model=Forecast))
    await root.call("go")
    result = model_of(root).requests[1].messages[-1].tool_results[0]
    assert Forecast.model_validate_json(result.text) == Forecast(city="Oslo", high=21)


@pytest.mark.parametrize(("mode", "expected"), [
    ("derived", ["s/child", "s/child"]),
    ("fresh", ["s/child/a", "s/child/b"]),
    ("shared", ["child", "child"]),
])
async def test_session_modes(mode: str, expected: list[str]) -> None:
    child = agent("child", [ModelStep.text("one"), ModelStep.text("two")])
    seen: list[str] = []
    orig = child.state_store.load

    async def load(user_id: str, session_id: str) -> Any:
        seen.append(session_id)
        return await orig(user_id, session_id)

    child.state_store.load = load  # type: ignore[method-assign]
    root = agent("root", [ModelStep.tool_call("child", {"task": "1"}, id="a"),
                          ModelStep.tool_call("child", {"task": "2"}, id="b"), ModelStep.text("ok")],
                 child.as_tool(session=mode))  # type: ignore[arg-type]
    await root.call("go", ctx=RuntimeContext(session_id="s"))
    assert seen == expected
    second = model_of(child).requests[1].messages
    remembered = [m.text for m in second if m.role != "system"]
    # derived and shared remember the first call; fresh starts over
    assert remembered == (["2"] if mode == "fresh" else ["1", "one", "2"])


async def test_a_session_function_names_the_sub_agents_session() -> None:
    child = agent("child", [ModelStep.text("x")])
    root = agent("root", [ModelStep.tool_call("child", {"task": "1"}, id="a"), ModelStep.text("ok")],
                 child.as_tool(session=lambda ctx, call_id: f"{ctx.user_id}-{call_id}"))
    await root.call("go", ctx=RuntimeContext(user_id="u", session_id="s"))
    assert (await child.state_store.load("u", "u-a"))[0] is not None


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"name": "has space"}, ValueError, "not a valid tool name"),
    ({"input_model": dict}, TypeError, "input_model must be a pydantic BaseModel"),
    ({"output_model": 3}, TypeError, "output_model must be a pydantic BaseModel"),
    ({"session": "sometimes"}, ValueError, "session must be"),
    ({"inherit_middleware": "yes"}, TypeError, "inherit_middleware must be"),
    ({"max_depth": 0}, ValueError, "max_depth must be an int >= 1"),
    ({"on_stop": "explode"}, ValueError, "on_stop must be"),
    ({"description": 5}, TypeError, "description must be a str"),
])
def test_bad_arguments_fail_at_construction(kwargs: dict[str, Any], error: type[Exception], words: str) -> None:
    child = agent("child", [])
    with pytest.raises(error, match=words):
        child.as_tool(**kwargs)
    with pytest.raises(error, match=words):
        Toolkit().register_agent(child, **kwargs)


def test_register_agent_refuses_what_is_not_an_agent() -> None:
    with pytest.raises(TypeError, match="register_agent takes an agent"):
        Toolkit().register_agent(lambda: None)  # type: ignore[arg-type]


def test_registering_an_agent_reachable_from_itself_fails_at_build_time() -> None:
    a = agent("a", [])
    with pytest.raises(SubAgentCycleError, match="its own sub-agent"):
        a.toolkit.register_agent(a)
    b = agent("b", [], a.as_tool())  # b -> a
    with pytest.raises(SubAgentCycleError):
        a.toolkit.register_agent(b)  # a -> b -> a
    c = agent("c", [], b.as_tool())  # c -> b -> a
    with pytest.raises(SubAgentCycleError):
        a.toolkit.register_agent(c)
    assert issubclass(SubAgentCycleError, ValueError) and issubclass(SubAgentCycleError, SubAgentError)


async def test_a_cycle_built_around_register_agent_is_refused_at_run_time() -> None:
    a = agent("a", [ModelStep.tool_call("b", {"task": "t"}), ModelStep.text("a done")])
    b = agent("b", [ModelStep.tool_call("a", {"task": "t"}), ModelStep.text("b done")], a.as_tool())
    a.toolkit.register(b.as_tool())  # (register, not register_agent: no build-time check)
    msg = await a.call("go")
    assert msg.text == "a done"
    inner = model_of(b).requests[1].messages[-1].tool_results[0]
    assert inner.state is ToolResultState.ERROR
    assert inner.text.startswith("Error: SubAgentCycleError: sub-agent 'a' is already running above this call (a/b/a)")


async def test_the_depth_limit() -> None:
    # a chain root -> n1 -> n2 -> n3: with max_depth=2 the call into n3 (depth 3) is refused.
    n3 = agent("n3", [ModelStep.text("deep")])
    n2 = agent("n2", [ModelStep.tool_call("n3", {"task": "t"}), ModelStep.text("n2 done")], n3.as_tool(max_depth=2))
    n1 = agent("n1", [ModelStep.tool_call("n2", {"task": "t"}), ModelStep.text("n1 done")], n2.as_tool(max_depth=2))
    root = agent("root", [ModelStep.tool_call("n1", {"task": "t"}), ModelStep.text("ok")], n1.as_tool(max_depth=2))
    await root.call("go")
    refused = model_of(n2).requests[1].messages[-1].tool_results[0]
    assert refused.state is ToolResultState.ERROR and "SubAgentDepthError" in refused.text
    assert "root/n1/n2/n3" in refused.text and model_of(n3).requests == []
    err = SubAgentDepthError("x", depth=6, max_depth=5)
    assert (err.depth, err.max_depth) == (6, 5)


async def test_the_default_depth_limit_is_five() -> None:
    chain = agent("n6", [ModelStep.text("bottom")])
    agents = [chain]
    for i in range(5, -1, -1):
        chain = agent(f"n{i}", [ModelStep.tool_call(f"n{i + 1}", {"task": "t"}), ModelStep.text(f"n{i} done")],
                      chain.as_tool())
        agents.append(chain)
    await chain.call("go")  # n0 (root) -> n1 ... -> n5 (depth 5) -> n6 (depth 6): refused
    n5 = agents[1]
    assert "SubAgentDepthError" in model_of(n5).requests[1].messages[-1].tool_results[0].text
    assert model_of(agents[0]).requests == []
