"""MCP tools reach the server that offered them: two servers offering one name are refused with
the fix named, a local tool of that name wins with a warning, and a prefix keeps both."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from mcp_helpers import stdio_client

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit, tool
from agentscope_py.errors import ToolConflictError

pytestmark = [pytest.mark.mcp, pytest.mark.timeout(40), pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def servers(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two processes of the test server (the same tools), each logging to its own file."""
    logs = [tmp_path_factory.mktemp("mcp") / f"{name}.log" for name in ("alpha", "beta")]
    clients = []
    for name, log in zip(("alpha", "beta"), logs, strict=True):
        log.touch()
        clients.append(stdio_client(log, name=name))
    async with clients[0], clients[1]:
        yield clients, logs
    for client in clients:
        await client.wait_closed()


def calls(log: Path) -> list[str]:
    return [line for line in log.read_text(encoding="utf-8").splitlines() if line.startswith("echo ")]


async def test_two_servers_offering_one_name_are_refused_naming_both_and_the_fix(servers: Any) -> None:
    (alpha, beta), _ = servers
    await alpha.list_tools()
    await beta.list_tools()
    toolkit = Toolkit()
    toolkit.register_mcp(alpha)
    with pytest.raises(ToolConflictError, match=r"tool named 'echo': MCP server 'alpha' and MCP server 'beta'.*"
                                                r"register_mcp\(client, prefix='beta_'\)"):
        toolkit.register_mcp(beta)
    assert len(toolkit.sources) == 1  # the refused source was not kept


async def test_a_conflict_found_when_the_lists_arrive_stops_the_run_before_the_model(tmp_path: Path) -> None:
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    for log in logs:
        log.touch()
    first, second = stdio_client(logs[0], name="alpha"), stdio_client(logs[1], name="beta")
    toolkit = Toolkit()
    toolkit.register_mcp(first)  # not connected yet: their tools are unknown until a run starts
    toolkit.register_mcp(second)
    model = ScriptedModel([ModelStep.tool_call("echo", {"text": "x"}), ModelStep.text("never")])
    agent = ReActAgent.builder().model(model).toolkit(toolkit).build()
    try:
        with pytest.raises(ToolConflictError, match="'alpha' and MCP server 'beta'"):
            await agent.call("go")
        assert model.requests == [] and calls(logs[0]) == calls(logs[1]) == []
    finally:
        await first.aclose()
        await second.aclose()


async def test_with_a_prefix_each_call_reaches_the_server_the_model_was_shown(servers: Any) -> None:
    (alpha, beta), logs = servers
    model = ScriptedModel([ModelStep.tool_calls_of(("echo", {"text": "to-alpha"}), ("beta_echo", {"text": "to-beta"})),
                           ModelStep.text("done")])
    toolkit = Toolkit()
    toolkit.register_mcp(alpha)
    toolkit.register_mcp(beta, prefix="beta_")
    agent = ReActAgent.builder().model(model).toolkit(toolkit).build()
    assert (await agent.call("go")).text == "done"
    shown = {t.name for t in model.requests[0].tools}
    assert {"echo", "beta_echo"} <= shown
    assert "echo to-alpha" in calls(logs[0]) and "echo to-beta" in calls(logs[1])
    assert "echo to-beta" not in calls(logs[0]) and "echo to-alpha" not in calls(logs[1])


@tool
def echo(text: str) -> str:
    """A local echo.

    Args:
        text: what to echo
    """
    return f"local {text}"


async def test_a_local_tool_of_an_mcp_tools_name_wins_with_one_warning_naming_both(servers: Any) -> None:
    (alpha, _), logs = servers
    model = ScriptedModel([ModelStep.tool_call("echo", {"text": "which"}), ModelStep.text("a"),
                           ModelStep.text("b")])
    before = len(calls(logs[0]))
    with pytest.warns(UserWarning, match=r"the tool 'echo' of MCP server 'alpha' is not offered to the model: "
                                         r"a tool registered in the toolkit has that name") as caught:
        toolkit = Toolkit([echo])
        toolkit.register_mcp(alpha)  # its list is known: the warning comes now
        agent = ReActAgent.builder().model(model).toolkit(toolkit).build()
        await agent.call("go")
    assert len([w for w in caught if "'echo' of MCP server" in str(w.message)]) == 1
    assert model.requests[1].messages[-1].tool_results[0].output == "local which"
    assert len(calls(logs[0])) == before  # the server was not called
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the next run does not warn again
        await agent.call("again")

