"""ToolPolicyMiddleware: allow/deny globs, rules that see arguments and the RuntimeContext, the
denied results the model sees, AllToolsDenied, hidden tools, unknown names; with ToolCallLimit."""

from __future__ import annotations

from typing import Any

import pytest

from agentscope_py import (
    GenerateReason,
    Msg,
    PermissionDecision,
    ReActAgent,
    RuntimeContext,
    ScriptedModel,
    Toolkit,
    ToolResultState,
    tool,
)
from agentscope_py.message import ToolUseBlock
from agentscope_py.middleware import StopOnAllDeniedMiddleware, ToolCallLimitMiddleware, ToolPolicyMiddleware
from agentscope_py.model import ModelStep

pytestmark = pytest.mark.timeout(20)
ran: list[str] = []


@tool
async def read_file(path: str) -> str:
    """Read a file."""
    ran.append(f"read {path}")
    return f"content of {path}"


@tool
async def delete_file(path: str) -> str:
    """Delete a file."""
    ran.append(f"delete {path}")
    return f"deleted {path}"


@tool
async def delete_user(user: str) -> str:
    """Delete a user."""
    ran.append(f"delete user {user}")
    return "gone"


@tool(check_permissions=lambda call, ctx: PermissionDecision.DENY)
async def shutdown() -> str:
    """Never allowed by its own check."""
    ran.append("shutdown")
    return "down"


@pytest.fixture(autouse=True)
def _clear() -> None:
    ran.clear()


def _toolkit() -> Toolkit:
    return Toolkit([read_file, delete_file, delete_user, shutdown])


def _agent(steps: list[ModelStep], *mws: Any) -> tuple[ReActAgent, ScriptedModel]:
    model = ScriptedModel(steps)
    agent = ReActAgent.builder().model(model).toolkit(_toolkit()).middlewares(list(mws)).build()
    return agent, model


def _admin_only(call: ToolUseBlock, ctx: RuntimeContext) -> bool | str:
    return ctx.get("role") == "admin" or "only an admin may delete"


def _results(msg: Msg) -> list[tuple[str, str, str]]:
    return [(b.name, b.state.value, b.text) for b in msg.tool_results]


async def test_rule_sees_ctx_and_denied_result_reaches_the_model() -> None:
    steps = [ModelStep.tool_calls_of(("delete_file", {"path": "/a"}), ("read_file", {"path": "/b"})),
             ModelStep.text("ok")]
    policy = ToolPolicyMiddleware(rules={"delete_*": _admin_only})
    agent, model = _agent(steps, policy)
    events = await agent.stream("go", ctx=RuntimeContext(role="user")).to_list()
    assert ran == ["read /b"]
    ends = [(e.tool_name, e.state) for e in events if e.type == "tool_result_end"]
    assert ends == [("delete_file", ToolResultState.DENIED), ("read_file", ToolResultState.SUCCESS)]
    assert "all_tools_denied" not in [e.type for e in events]
    # what the model saw next: the results in call order, the denial with its reason
    seen = model.requests[1].messages[-1]
    assert seen.role == "tool"
    assert _results(seen) == [
        ("delete_file", "denied",
         "Permission denied: the call to delete_file was not allowed by the tool policy."),
        ("read_file", "success", "content of /b"),
    ]

    ran.clear()
    agent2, _ = _agent(list(steps), ToolPolicyMiddleware(rules={"delete_*": _admin_only}))
    await agent2.call("go", ctx=RuntimeContext(role="admin"))
    assert ran == ["delete /a", "read /b"]


async def test_message_template_gets_the_reason() -> None:
    steps = [ModelStep.tool_call("delete_user", {"user": "bob"}), ModelStep.text("fine")]
    policy = ToolPolicyMiddleware(rules={"delete_*": _admin_only}, message="{name} refused: {reason}")
    agent, model = _agent(steps, policy)
    await agent.call("go")
    assert _results(model.requests[1].messages[-1]) == [
        ("delete_user", "denied", "delete_user refused: only an admin may delete")]


async def test_async_rule_sees_arguments() -> None:
    async def no_etc(call: ToolUseBlock, ctx: RuntimeContext) -> bool:
        return not str(call.input.get("path", "")).startswith("/etc")

    steps = [ModelStep.tool_calls_of(("read_file", {"path": "/etc/passwd"}), ("read_file", {"path": "/tmp/x"})),
             ModelStep.text("ok")]
    agent, _ = _agent(steps, ToolPolicyMiddleware(rules={"read_file": no_etc}))
    await agent.call("go")
    assert ran == ["read /tmp/x"]


async def test_all_denied_fires_all_tools_denied_and_stop_on_all_denied_stops() -> None:
    steps = [ModelStep.tool_calls_of(("delete_file", {"path": "/a"}), ("shutdown", {}))]
    # the policy denies one, the tool's own gate the other: one notice lists both, in call order
    agent, model = _agent(steps, StopOnAllDeniedMiddleware(), ToolPolicyMiddleware(deny=["delete_*"]))
    events = await agent.stream("go").to_list()
    notices = [e for e in events if e.type == "all_tools_denied"]
    assert len(notices) == 1
    assert [c.name for c in notices[0].denied_tool_calls] == ["delete_file", "shutdown"]
    assert events[-2].result.generate_reason is GenerateReason.ALL_TOOLS_DENIED
    assert ran == []
    model.assert_complete()


async def test_all_denied_by_policy_alone() -> None:
    steps = [ModelStep.tool_call("delete_file", {"path": "/a"}), ModelStep.text("I may not.")]
    agent, model = _agent(steps, ToolPolicyMiddleware(allow=["read_*"]))
    events = await agent.stream("go").to_list()
    model.assert_complete()
    types = [e.type for e in events]
    assert types.count("all_tools_denied") == 1
    assert events[-2].result.text == "I may not."  # without StopOnAllDenied the loop goes on
    assert ran == []


async def test_listed_denials_hide_tools_from_the_model() -> None:
    agent, model = _agent([ModelStep.text("hi")], ToolPolicyMiddleware(allow=["read_*", "delete_*"],
                                                                       deny=["delete_user"]))
    await agent.call("go")
    assert [t.name for t in model.requests[0].tools] == ["read_file", "delete_file"]
    shown, model2 = _agent([ModelStep.text("hi")], ToolPolicyMiddleware(deny=["shutdown"], hide_denied=False))
    await shown.call("go")
    assert len(model2.requests[0].tools) == 4


def test_unknown_tool_names_fail_at_construction_with_a_toolkit() -> None:
    with pytest.raises(ValueError, match=r"deny: no tool matches 'delet_\*'.*read_file"):
        ToolPolicyMiddleware(deny=["delet_*"], toolkit=_toolkit())
    with pytest.raises(ValueError, match="rules: no tool matches 'nope'"):
        ToolPolicyMiddleware(rules={"nope": _admin_only}, toolkit=_toolkit())
    with pytest.raises(TypeError, match="allow must be a list"):
        ToolPolicyMiddleware(allow="read_file")
    with pytest.raises(TypeError, match=r"rules\['read_file'\] must be a callable"):
        ToolPolicyMiddleware(rules={"read_file": "yes"})  # type: ignore[dict-item]


async def test_unknown_tool_names_fail_at_the_first_run_without_a_toolkit() -> None:
    agent, model = _agent([ModelStep.text("never")], ToolPolicyMiddleware(allow=["raed_file"]))
    with pytest.raises(ValueError, match="allow: no tool matches 'raed_file'"):
        await agent.call("go")
    assert model.requests == []  # the model was never called


async def test_composes_with_tool_call_limit() -> None:
    # The limit is outer (registered first): it counts the round's calls, the policy denies one.
    steps = [ModelStep.tool_calls_of(("read_file", {"path": "/1"}), ("delete_file", {"path": "/2"}),
                                     ("read_file", {"path": "/3"})),
             ModelStep.text("done")]
    limit = ToolCallLimitMiddleware(run_limit=2, exit_behavior="continue")
    agent, model = _agent(steps, limit, ToolPolicyMiddleware(deny=["delete_*"]))
    await agent.call("go")
    assert ran == ["read /1"]
    states = [(b.name, b.state.value) for b in model.requests[1].messages[-1].tool_results]
    assert states == [("read_file", "success"), ("delete_file", "denied"), ("read_file", "error")]
