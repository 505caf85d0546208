"""The session's life against the real test server over stdio: opened lazily by a run and closed
with it; cancellation (a consumer that leaves, an interrupt) and timeouts reach the server and
leave the session usable; a server killed mid-call is restarted on the next call."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import mcp_helpers
import pytest
from mcp_helpers import stdio_client, wait_for_line

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit, ToolResultState
from agentscope_py.events import ToolResultEnd, ToolResultStart
from agentscope_py.mcp import MCPClient

log = mcp_helpers.log  # a fixture
pytestmark = [pytest.mark.mcp, pytest.mark.timeout(40)]


def agent_for(client: Any, steps: list[ModelStep], **options: Any) -> tuple[ReActAgent, ScriptedModel]:
    model = ScriptedModel(steps)
    return ReActAgent.builder().name("a").model(model).mcp(client, **options).build(), model


async def server_pid(client: MCPClient) -> int:
    return int((await client.call_tool("pid")).content[0].text)  # type: ignore[union-attr]


async def test_a_run_opens_the_session_lazily_and_the_last_user_closes_it(log: Path) -> None:
    client = stdio_client(log)
    agent, _ = agent_for(client, [ModelStep.tool_call("echo", {"text": "hello"}, id="c1"), ModelStep.text("ok")])
    assert not client.connected
    await agent.call("go")
    await client.wait_closed()
    assert not client.connected and client.users == 0 and client.connects == 1
    assert "echo hello" in await asyncio.to_thread(log.read_text)


async def test_cancellation_and_timeouts_reach_the_server_and_the_session_stays_usable(log: Path) -> None:
    client = stdio_client(log, timeout=1.0)
    async with client:
        pid = await server_pid(client)
        # 1. The consumer leaves while the tool runs.
        agent, _ = agent_for(client, [ModelStep.tool_call("hang", {"tag": "break"}, id="h1")])
        async with contextlib.aclosing(agent.stream("go")) as events:
            async for ev in events:
                if isinstance(ev, ToolResultStart):
                    await asyncio.to_thread(wait_for_line, log, "hang-start break")
                    break
        await asyncio.to_thread(wait_for_line, log, "hang-cancelled break")
        # 2. An interrupt.
        agent2, _ = agent_for(client, [ModelStep.tool_call("hang", {"tag": "interrupt"}, id="h2"),
                                       ModelStep.text("stopped")])
        run = asyncio.ensure_future(agent2.call("go"))
        await asyncio.to_thread(wait_for_line, log, "hang-start interrupt")
        agent2.interrupt()
        reply = await asyncio.wait_for(run, 10)
        assert reply.generate_reason.value == "interrupted"
        await asyncio.to_thread(wait_for_line, log, "hang-cancelled interrupt")
        # 3. The per-call timeout: an error result the model sees, the request cancelled.
        agent3, model3 = agent_for(client, [ModelStep.tool_call("hang", {"tag": "timeout"}, id="h3"),
                                            ModelStep.text("gave up")])
        events3 = [ev async for ev in agent3.stream("go")]
        result = model3.requests[1].messages[-1].tool_results[0]
        assert result.state is ToolResultState.ERROR and "did not answer in 1.0 s" in result.text
        assert next(e for e in events3 if isinstance(e, ToolResultEnd)).state is ToolResultState.ERROR
        await asyncio.to_thread(wait_for_line, log, "hang-cancelled timeout")
        # The same session (the same server process) still answers.
        assert await server_pid(client) == pid
        assert client.connects == 1


async def test_a_2025_era_session_hears_of_tool_list_changes_too(log: Path) -> None:
    client = stdio_client(log, mode="legacy")  # the initialize handshake; no subscriptions/listen
    async with client:
        assert client.protocol_version is not None and client.protocol_version < "2026"
        assert "late" not in [t.name for t in await client.list_tools()]
        changed = asyncio.ensure_future(client.wait_tools_changed(timeout=10))
        await asyncio.sleep(0)
        await client.call_tool("add_tool", {"name": "late"})
        assert "late" in [t.name for t in await changed]


async def test_a_killed_server_is_restarted_on_the_next_call(log: Path) -> None:
    client = stdio_client(log)
    async with client:
        pid = await server_pid(client)
        # Killed during a call that is not safe to repeat: an error result saying so.
        agent, model = agent_for(client, [ModelStep.tool_call("write_slowly", {"tag": "w"}, id="k1"),
                                          ModelStep.text("noted")])
        run = asyncio.ensure_future(agent.call("go"))
        await asyncio.to_thread(wait_for_line, log, "write-start w")
        os.kill(pid, signal.SIGKILL)
        await asyncio.wait_for(run, 20)
        result = model.requests[1].messages[-1].tool_results[0]
        assert result.state is ToolResultState.ERROR
        assert "MCPServerRestarted" in result.text and "not repeated" in result.text
        assert (await asyncio.to_thread(log.read_text)).count("write-start w") == 1  # not sent again
        new_pid = await server_pid(client)
        assert new_pid != pid and client.connects == 2
        # Killed between calls: a read-only call is sent again on a new session, transparently.
        os.kill(new_pid, signal.SIGKILL)
        await asyncio.sleep(0.2)
        echoed = await client.call_tool("echo", {"text": "again"}, idempotent=True)
        assert echoed.content[0].text == "again"  # type: ignore[union-attr]
        assert client.connects == 3


def test_bad_configuration_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="command"):
        MCPClient.stdio("")
    with pytest.raises(ValueError, match="url"):
        MCPClient.http("ftp://example")
    with pytest.raises(ValueError, match="timeout"):
        MCPClient.stdio("x", timeout=0)
    with pytest.raises(TypeError, match="MCPClient"):
        Toolkit().register_mcp("not a client")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="list of tool names"):
        Toolkit().register_mcp(MCPClient.stdio("x"), include="echo")
