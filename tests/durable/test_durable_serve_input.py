"""What a request to a served durable session answers (`_durable_answers.answers_of`), and the
client's frontend tools refused at once when malformed (before anything reaches Temporal)."""

from __future__ import annotations

import pytest
from durable_helpers import temporal_address
from temporalio.client import Client

from agentscope_py.agent.react import confirm_message
from agentscope_py.durable import DurableAgent
from agentscope_py.events import ConfirmResult
from agentscope_py.message import Msg, ToolResultBlock
from agentscope_py.model.base import ToolSchema
from agentscope_py.server._durable.answers import answers_of

__all__ = ["temporal_address"]  # a fixture, used by name


def _tool(call_id: str) -> Msg:
    return Msg.tool([ToolResultBlock(id=call_id, name="add", output="42")])


def test_the_tool_messages_ending_the_input_are_the_answers() -> None:
    history = [Msg.user("2 + 40?"), _tool("old"), Msg.assistant("an earlier reply")]
    found = answers_of([*history, _tool("c1"), _tool("c2")])
    assert [r.id for r in found.results] == ["c1", "c2"] and found.rest == history and found
    assert not answers_of([*history, Msg.user("and?")])  # a new message: no answers
    both = answers_of([confirm_message(ConfirmResult(tool_call_id="c1", confirmed=True)), _tool("c2")])
    assert [a.tool_call_id for a in both.confirm] == ["c1"]  # and the results beside them (one signal)
    assert [r.id for r in both.results] == ["c2"] and both.rest == []


async def test_malformed_frontend_tools_are_refused_before_the_run_starts(temporal_address: str) -> None:
    agent = DurableAgent(await Client.connect(temporal_address), factory="durable_agents:build", task_queue="none")
    add = ToolSchema("add", "Add.", {"type": "object", "properties": {}})
    with pytest.raises(TypeError, match="ToolSchema"):
        await agent.start("hi", tools=[{"name": "add"}])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="a name of its own"):
        await agent.start("hi", tools=[add, add])
