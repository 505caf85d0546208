"""MCP over streamable HTTP: the SDK's server on a loopback port, per-user credentials through a
per-run factory and the auth callback, a server restart the next call recovers from, and the
``execute_tool`` span carrying the server's name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from mcp_helpers import HttpServer
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agentscope_py import ModelStep, ReActAgent, RuntimeContext, ScriptedModel, ToolResultState
from agentscope_py.mcp import MCPClient
from agentscope_py.middleware import OtelTracingMiddleware


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    # One server process for the module (a start costs seconds on a busy machine).
    log = tmp_path_factory.mktemp("mcp-http") / "server.log"
    log.touch()
    srv = HttpServer(log)
    srv.start()
    yield srv
    srv.kill()

pytestmark = [pytest.mark.mcp, pytest.mark.timeout(40)]


async def test_a_full_turn_over_http_with_per_user_credentials(http_server: HttpServer) -> None:
    clients: dict[str, MCPClient] = {}
    asked: list[str] = []

    def for_user(ctx: RuntimeContext) -> MCPClient:
        user = ctx.user_id

        def token() -> dict[str, str]:
            asked.append(user)
            return {"Authorization": f"Bearer {user}"}

        return clients.setdefault(user, MCPClient.http(http_server.url, auth=token, name="remote"))

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    model = ScriptedModel([ModelStep.tool_call("whoami", {}, id="w1"), ModelStep.text("a"),
                           ModelStep.tool_call("whoami", {}, id="w2"), ModelStep.text("b")])
    agent = (ReActAgent.builder().name("a").model(model).mcp(MCPClient.per_run(for_user))
             .middleware(OtelTracingMiddleware(tracer_provider=provider)).build())
    await agent.call("go", ctx=RuntimeContext(user_id="ada"))
    await agent.call("go", ctx=RuntimeContext(user_id="bob"))
    assert model.requests[1].messages[-1].tool_results[0].text == "Bearer ada"
    assert model.requests[3].messages[-1].tool_results[0].text == "Bearer bob"
    assert {"ada", "bob"} <= set(asked)
    spans = [s for s in exporter.get_finished_spans() if s.name == "execute_tool whoami"]
    assert len(spans) == 2 and all(s.attributes["mcp.server.name"] == "remote" for s in spans)  # type: ignore[index]
    for c in clients.values():
        await c.wait_closed()
    provider.shutdown()


async def test_the_next_call_recovers_after_the_http_server_restarts(http_server: HttpServer) -> None:
    client = MCPClient.http(http_server.url, headers={"Authorization": "static"})
    model = ScriptedModel([ModelStep.tool_call("echo", {"text": "one"}, id="e1"), ModelStep.text("1"),
                           ModelStep.tool_call("echo", {"text": "two"}, id="e2"), ModelStep.text("2")])
    agent = ReActAgent.builder().name("a").model(model).mcp(client).build()
    async with client:
        await agent.call("go")
        http_server.kill()
        http_server.start()  # the same port, a new process: the old session is unknown there
        await agent.call("go")
    result: Any = model.requests[3].messages[-1].tool_results[0]
    assert result.state is ToolResultState.SUCCESS and result.text == "two"
    # A 2026-era server keeps no HTTP session (each request stands alone), so the new process
    # answers the old client directly; a session-keeping server is reconnected (connects == 2).
    assert client.connects in (1, 2)
    await client.wait_closed()


async def test_a_terminated_http_session_is_reconnected(http_server: HttpServer) -> None:
    # The 2025 handshake keeps an HTTP session (Mcp-Session-Id); a restarted server has forgotten
    # it and answers 404 "Session terminated": the client opens a new session and, the tool being
    # read-only, sends the call again.
    client = MCPClient.http(http_server.url, mode="legacy")
    async with client:
        assert (await client.call_tool("echo", {"text": "one"}, idempotent=True)).content[0].text == "one"  # type: ignore[union-attr]
        http_server.kill()
        http_server.start()
        again = await client.call_tool("echo", {"text": "two"}, idempotent=True)
        assert again.content[0].text == "two"  # type: ignore[union-attr]
        assert client.connects == 2
    await client.wait_closed()
