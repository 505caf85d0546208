"""A server's answers are screened before the SDK parses them: a tool with an invalid definition
is skipped with a warning (the server's other tools kept, also when the SDK lists them again
after a header mismatch), and a tool result is cut to the cap while it is read, so the call's
memory stays within a small multiple of the cap (here with the SDK's own server; the
hand-written one of test_mcp_long_results covers the other shapes)."""

from __future__ import annotations

import sys
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest
from mcp_helpers import SERVER, HttpServer, http_server, log  # noqa: F401 - fixtures

from agentscope_py import ModelStep, ReActAgent, ScriptedModel
from agentscope_py.mcp import MCPClient

pytestmark = [pytest.mark.mcp, pytest.mark.timeout(60)]

RAW_SERVER = str(Path(__file__).resolve().parent / "mcp_raw_server.py")
CAP = 100_000


def raw_client(*flags: str) -> MCPClient:
    return MCPClient.stdio(sys.executable, [RAW_SERVER, *flags], name="raw", timeout=10)


@pytest.mark.parametrize("flags", [(), ("--legacy",)], ids=["2026", "2025-handshake"])
async def test_a_tool_with_an_invalid_definition_is_skipped_with_a_warning_and_the_others_kept(
        flags: tuple[str, ...]) -> None:
    client = raw_client(*flags)
    model = ScriptedModel([ModelStep.tool_call("good_two", {}, id="g"), ModelStep.text("done")])
    agent = ReActAgent.builder().model(model).mcp(client).build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await agent.call("go")
    await client.wait_closed()
    assert [t.name for t in model.requests[0].tools] == ["good_one", "good_two"]
    assert model.requests[1].messages[-1].tool_results[0].text == "good_two: {}"
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    for tool in ("bad", "not_object"):
        assert any(f"MCP server 'raw' offers the tool {tool!r} with an invalid definition" in text
                   and "inputSchema" in text and "other tools are kept" in text for text in said), said


async def test_a_valid_tool_is_called_after_the_sdk_lists_the_tools_again_on_a_header_mismatch() -> None:
    client = raw_client("--mismatch")  # the first tools/call is refused with HEADER_MISMATCH
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        async with client:
            assert client.protocol_version == "2026-07-28"
            assert [t.name for t in await client.list_tools()] == ["good_one", "good_two"]
            result = await client.call_tool("good_one", {"text": "hi"})
    await client.wait_closed()
    block = result.content[0]
    assert isinstance(block, types.TextContent) and block.text == 'good_one: {"text": "hi"}'


# -- the result cap while reading ------------------------------------------------------------------


async def traced_call(client: MCPClient, tool: str, args: dict[str, Any]) -> tuple[int, str]:
    """The peak of traced memory while an agent's call of ``tool`` runs, and what the model read."""
    model = ScriptedModel([ModelStep.tool_call(tool, args, id="c"), ModelStep.text("ok")])
    agent = ReActAgent.builder().model(model).mcp(client, max_result_chars=CAP).build()
    async with client:
        await client.list_tools()
        tracemalloc.start()
        try:
            await agent.call("go")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    await client.wait_closed()
    return peak, model.requests[1].messages[-1].tool_results[0].text


CASES = {
    # 100,000 blocks of 10 characters: ~1 MB of text, a 4 MB message
    "tiny-blocks": ("many", {"count": 100_000, "size": 10}, 1_000_000),
    # one 20 MB text (the SDK's server also sends it as structured content)
    "20MB": ("big", {"size": 20_000_000}, 20_000_000),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_memory_stays_within_a_small_multiple_of_the_cap_with_the_sdks_own_server(
        case: str, transport: str, log: Path) -> None:  # noqa: F811
    tool, args, full = CASES[case]
    server: HttpServer | None = None
    if transport == "http":
        server = HttpServer(log)
        server.start()
        client = MCPClient.http(server.url, name="m", timeout=60)
    else:
        client = MCPClient.stdio(sys.executable, [SERVER], name="m", timeout=60)
    try:
        peak, text = await traced_call(client, tool, args)
    finally:
        if server is not None:
            server.kill()
    # the whole agent call, the SDK's own read included (a small call peaks at ~0.3 MB)
    assert peak <= 15 * CAP, f"{peak / 1e6:.1f} MB traced"
    assert text.endswith(f"[truncated: the result was {full} characters; only the first {CAP} are shown. "
                         "Ask for less (a narrower query, a page) if you need the rest.]")
    assert len(text) < CAP + 200
