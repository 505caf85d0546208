"""An agent using a published MCP server's tools: `mcp-server-time` over stdio.

The scripted model calls the server's `get_current_time`; the run holds the session and closes
it when it ends. Needs the `mcp` extra and `pip install mcp-server-time` (both in `dev`).
"""

import asyncio
import sys

from agentscope_py import ModelStep, ReActAgent, ScriptedModel
from agentscope_py.events import ToolResultEnd
from agentscope_py.mcp import MCPClient


async def main() -> None:
    time_server = MCPClient.stdio(sys.executable, ["-m", "mcp_server_time", "--local-timezone", "UTC"],
                                  name="time")
    model = ScriptedModel([
        ModelStep.tool_call("get_current_time", {"timezone": "Asia/Tokyo"}, id="t1"),
        ModelStep.text("I looked it up."),
    ])
    agent = ReActAgent.builder().name("clock").model(model).mcp(time_server).build()
    async for ev in agent.stream("What time is it in Tokyo?"):
        if isinstance(ev, ToolResultEnd):
            print(f"tool {ev.tool_name} from {ev.metadata['mcp.server.name']}: {ev.state.value}")
    result = model.requests[1].messages[-1].tool_results[0]
    print("the model saw Asia/Tokyo:", "Asia/Tokyo" in result.text)
    await time_server.wait_closed()
    print("session open after the run:", time_server.connected)


asyncio.run(main())
