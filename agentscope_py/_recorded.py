"""A journaled tool call's output: kept as it streams (its recorded result), and a recorded
result replayed as events (a resumed run's call that had ended: never run again)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .events import AgentEvent, ToolResultDataDelta, ToolResultEnd, ToolResultStart, ToolResultTextDelta
from .message import DataBlock, TextBlock, ToolResultBlock
from .stream import Channel

if TYPE_CHECKING:
    from .tool.toolkit import Tool

__all__ = ["INTERRUPTED_UNSURE_TEXT", "UNSETTLED_TEXT", "Recording", "journaled", "replay_events"]

INTERRUPTED_UNSURE_TEXT = ("The tool call was interrupted while it ran: it may or may not have taken effect; "
                           "check before calling it again.")
UNSETTLED_TEXT = ("Error: this call may or may not have taken effect (its run stopped while it ran) and nothing "
                  "decided which; it was not run again.")


def journaled(tool: Tool | None) -> bool:
    """Whether the agent journals a call of ``tool``: one it runs itself that is not idempotent."""
    return tool is not None and not tool.idempotent and not tool.external


class Recording(Channel):
    """A journaled call's channel: keeps the output it carries, for the call's recorded result."""

    __slots__ = ("parts",)

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.parts: list[str | DataBlock] = []

    def _keep(self, item: Any) -> None:
        if item.source is None:  # (a sub-agent's forwarded events are not the call's output)
            t = item.type
            if t == "tool_result_text_delta":
                self.parts.append(item.delta)
            elif t == "tool_result_data_delta":
                self.parts.append(item.data)

    def push(self, item: Any) -> None:
        self._keep(item)
        super().push(item)

    async def put(self, item: Any) -> None:
        self._keep(item)
        await super().put(item)


def replay_events(reply_id: str, block: ToolResultBlock, metadata: Any = None) -> list[AgentEvent]:
    """The events of a recorded result, replayed (a resumed run's call that had ended): its
    start says ``replayed``."""
    cid, name = block.id, block.name
    start_meta = {**(metadata or {}), "replayed": True}
    events: list[AgentEvent] = [ToolResultStart(reply_id=reply_id, tool_call_id=cid, tool_name=name,
                                                metadata=start_meta)]
    output = block.output
    for part in ([output] if isinstance(output, str) else output):
        if isinstance(part, str | TextBlock):
            text = part if isinstance(part, str) else part.text
            if text:
                events.append(ToolResultTextDelta(reply_id=reply_id, tool_call_id=cid, tool_name=name, delta=text))
        elif isinstance(part, DataBlock):
            events.append(ToolResultDataDelta(reply_id=reply_id, tool_call_id=cid, tool_name=name, data=part))
    events.append(ToolResultEnd(reply_id=reply_id, tool_call_id=cid, tool_name=name, state=block.state,
                                metadata=dict(metadata or {})))
    return events
