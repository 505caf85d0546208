"""Tools that run in the workflow rather than as activities: structured output's per-call
``generate_response`` tool (`agent.RESPONSE_TOOL`) records the validated output in the run itself,
so it must run where the run is; it does no I/O and is deterministic."""

from __future__ import annotations

from .._acting import ToolExecutor, ToolScope, tool_output
from .._response_tool import answer_tool
from ..agent.react import ReActAgent
from ..message import ToolUseBlock
from ..stream import Channel
from ..tool.toolkit import Tool

__all__ = ["with_local_tools"]


def with_local_tools(agent: ReActAgent, activities: ToolExecutor) -> ToolExecutor:
    """``activities`` for every tool but the structured-output tool (unless the agent has a tool
    of that name of its own, which is a tool like any other)."""
    answer = answer_tool(agent.toolkit)

    async def executor(scope: ToolScope, call: ToolUseBlock, tool: Tool, channel: Channel) -> None:
        if call.name == answer:
            await tool_output(scope, call, tool, channel)
        else:
            await activities(scope, call, tool, channel)

    return executor
