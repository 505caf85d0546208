"""Run by test_subagents_control in a separate OS process (a real restart): a root whose
sub-agent asks to confirm a tool call, on a SQLite store.

``ask``: the root delegates, the child calls ``rm`` (which asks); prints the final reason and the
RequireUserConfirm the caller saw (call ids, source). ``confirm``: a fresh process confirms the
child's call through the root; prints the final text and what ran."""

from __future__ import annotations

import asyncio
import json
import sys

from agentscope_py import PermissionDecision, ReActAgent, RuntimeContext, ScriptedModel, confirm_message, tool
from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.events import ConfirmResult, RequireUserConfirm
from agentscope_py.model import ModelStep

ran: list[str] = []


@tool(check_permissions=lambda call, ctx: PermissionDecision.ASK)
async def rm(path: str) -> str:
    """Remove a file."""
    ran.append(path)
    return f"removed {path}"


async def main(phase: str, db: str) -> None:
    async with SqliteStateStore(db) as store:
        child_steps = ([ModelStep.tool_call("rm", {"path": "/tmp/x"}, id="c-rm")] if phase == "ask"
                       else [ModelStep.text("child removed it")])
        root_steps = ([ModelStep.tool_call("child", {"task": "clean up"}, id="r1")] if phase == "ask"
                      else [ModelStep.text("root done")])
        child = (ReActAgent.builder().name("child").model(ScriptedModel(child_steps)).tools(rm)
                 .state_store(store).build())
        root = (ReActAgent.builder().name("root").model(ScriptedModel(root_steps)).tools(child.as_tool())
                .state_store(store).build())
        ctx = RuntimeContext(user_id="u", session_id="s")
        if phase == "ask":
            events = await root.stream("go", ctx=ctx).to_list()
            asks = [{"ids": [c.id for c in e.tool_calls], "source": e.source}
                    for e in events if type(e) is RequireUserConfirm]
            print(json.dumps({"reason": events[-2].result.generate_reason.value, "asks": asks}))
        else:
            msg = await root.call(confirm_message(ConfirmResult(tool_call_id="c-rm", confirmed=True)), ctx=ctx)
            child_state, _ = await store.load("u", "s/child")
            root_state, _ = await store.load("u", "s")
            assert child_state is not None and root_state is not None
            print(json.dumps({"text": msg.text, "ran": ran, "child_pending": child_state.pending_tool_calls,
                              "root_pending": root_state.pending_tool_calls,
                              "waits": root_state.metadata.get("agentscope.subagent_waits")}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
