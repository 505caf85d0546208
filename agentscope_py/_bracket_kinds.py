"""The bracket events (every `*Start` and its `*End`) as tables, and the End that closes a Start:
what the loop's closing guarantee (`agent._brackets`) and a middleware that ends a model call
early (`middleware._brackets_local`) both need, below both."""

from __future__ import annotations

from typing import Any

from .events import (
    AgentEvent,
    DataBlockEnd,
    DataBlockStart,
    ModelCallEnd,
    ModelCallStart,
    TextBlockEnd,
    TextBlockStart,
    ThinkingBlockEnd,
    ThinkingBlockStart,
    ToolCallEnd,
    ToolCallStart,
    ToolResultEnd,
    ToolResultStart,
)
from .message import ToolResultState

__all__ = ["BRACKET_TYPES", "CLOSES", "IDS", "OPENS", "close_event", "describe"]

OPENS: dict[type[Any], str] = {
    ModelCallStart: "model", TextBlockStart: "text", ThinkingBlockStart: "thinking",
    DataBlockStart: "data", ToolCallStart: "call", ToolResultStart: "result",
}
CLOSES: dict[type[Any], str] = {
    ModelCallEnd: "model", TextBlockEnd: "text", ThinkingBlockEnd: "thinking",
    DataBlockEnd: "data", ToolCallEnd: "call", ToolResultEnd: "result",
}
BRACKET_TYPES = frozenset(OPENS) | frozenset(CLOSES)
"""The event classes the loop logs for `Brackets` (it tests the class inline: most events are
deltas, which cost nothing more)."""


def describe(error: BaseException) -> str:
    """``"Type: message"``, the form of ``ModelCallEnd.error`` and ``MiddlewareCompleted.error``."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


IDS: dict[type[Any], str] = {cls: "reply_id" for cls in (ModelCallStart, ModelCallEnd)}
IDS.update({cls: "tool_call_id" for cls in (ToolCallStart, ToolCallEnd, ToolResultStart, ToolResultEnd)})
IDS.update({cls: "block_id" for cls in (TextBlockStart, TextBlockEnd, ThinkingBlockStart, ThinkingBlockEnd,
                                         DataBlockStart, DataBlockEnd)})


def close_event(start: Any, why: str, discarded: bool, failed: bool) -> AgentEvent:
    """The End that closes ``start``."""
    source = start.source
    cls = type(start)
    if cls is ModelCallStart:
        return ModelCallEnd(reply_id=start.reply_id, error=why, discarded=discarded, source=source)
    if cls is ToolResultStart:
        state = ToolResultState.ERROR if failed else ToolResultState.INTERRUPTED
        return ToolResultEnd(reply_id=start.reply_id, tool_call_id=start.tool_call_id, tool_name=start.tool_name,
                             state=state, source=source)
    if cls is ToolCallStart:
        return ToolCallEnd(reply_id=start.reply_id, tool_call_id=start.tool_call_id, tool_name=start.tool_name,
                           source=source)
    end_cls: Any = _BLOCK_ENDS[cls]
    return end_cls(reply_id=start.reply_id, block_id=start.block_id, source=source)  # type: ignore[no-any-return]


_BLOCK_ENDS: dict[type[Any], type[Any]] = {
    TextBlockStart: TextBlockEnd, ThinkingBlockStart: ThinkingBlockEnd, DataBlockStart: DataBlockEnd,
}
