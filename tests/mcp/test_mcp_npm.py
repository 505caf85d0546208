"""A server from another SDK: the official TypeScript ``@modelcontextprotocol/server-everything``
from npm over stdio (installed like the AG-UI client's test does). It speaks the 2025 protocol, so
this also covers the fallback to the initialize handshake and server-initiated requests."""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import ConfirmResult, GenerateReason, ModelStep, ReActAgent, ScriptedModel, confirm_message
from agentscope_py.events import Custom, RequireUserConfirm, ToolResultDataDelta
from agentscope_py.mcp import MCPClient

VERSION = "2026.8.31"
NODE, NPM = shutil.which("node"), shutil.which("npm")

pytestmark = [pytest.mark.mcp, pytest.mark.node, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def everything() -> Iterator[str]:
    if not (NODE and NPM):
        pytest.skip("node and npm are not installed (CI installs them; the test needs them to run the "
                    "TypeScript MCP server)")
    cache = Path(tempfile.gettempdir()) / "agentscope-py-npm" / f"server-everything-{VERSION}"
    entry = cache / "node_modules" / "@modelcontextprotocol" / "server-everything" / "dist" / "index.js"
    if not entry.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([NPM, "install", "--no-audit", "--no-fund", "--loglevel=error",
                        f"@modelcontextprotocol/server-everything@{VERSION}"], cwd=cache, check=True, timeout=300)
    yield str(entry)


async def test_a_typescript_server_over_stdio(everything: str) -> None:
    client = MCPClient.stdio(str(NODE), [everything, "stdio"], name="everything")
    model = ScriptedModel([
        ModelStep(tool_calls=[_call("e1", "echo", {"message": "hi"}), _call("e2", "get-tiny-image", {}),
                              _call("e3", "trigger-long-running-operation", {"duration": 0.3, "steps": 3})]),
        ModelStep.tool_call("trigger-elicitation-request", {}, id="e4"),
        ModelStep.text("done"),
    ])
    agent = ReActAgent.builder().model(model).mcp(client).build()
    async with client:
        assert client.protocol_version is not None and client.protocol_version < "2026"  # the 2025 handshake
        events = [ev async for ev in agent.stream("go")]
        results = {r.id: r for r in model.requests[1].messages[-1].tool_results}
        assert results["e1"].text == "Echo: hi"
        assert any(isinstance(e, ToolResultDataDelta) and e.data.media_type == "image/png" for e in events)
        progress = [e.value["progress"] for e in events if isinstance(e, Custom) and e.name == "mcp.progress"]
        assert progress == [1, 2, 3]
        # Its elicitation is a request of its own, not part of the call: it still pauses the run.
        ask = next(e for e in events if isinstance(e, RequireUserConfirm))
        assert ask.metadata["question"]["schema"]["required"] == ["name"]
        assert events[-2].result.generate_reason is GenerateReason.PERMISSION_ASKING
        await agent.call(confirm_message(ConfirmResult(tool_call_id="e4", confirmed=True, answer=_ANSWER)))
    answered = model.requests[2].messages[-1].tool_results[0]
    assert "User provided the requested information" in answered.text, answered.text


async def test_a_pause_for_the_user_logs_one_plain_line(everything: str, caplog: pytest.LogCaptureFixture) -> None:
    # The server asks with a request of its own, which the SDK's dispatcher runs: a pause is a
    # normal event, so no traceback from it, and one line saying what happens.
    client = MCPClient.stdio(str(NODE), [everything, "stdio"], name="everything")
    model = ScriptedModel([ModelStep.tool_call("trigger-elicitation-request", {}, id="e5"), ModelStep.text("done")])
    agent = ReActAgent.builder().model(model).mcp(client).build()
    with caplog.at_level(logging.DEBUG):
        async with client:
            events = [ev async for ev in agent.stream("go")]
    assert events[-2].result.generate_reason is GenerateReason.PERMISSION_ASKING
    assert [r.getMessage() for r in caplog.records if r.exc_info or "raised" in r.getMessage()] == []
    said = [r for r in caplog.records if "asks the user" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO and said[0].name == "agentscope_py.mcp"
    assert said[0].getMessage().startswith("MCP server 'everything' asks the user (tool call e5): Please provide")
    assert said[0].getMessage().endswith(": the run pauses until the user answers")


_ANSWER: dict[str, Any] = {"name": "Ada"}


def _call(cid: str, name: str, args: dict[str, Any]) -> Any:
    from agentscope_py import ToolUseBlock

    return ToolUseBlock(id=cid, name=name, input=args)
