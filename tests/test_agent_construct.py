"""`ReActAgent(...)` with keyword arguments, and the builder building through it."""

from __future__ import annotations

import inspect

import pytest

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, TaskReminderMiddleware, Toolkit, tool
from agentscope_py.agent import Builder, InMemoryStateStore


@tool
def echo(text: str) -> str:
    """Say it back.

    Args:
        text: what to say
    """
    return text


async def test_keyword_construction_runs_a_tool_turn() -> None:
    model = ScriptedModel([ModelStep.tool_call("echo", {"text": "hi"}), ModelStep.text("done")])
    agent = ReActAgent(model=model, tools=[echo], name="kw", sys_prompt="Be brief.", max_iters=3)
    msg = await agent.call("go")
    assert msg.text == "done" and msg.name == "kw"
    assert model.requests[0].messages[0].text == "Be brief."
    result = model.requests[1].messages[-1]  # the tool's result went back to the model
    assert result.role == "tool" and "hi" in result.model_dump_json()


def test_defaults_are_the_builders() -> None:
    built = ReActAgent.builder().model(ScriptedModel([])).build()
    direct = ReActAgent(model=ScriptedModel([]))
    for agent in (built, direct):
        assert (agent.name, agent.sys_prompt, agent.max_iters) == ("assistant", "You are a helpful assistant.", 10)
        assert isinstance(agent.state_store, InMemoryStateStore) and agent.toolkit.names == []
    assert built.state_store is not direct.state_store  # each agent its own store


def test_every_builder_option_is_a_constructor_keyword() -> None:
    keywords = set(inspect.signature(ReActAgent).parameters)
    plural = {"middleware": "middlewares", "fallback_model": "fallback_models", "model": "model"}
    options = {n for n in vars(Builder) if not n.startswith("_") and n not in ("build", "mcp")}
    assert {plural.get(n, n) for n in options} <= keywords


def test_the_toolkit_is_copied_and_the_task_list_added_to_the_copy() -> None:
    toolkit = Toolkit([echo])
    agent = ReActAgent(model=ScriptedModel([]), toolkit=toolkit, enable_task_list=True)
    assert "echo" in agent.toolkit.names and len(agent.toolkit.names) > 1
    assert toolkit.names == ["echo"]  # the caller's toolkit is untouched
    assert any(isinstance(m, TaskReminderMiddleware) for m in agent._middlewares)


def test_a_model_id_resolves_with_its_kwargs() -> None:
    pytest.importorskip("openai")
    agent = ReActAgent(model="openai:gpt-4o-mini", model_kwargs={"api_key": "k", "base_url": "http://127.0.0.1:9/v1"})
    assert type(agent.model).__name__ == "OpenAIChatModel"


@pytest.mark.parametrize(("kwargs", "message"), [({"max_iters": 0}, "max_iters must be at least 1"),
                                                  ({"max_retries": -1}, "max_retries must be 0 or more")])
def test_bad_values_fail_at_construction(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReActAgent(model=ScriptedModel([]), **kwargs)
