"""Tool policy, tool selection and human approval on one agent (offline, ScriptedModel).

A guest may read but not delete; the model is offered only the tools the request needs (chosen
by a selector model whose call never reaches the stream); sending email waits for a human, who
edits the message before it goes out.
"""

import asyncio

from agentscope_py import ModelStep, ReActAgent, RuntimeContext, ScriptedModel, Toolkit, tool
from agentscope_py.message import ToolUseBlock
from agentscope_py.middleware import (
    Edit,
    HumanApprovalMiddleware,
    LLMToolSelectorMiddleware,
    ToolPolicyMiddleware,
    approval_message,
)


@tool
def read_file(path: str) -> str:
    """Read a file."""
    return f"report for Q3 (from {path})"


@tool
def delete_file(path: str) -> str:
    """Delete a file."""
    return f"deleted {path}"


@tool
def send_email(to: str, body: str) -> str:
    """Send an email."""
    return f"sent to {to}: {body}"


def admins_only(call: ToolUseBlock, ctx: RuntimeContext) -> bool | str:
    return ctx.get("role") == "admin" or "guests cannot delete files"


async def main() -> None:
    selector = ScriptedModel([ModelStep.tool_call("select_tools", {"tools": ["read_file", "send_email",
                                                                           "delete_file"]})],
                              name="selector", loop=True)  # asked again every round
    model = ScriptedModel([
        ModelStep.tool_calls_of(("read_file", {"path": "/q3.txt"}), ("delete_file", {"path": "/q3.txt"}),
                                ("send_email", {"to": "bob@example.com", "body": "report"})),
        ModelStep.text("I read the report and emailed Bob; deleting it was not allowed."),
    ], name="main")
    agent = (ReActAgent.builder().model(model).toolkit(Toolkit([read_file, delete_file, send_email]))
             .middlewares([LLMToolSelectorMiddleware(selector, max_tools=3),
                           ToolPolicyMiddleware(rules={"delete_*": admins_only}),
                           HumanApprovalMiddleware({"send_email": True})])
             .build())
    ctx = RuntimeContext(user_id="guest-1", session_id="s1", role="guest")
    events = await agent.stream("Send Bob the Q3 report, then delete it.", ctx=ctx).to_list()
    for e in events:
        if e.type == "tool_result_end":
            print(f"{e.tool_name}: {e.state.value}")
    ask = next(e for e in events if e.type == "require_user_confirm")
    print("waiting for approval:", [c.name for c in ask.tool_calls])
    assert [e.model for e in events if e.type == "model_call_start"] == ["main"]

    call = ask.tool_calls[0]
    edited = Edit({"to": "bob@example.com", "body": "Hi Bob, the Q3 report is attached."})
    final = await agent.call(approval_message({call.id: edited}), ctx=RuntimeContext(user_id="guest-1",
                                                                                     session_id="s1", role="guest"))
    results = {r.name: r.text for m in model.requests[1].messages for r in m.tool_results}
    print("the model saw:", results)
    print("answer:", final.text)
    assert results["delete_file"].endswith("was not allowed by the tool policy.")
    assert results["send_email"] == "sent to bob@example.com: Hi Bob, the Q3 report is attached."


asyncio.run(main())
