"""Human approval, external tools, structured output: exact events, reasons, and what the model
sees next."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import types
from pydantic import BaseModel

from agentscope_py import (
    ConfirmResult,
    GenerateReason,
    Msg,
    PendingToolCallsError,
    PermissionDecision,
    ReActAgent,
    ResumeError,
    ScriptedModel,
    StopOnAllDeniedMiddleware,
    StructuredOutputError,
    Toolkit,
    ToolResultBlock,
    ToolResultState,
    confirm_message,
    tool,
)
from agentscope_py.agent import InMemoryStateStore, SqliteStateStore
from agentscope_py.model import ModelStep

ran: list[str] = []


@tool(check_permissions=lambda call, ctx: PermissionDecision.ASK)
async def rm(path: str) -> str:
    """Remove a file."""
    ran.append(f"rm {path}")
    return f"removed {path}"


@tool(check_permissions=lambda call, ctx: PermissionDecision.DENY)
async def format_disk() -> str:
    """Never allowed."""
    ran.append("format")
    return "formatted"


@tool
async def ls() -> str:
    """List files."""
    ran.append("ls")
    return "a b"


@pytest.fixture(autouse=True)
def clear_ran() -> None:
    ran.clear()


def agent_with(steps: list[ModelStep], *tools: Any, **kw: Any) -> tuple[ReActAgent, ScriptedModel]:
    model = ScriptedModel(steps)
    builder = ReActAgent.builder().model(model).toolkit(Toolkit([rm, format_disk, ls, *tools]))
    for m in kw.get("middlewares", []):
        builder.middleware(m)
    return builder.build(), model


async def test_ask_pauses_then_confirm_resumes() -> None:
    agent, model = agent_with([ModelStep.tool_calls_of(("rm", {"path": "/a"}), ("ls", {})), ModelStep.text("all done")])
    events = await agent.stream("clean").to_list()
    i = types(events).index("require_user_confirm")
    assert types(events)[i:] == ["require_user_confirm", "request_stop", "agent_result", "agent_end"]
    assert [c.name for c in events[i].tool_calls] == ["rm"]
    assert events[i + 1].generate_reason is GenerateReason.PERMISSION_ASKING
    paused = events[-2].result
    assert paused.generate_reason is GenerateReason.PERMISSION_ASKING and [c.name for c in paused.tool_calls] == ["rm", "ls"]
    assert ran == ["ls"]  # allowed calls of the batch ran; the asking one waits
    call_id = paused.tool_calls[0].id
    with pytest.raises(PendingToolCallsError):
        await agent.call("a plain prompt while asking")
    events = await agent.stream(confirm_message(ConfirmResult(tool_call_id=call_id, confirmed=True))).to_list()
    assert types(events)[:5] == ["agent_start", "user_confirm_result", "tool_result_start", "tool_result_text_delta",
                                 "tool_result_end"]
    assert events[1].confirm_results[0].tool_call_id == call_id
    assert events[-2].result.text == "all done" and ran == ["ls", "rm /a"]
    sent = model.requests[1].messages
    assert [m.role for m in sent] == ["system", "user", "assistant", "tool", "tool"]
    assert {r.id: r.output for m in sent[3:] for r in m.tool_results} == {
        call_id: "removed /a", paused.tool_calls[1].id: "a b"}


async def test_confirm_with_edited_arguments_and_denial() -> None:
    agent, model = agent_with([ModelStep.tool_calls_of(("rm", {"path": "/a"}), ("rm", {"path": "/b"})),
                               ModelStep.text("ok")])
    paused = await agent.call("x")
    a, b = (c.id for c in paused.tool_calls)
    await agent.call(confirm_message(ConfirmResult(tool_call_id=a, confirmed=True, input={"path": "/tmp/a"}),
                                     {"tool_call_id": b, "confirmed": False, "reason": "keep it"}))
    assert ran == ["rm /tmp/a"]
    sent = model.requests[1].messages
    assert sent[2].tool_calls[0].input == {"path": "/tmp/a"}  # memory shows what actually ran
    results = {r.id: r for m in sent[3:] for r in m.tool_results}
    assert results[b].state is ToolResultState.DENIED and "keep it" in results[b].output
    assert results[a].output == "removed /tmp/a"


async def test_partial_confirmation_leaves_the_rest_asking() -> None:
    agent, model = agent_with([ModelStep.tool_calls_of(("rm", {"path": "/a"}), ("rm", {"path": "/b"})),
                               ModelStep.text("ok")])
    paused = await agent.call("x")
    a, b = (c.id for c in paused.tool_calls)
    again = await agent.call(confirm_message(ConfirmResult(tool_call_id=a, confirmed=True)))
    assert again.generate_reason is GenerateReason.PERMISSION_ASKING and ran == ["rm /a"]
    final = await agent.call(confirm_message(ConfirmResult(tool_call_id=b, confirmed=True)))
    assert final.text == "ok" and ran == ["rm /a", "rm /b"] and len(model.requests) == 2


async def test_bad_resume_inputs_are_rejected_and_change_nothing() -> None:
    agent, _ = agent_with([ModelStep.tool_call("rm", {"path": "/a"}, id="c1"), ModelStep.text("ok")])
    await agent.call("x")
    state_before, _ = await agent.state_store.load("default", "default")
    assert state_before is not None
    snapshot = state_before.model_dump_json()
    with pytest.raises(ResumeError, match="not a pending tool call"):
        await agent.call(confirm_message(ConfirmResult(tool_call_id="nope", confirmed=True)))
    with pytest.raises(ResumeError, match="duplicate"):
        await agent.call(confirm_message(ConfirmResult(tool_call_id="c1", confirmed=True),
                                         ConfirmResult(tool_call_id="c1", confirmed=False)))
    with pytest.raises(ResumeError, match="not a pending tool call"):
        await agent.call(Msg.tool([ToolResultBlock(id="zzz", name="rm", output="x")]))
    state_after, _ = await agent.state_store.load("default", "default")
    assert state_after is not None and state_after.model_dump_json() == snapshot
    # Nothing pending: control inputs are errors too.
    agent2, _ = agent_with([ModelStep.text("hi")])
    with pytest.raises(ResumeError, match="no tool call is waiting"):
        await agent2.call(confirm_message(ConfirmResult(tool_call_id="c1", confirmed=True)))
    assert (await agent.call(confirm_message(ConfirmResult(tool_call_id="c1", confirmed=True)))).text == "ok"


async def test_deny_gives_the_model_a_denied_result_and_all_denied_goes_on_by_default() -> None:
    agent, model = agent_with([ModelStep.tool_call("format_disk", {}), ModelStep.text("fine, I won't")])
    events = await agent.stream("format").to_list()
    assert "all_tools_denied" in types(events)
    assert events[-2].result.text == "fine, I won't" and ran == []
    result = model.requests[1].messages[-1].tool_results[0]
    assert result.state is ToolResultState.DENIED and "Permission denied" in result.output


async def test_stop_on_all_denied_middleware() -> None:
    agent, model = agent_with([ModelStep.tool_call("format_disk", {}), ModelStep.text("unused")],
                              middlewares=[StopOnAllDeniedMiddleware()])
    events = await agent.stream("format").to_list()
    i = types(events).index("all_tools_denied")
    assert types(events)[i:i + 2] == ["all_tools_denied", "request_stop"]
    assert events[-2].result.generate_reason is GenerateReason.ALL_TOOLS_DENIED
    assert len(model.requests) == 1


async def test_toolkit_policy_is_consulted() -> None:
    toolkit = Toolkit([ls], policy=lambda call, ctx: PermissionDecision.DENY if ctx.user_id == "guest" else "allow")
    model = ScriptedModel([ModelStep.tool_call("ls", {}), ModelStep.text("a"), ModelStep.tool_call("ls", {}),
                           ModelStep.text("b")])
    agent = ReActAgent.builder().model(model).toolkit(toolkit).build()
    from agentscope_py import RuntimeContext

    await agent.call("x", ctx=RuntimeContext(user_id="guest"))
    assert ran == []
    await agent.call("x", ctx=RuntimeContext(user_id="admin"))
    assert ran == ["ls"]


async def test_external_tools_suspend_and_resume_with_results() -> None:
    toolkit = Toolkit()
    toolkit.register_schema("browser_click", "Click in the user's browser.",
                            {"type": "object", "properties": {"selector": {"type": "string"}}})

    @tool(external=True)
    def ask_user(question: str) -> str:
        """Ask the user (answered outside the agent)."""
        raise AssertionError("never called")

    toolkit.register(ask_user)
    model = ScriptedModel([ModelStep.tool_calls_of(("browser_click", {"selector": "#go"}), ("ask_user", {"question": "?"})),
                           ModelStep.text("clicked")])
    agent = ReActAgent.builder().model(model).toolkit(toolkit).build()
    events = await agent.stream("go").to_list()
    i = types(events).index("require_external_execution")
    assert [c.name for c in events[i].tool_calls] == ["browser_click", "ask_user"]
    paused = events[-2].result
    assert paused.generate_reason is GenerateReason.TOOL_SUSPENDED
    assert [r.state for r in paused.tool_results] == [ToolResultState.RUNNING] * 2
    ids = [c.id for c in paused.tool_calls]
    half = await agent.call(Msg.tool([ToolResultBlock(id=ids[0], name="browser_click", output="ok")]))
    assert half.generate_reason is GenerateReason.TOOL_SUSPENDED and [r.id for r in half.tool_results] == [ids[1]]
    events = await agent.stream(Msg.tool([ToolResultBlock(id=ids[1], name="ask_user", output="yes")])).to_list()
    assert types(events)[:3] == ["agent_start", "external_execution_result", "model_call_start"]
    assert events[-2].result.text == "clicked"
    assert [r.output for m in model.requests[1].messages for r in m.tool_results] == ["ok", "yes"]


class Answer(BaseModel):
    city: str
    population: int


async def test_structured_output_with_the_generate_response_tool() -> None:
    model = ScriptedModel([
        ModelStep.text("Let me think."),                                   # no tool call: reminded
        ModelStep.tool_call("generate_response", {"city": "Paris", "population": "lots"}),  # invalid
        ModelStep.tool_call("generate_response", {"city": "Paris", "population": 2100000}),
    ])
    agent = ReActAgent.builder().model(model).build()
    msg = await agent.call("Biggest French city?", structured_model=Answer)
    assert msg.generate_reason is GenerateReason.STRUCTURED_OUTPUT
    assert msg.metadata["structured_output"] == Answer(city="Paris", population=2100000)
    assert Answer.model_validate_json(msg.text) == Answer(city="Paris", population=2100000)
    assert [t.name for t in model.requests[0].tools] == ["generate_response"]
    assert model.requests[0].tools[0].parameters["required"] == ["city", "population"]
    assert "generate_response" in model.requests[1].messages[-1].text  # the reminder
    error = model.requests[2].messages[-1].tool_results[0]
    assert error.state is ToolResultState.ERROR and "population" in error.output
    assert [t.name for t in agent.toolkit] == []  # the response tool was per call


@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
async def test_a_paused_structured_run_resumes_only_with_its_model(store_kind: str, tmp_path: Path) -> None:
    def build(steps: list[ModelStep]) -> tuple[ReActAgent, ScriptedModel]:
        store: Any = memory if store_kind == "memory" else SqliteStateStore(tmp_path / "s.db")
        model = ScriptedModel(steps)
        return ReActAgent.builder().model(model).toolkit(Toolkit([rm])).state_store(store).build(), model

    memory = InMemoryStateStore()
    agent, _ = build([ModelStep.tool_call("rm", {"path": "/a"}, id="rm-1")])
    paused = await agent.call("clean, then answer", structured_model=Answer)
    assert paused.generate_reason is GenerateReason.PERMISSION_ASKING
    before, version = await agent.state_store.load("default", "default")
    assert before is not None and before.metadata == {"agentscope.structured_model": f"{__name__}.Answer"}
    before = before.model_copy(deep=True)  # (the memory store keeps the state itself)

    # another agent over the same store (another process): the session says which model it was
    agent, model = build([ModelStep.tool_call("generate_response", {"city": "Paris", "population": 2})])
    approve = confirm_message(ConfirmResult(tool_call_id="rm-1", confirmed=True))
    for resume in (approve, None):
        with pytest.raises(ResumeError, match=rf"structured output {__name__}.Answer: .*structured_model=Answer"):
            await agent.call(resume)
    with pytest.raises(PendingToolCallsError):  # a new prompt: refused as on any paused session
        await agent.call("something else")
    after, same = await agent.state_store.load("default", "default")
    assert (after, same) == (before, version) and ran == [] and not model.requests  # nothing changed

    final = await agent.call(approve, structured_model=Answer)
    assert final.generate_reason is GenerateReason.STRUCTURED_OUTPUT and final.structured(Answer).city == "Paris"
    assert ran == ["rm /a"]
    done, _ = await agent.state_store.load("default", "default")
    assert done is not None and done.metadata == {}  # nothing waits: the next turn may be plain


async def test_structured_output_native_and_bounded_retries() -> None:
    model = ScriptedModel([ModelStep.text("not json"), ModelStep.text('{"city": "Lyon", "population": 500000}')],
                          supports_structured_output=True)
    agent = ReActAgent.builder().model(model).build()
    msg = await agent.call("x", structured_model=Answer)
    assert msg.metadata["structured_output"] == Answer(city="Lyon", population=500000)
    assert model.requests[0].structured_output == Answer.model_json_schema() and model.requests[0].tools == ()
    assert "not valid JSON" in model.requests[1].messages[-1].text
    stubborn = ScriptedModel([ModelStep.text("no")] * 4, supports_structured_output=True)
    agent = ReActAgent.builder().model(stubborn).build()
    with pytest.raises(StructuredOutputError):
        await agent.call("x", structured_model=Answer)
