"""Run in a process of its own by the long-result tests: agent calls of tools of
``mcp_long_server.py`` under a cap, each with the peak of traced memory and of the process's RSS.

``python mcp_peak_child.py TRANSPORT CASES_JSON CAP``: TRANSPORT is ``stdio`` or the server's URL;
CASES_JSON a list of ``[tool, args]``. On one session, for each case: a small call, the case's
call, and a small call after it. It prints a JSON list, one object a case: ``small`` and ``peak``
(traced bytes at the peak of the small call and of the case's call), ``rss`` (how much the case's
call raised the process's peak RSS, bytes), ``text`` (what the model read), ``error`` (whether
the result was an error) and ``after`` (what the next call on the session returned).
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import tracemalloc
from pathlib import Path
from typing import Any

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, ToolResultState
from agentscope_py.mcp import MCPClient

SERVER = str(Path(__file__).resolve().parent / "mcp_long_server.py")


async def traced(agent: ReActAgent) -> int:
    tracemalloc.start()
    try:
        await agent.call("go")
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


async def main(transport: str, cases: list[tuple[str, dict[str, Any]]], cap: int) -> list[dict[str, Any]]:
    client = (MCPClient.stdio(sys.executable, [SERVER], name="long", timeout=60) if transport == "stdio"
              else MCPClient.http(transport, name="long", timeout=60))
    runs = []
    async with client:
        for tool, args in cases:
            steps = [ModelStep.tool_call("echo", {"text": "warm"}, id="w"), ModelStep.text("ok"),
                     ModelStep.tool_call("echo", {"text": "small"}, id="s"), ModelStep.text("ok"),
                     ModelStep.tool_call(tool, args, id="big"), ModelStep.text("ok"),
                     ModelStep.tool_call("echo", {"text": "after"}, id="a"), ModelStep.text("ok")]
            model = ScriptedModel(steps)
            agent = ReActAgent.builder().model(model).mcp(client, max_result_chars=cap).build()
            await agent.call("go")
            small = await traced(agent)
            rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak = await traced(agent)
            rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024
            await agent.call("go")
            big = model.requests[5].messages[-1].tool_results[0]
            after = model.requests[7].messages[-1].tool_results[0]
            runs.append({"small": small, "peak": peak, "rss": rss, "text": big.text,
                         "error": big.state == ToolResultState.ERROR, "after": after.text})
    await client.wait_closed()
    return runs


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])))))
