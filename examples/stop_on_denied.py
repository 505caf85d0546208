"""Stop the run when every tool call of a round is denied (StopOnAllDeniedMiddleware)."""

import asyncio

from agentscope_py import ModelStep, PermissionDecision, ReActAgent, ScriptedModel, tool
from agentscope_py.middleware import StopOnAllDeniedMiddleware


@tool(check_permissions=lambda call, ctx: PermissionDecision.DENY)
def drop_database(name: str) -> str:
    """Drop a database (never allowed here)."""
    return f"dropped {name}"


async def main() -> None:
    for stop in (False, True):
        model = ScriptedModel([ModelStep.tool_call("drop_database", {"name": "prod"}),
                               ModelStep.text("I am not allowed to do that.")])
        builder = ReActAgent.builder().model(model).tools(drop_database)
        if stop:
            builder.middleware(StopOnAllDeniedMiddleware())
        msg = await builder.build().call("Clean up prod.")
        print(f"with middleware={stop}: {msg.generate_reason.value}, model calls: {len(model.requests)}")


asyncio.run(main())
