"""The smallest cases of the escapes the random cuts of tests/mcp/test_mcp_cuts.py found, against
a real server process (tests/mcp/mcp_hostile_server.py): what a server sends that is not valid
MCP is an error result naming `MCPToolError` at once (not a wait for the call's timeout, nor a
pydantic error of a dozen lines), a server's own JSON-RPC error is not a lost session, a content
block that is not valid MCP is replaced by a text saying so (the others kept), and a lone
surrogate a server sends is read and cleaned."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, ToolResultState
from agentscope_py.mcp import MCPClient

pytestmark = [pytest.mark.mcp, pytest.mark.timeout(60)]

SERVER = str(Path(__file__).resolve().parent / "mcp_hostile_server.py")


async def call(client: MCPClient, tool: str, **args: Any) -> tuple[Any, list[Any], float]:
    """The result the model sees of one call of ``tool``, the run's events, the seconds taken."""
    model = ScriptedModel([ModelStep.tool_call(tool, args, id="c1"), ModelStep.text("ok")])
    agent = ReActAgent.builder().model(model).mcp(client).build()
    start = time.monotonic()
    events = await agent.stream("go").to_list()
    return model.requests[1].messages[-1].tool_results[0], events, time.monotonic() - start


@pytest.fixture
async def client() -> Any:
    c = MCPClient.stdio(sys.executable, [SERVER], name="hostile", timeout=10.0)
    async with c:
        yield c
    await c.wait_closed()


async def test_a_servers_own_json_rpc_error_is_an_mcp_tool_error_and_the_session_stays(client: MCPClient) -> None:
    result, _, _ = await call(client, "protocol_error")  # code -32000, which the SDK also uses for "closed"
    assert result.state is ToolResultState.ERROR
    assert result.text == "Error: MCPToolError: MCP server 'hostile' answered with an error: no such luck"
    assert client.connects == 1  # not taken for a lost session: the server is not restarted


@pytest.mark.parametrize(("tool", "args", "why"), [
    ("result_not_object", {}, "the MCP server sent an answer that is not valid JSON-RPC: result: Input should be "
                              "a valid dictionary"),
    ("deep", {"depth": 5000}, "the MCP server sent a message that is not valid JSON-RPC: it is nested deeper than"),
])
async def test_an_answer_that_is_not_valid_json_rpc_fails_its_call_at_once(
    client: MCPClient, tool: str, args: dict[str, Any], why: str
) -> None:
    result, _, took = await call(client, tool, **args)
    assert result.state is ToolResultState.ERROR
    assert result.text.startswith(f"Error: MCPToolError: MCP server 'hostile' answered with an error: {why}")
    assert took < 5  # not the call's timeout (10 s)
    again, _, _ = await call(client, "echo", text="still here")
    assert again.text == "still here" and client.connects == 1


async def test_a_result_that_is_not_valid_mcp_is_an_mcp_tool_error_naming_the_field(client: MCPClient) -> None:
    result, _, _ = await call(client, "content_not_list")
    assert result.state is ToolResultState.ERROR
    assert result.text == ("Error: MCPToolError: MCP server 'hostile' sent a result that is not valid MCP: content: "
                           "Input should be a valid list")


async def test_content_blocks_that_are_not_valid_mcp_are_replaced_by_a_text_saying_so(client: MCPClient) -> None:
    result, _, _ = await call(client, "mixed")
    assert result.state is ToolResultState.SUCCESS
    assert result.text == ("good[unsupported MCP content: 'hologram'][invalid MCP image content: its data is not "
                           "base64]end")
    for tool, text in [("wrong_types", "[invalid MCP text content (text: Input should be a valid string)]"),
                       ("null_text", "[invalid MCP text content (text: Input should be a valid string)]"),
                       ("unknown_kind", "[unsupported MCP content: 'hologram']")]:
        result, _, _ = await call(client, tool)
        assert (result.state, result.text) == (ToolResultState.SUCCESS, text), tool


async def test_a_lone_surrogate_from_the_server_is_read_and_cleaned(client: MCPClient) -> None:
    result, _, took = await call(client, "surrogate")
    assert (result.state, result.text) == (ToolResultState.SUCCESS, "a\ufffdb")
    assert took < 5
    result, events, _ = await call(client, "surrogate_structured")
    structured = next(e for e in events if e.type == "custom" and e.name == "mcp.structured_content")
    assert structured.value["data"] == {"k": "x\ufffdy"}
    structured.model_dump_json()  # (a served stream encodes it: a lone surrogate would fail there)
