"""MCP tools through a full agent turn over stdio, against the SDK-built test server: results
(text, image, structured content, errors, the size cap), progress events, metadata, sharing."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import mcp_helpers
import pytest
import pytest_asyncio
from mcp_helpers import stdio_client

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit, ToolResultState
from agentscope_py.events import Custom, ToolResultDataDelta, ToolResultEnd, ToolResultStart
from agentscope_py.mcp import MCPClient, MCPConnectionError, MCPTimeoutError

# One server process for the module (starting one costs seconds on a busy machine): the tests
# hold it with `async with`, so they also show that a held session serves many runs.
log = mcp_helpers.log  # a fixture
pytestmark = [pytest.mark.mcp, pytest.mark.timeout(30), pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def shared(tmp_path_factory: pytest.TempPathFactory) -> Any:
    log = tmp_path_factory.mktemp("mcp") / "server.log"
    log.touch()
    client = stdio_client(log)
    async with client:
        yield client
    await client.wait_closed()


def agent_for(client: Any, steps: list[ModelStep], **options: Any) -> tuple[ReActAgent, ScriptedModel]:
    model = ScriptedModel(steps)
    return ReActAgent.builder().name("a").model(model).mcp(client, **options).build(), model


async def events_of(agent: ReActAgent, text: str = "go") -> list[Any]:
    return [ev async for ev in agent.stream(text)]


async def test_a_full_agent_turn_over_stdio(shared: MCPClient) -> None:
    client = shared
    agent, model = agent_for(client, [ModelStep.tool_call("echo", {"text": "hello"}, id="c1"),
                                      ModelStep.text("done")])
    events = await events_of(agent)
    # The model was offered the server's tools, and saw the result.
    assert "echo" in [t.name for t in model.requests[0].tools]
    assert model.requests[1].messages[-1].tool_results[0].output == "hello"
    start = next(e for e in events if isinstance(e, ToolResultStart))
    end = next(e for e in events if isinstance(e, ToolResultEnd))
    assert start.metadata["mcp.server.name"] == "mcp_test_server" == end.metadata["mcp.server.name"]
    assert end.state is ToolResultState.SUCCESS
    assert events[-2].result.text == "done"
    assert client.users == 1  # the run held it, and let go
    assert client.protocol_version == "2026-07-28"


async def test_images_structured_content_errors_and_prefix(shared: MCPClient) -> None:
    client = shared
    agent, model = agent_for(client, [
        ModelStep(tool_calls=[_call("c1", "t_picture", {}), _call("c2", "t_weather", {"city": "Oslo"}),
                              _call("c3", "t_boom", {})]),
        ModelStep.text("ok"),
    ], prefix="t_", exclude=["hang"])
    events = await events_of(agent)
    assert "t_hang" not in [t.name for t in model.requests[0].tools]
    data = [e for e in events if isinstance(e, ToolResultDataDelta)]
    assert len(data) == 1 and data[0].data.media_type == "image/png" and data[0].data.data
    structured = [e for e in events if isinstance(e, Custom) and e.name == "mcp.structured_content"]
    weather = next(e for e in structured if e.value["tool"] == "weather")
    assert weather.value["data"] == {"city": "Oslo", "temperature_c": 21.5}
    assert weather.value["tool_call_id"] == "c2"
    results = {r.id: r for r in model.requests[1].messages[-1].tool_results}
    assert results["c1"].state is ToolResultState.SUCCESS and "a red dot" in results["c1"].text
    assert results["c3"].state is ToolResultState.ERROR and "boom" in results["c3"].text


async def test_progress_notifications_become_events(shared: MCPClient) -> None:
    agent, _ = agent_for(shared, [ModelStep.tool_call("slow", {"steps": 3}, id="p1"),
                                             ModelStep.text("ok")])
    events = await events_of(agent)
    progress = [e for e in events if isinstance(e, Custom) and e.name == "mcp.progress"]
    assert [(p.value["progress"], p.value["total"]) for p in progress] == [(1, 3), (2, 3), (3, 3)]
    assert {p.value["tool_call_id"] for p in progress} == {"p1"}
    end = next(e for e in events if isinstance(e, ToolResultEnd))
    assert events.index(progress[-1]) < events.index(end)


async def test_results_over_the_cap_are_truncated_with_a_note(shared: MCPClient) -> None:
    agent, model = agent_for(shared, [ModelStep.tool_call("big", {"size": 5000}, id="b1"), ModelStep.text("ok")],
                             max_result_chars=1000)
    await events_of(agent)
    text = model.requests[1].messages[-1].tool_results[0].text
    assert text.startswith("x" * 1000) and "x" * 1001 not in text
    assert "[truncated: the result was 5000 characters" in text


async def test_two_agents_share_one_session(shared: MCPClient) -> None:
    first, model1 = agent_for(shared, [ModelStep.tool_call("count", {}, id="a"), ModelStep.text("1")])
    second, model2 = agent_for(shared, [ModelStep.tool_call("count", {}, id="b"), ModelStep.text("2")])
    connects = shared.connects
    await first.call("go")
    await second.call("go")
    # The server kept its state between the agents' calls: one process, one session.
    n1 = int(model1.requests[1].messages[-1].tool_results[0].text)
    n2 = int(model2.requests[1].messages[-1].tool_results[0].text)
    assert n2 == n1 + 1 and shared.connects == connects


async def test_a_tool_list_change_reaches_the_next_round(shared: MCPClient) -> None:
    agent, model = agent_for(shared, [ModelStep.tool_call("add_tool", {"name": "fresh"}, id="n1"),
                                      ModelStep.text("added"), ModelStep.tool_call("fresh", {}, id="n2"),
                                      ModelStep.text("used")])
    assert "fresh" not in [t.name for t in await shared.list_tools()]
    changed = asyncio.ensure_future(shared.wait_tools_changed(timeout=10))
    await asyncio.sleep(0)
    await agent.call("go")
    assert "fresh" in [t.name for t in await changed]
    await agent.call("again")
    assert "fresh" in [t.name for t in model.requests[2].tools]
    assert model.requests[3].messages[-1].tool_results[0].text == "I am fresh"


async def test_the_published_time_server_over_stdio() -> None:
    client = MCPClient.stdio(sys.executable, ["-m", "mcp_server_time", "--local-timezone", "UTC"], name="time")
    agent, model = agent_for(client, [ModelStep.tool_call("get_current_time", {"timezone": "Europe/Paris"}, id="t1"),
                                      ModelStep.text("it is late")])
    events = await events_of(agent)
    assert "convert_time" in [t.name for t in model.requests[0].tools]
    result = model.requests[1].messages[-1].tool_results[0]
    assert result.state is ToolResultState.SUCCESS and "Europe/Paris" in result.text
    assert next(e for e in events if isinstance(e, ToolResultStart)).metadata["mcp.server.name"] == "time"


async def test_a_server_that_never_answers_the_handshake_times_out() -> None:
    client = MCPClient.stdio(sys.executable, ["-c", "import time; time.sleep(30)"], init_timeout=0.5)
    with pytest.raises(MCPTimeoutError, match="handshake"):
        await client.list_tools()
    missing = MCPClient.stdio("/nonexistent/mcp-server", init_timeout=2)
    with pytest.raises(MCPConnectionError):
        await missing.list_tools()
    # A run whose server cannot start fails with the typed error (nothing stuck).
    agent, _ = agent_for(missing, [ModelStep.text("never")])
    with pytest.raises(MCPConnectionError):
        await agent.call("go")
    assert missing.users == 0


async def test_elicitation_is_answered_by_the_handler(shared: MCPClient) -> None:
    asked: list[Any] = []

    def handler(question: Any) -> dict[str, str]:
        asked.append(question)
        return {"colour": "blue"}

    shared.elicitation = handler
    try:
        agent, model = agent_for(shared, [ModelStep.tool_call("favourite_colour", {}, id="q1"), ModelStep.text("ok")])
        await agent.call("go")
    finally:
        shared.elicitation = None
    assert model.requests[1].messages[-1].tool_results[0].text == "the user likes blue"
    assert asked[0].message == "What is your favourite colour?" and asked[0].tool_call_id == "q1"
    assert "colour" in asked[0].schema["properties"]


async def test_elicitation_without_a_handler_pauses_for_the_user_and_resumes_with_the_answer(
    shared: MCPClient,
) -> None:
    from agentscope_py import ConfirmResult, GenerateReason, confirm_message
    from agentscope_py.events import RequireUserConfirm

    agent, model = agent_for(shared, [ModelStep.tool_call("favourite_colour", {}, id="q2"), ModelStep.text("noted")])
    events = await events_of(agent)
    ask = next(e for e in events if isinstance(e, RequireUserConfirm))
    assert [c.id for c in ask.tool_calls] == ["q2"]
    assert ask.metadata["question"]["message"] == "What is your favourite colour?"
    assert ask.metadata["mcp.server.name"] == "mcp_test_server"
    assert next(e for e in events if isinstance(e, ToolResultEnd)).state is ToolResultState.RUNNING
    assert events[-2].result.generate_reason is GenerateReason.PERMISSION_ASKING
    assert len(model.requests) == 1  # the model waits with the user
    reply = await agent.call(confirm_message(ConfirmResult(tool_call_id="q2", confirmed=True,
                                                           answer={"colour": "green"})))
    assert reply.text == "noted"
    assert model.requests[1].messages[-1].tool_results[0].text == "the user likes green"


async def test_sampling_is_refused_unless_a_handler_allows_it(shared: MCPClient) -> None:
    import mcp_types

    agent, model = agent_for(shared, [ModelStep.tool_call("summarise", {}, id="s1"), ModelStep.text("no"),
                                      ModelStep.tool_call("summarise", {}, id="s2"), ModelStep.text("yes")])
    await agent.call("go")
    refused = model.requests[1].messages[-1].tool_results[0]
    assert refused.state is ToolResultState.ERROR and "the model said" not in refused.text
    # Allowing it takes a new session: the sampling capability is declared at the handshake.
    seen: list[Any] = []

    def allow(params: Any) -> Any:
        seen.append(params)
        return mcp_types.CreateMessageResult(role="assistant", model="scripted",
                                             content=mcp_types.TextContent(type="text", text="hi there"))

    shared.sampling = allow
    try:
        await shared.aclose()  # (the module still holds it: the next use opens a new session)
        await agent.call("go")
    finally:
        shared.sampling = None
    assert model.requests[3].messages[-1].tool_results[0].text == "the model said: hi there"
    assert seen and seen[0].max_tokens == 10


async def test_mcp_tools_pass_the_same_permission_gate(shared: MCPClient) -> None:
    from agentscope_py import PermissionDecision
    from agentscope_py.events import RequireUserConfirm

    toolkit = Toolkit(policy=lambda call, ctx: PermissionDecision.ASK if call.name == "count" else "allow")
    toolkit.register_mcp(shared)
    model = ScriptedModel([ModelStep.tool_call("count", {}, id="g1")])
    agent = ReActAgent.builder().model(model).toolkit(toolkit).build()
    events = [ev async for ev in agent.stream("go")]
    ask = next(e for e in events if isinstance(e, RequireUserConfirm))
    assert [c.name for c in ask.tool_calls] == ["count"]
    assert not any(isinstance(e, ToolResultStart) for e in events)  # never sent to the server


def _call(cid: str, name: str, args: dict[str, Any]) -> Any:
    from agentscope_py import ToolUseBlock

    return ToolUseBlock(id=cid, name=name, input=args)
