"""The bracket events (every `*Start` and its `*End`) as tables, the End that closes a Start, and
`OpenBrackets`, what a stream opened and has not closed yet: what the loop's closing guarantee
(`agent._brackets`), a middleware that ends a stream early (a guardrail that trips) and a server
log that outlives a cancelled run all need, below them all."""

from __future__ import annotations

from collections.abc import Callable
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

__all__ = ["BRACKET_TYPES", "CLOSES", "IDS", "OPENS", "OpenBrackets", "close_event", "describe"]

OPENS: dict[type[Any], str] = {
    ModelCallStart: "model", TextBlockStart: "text", ThinkingBlockStart: "thinking",
    DataBlockStart: "data", ToolCallStart: "call", ToolResultStart: "result",
}
CLOSES: dict[type[Any], str] = {
    ModelCallEnd: "model", TextBlockEnd: "text", ThinkingBlockEnd: "thinking",
    DataBlockEnd: "data", ToolCallEnd: "call", ToolResultEnd: "result",
}
BRACKET_TYPES = frozenset(OPENS) | frozenset(CLOSES)
"""The event classes the loop logs for `Brackets`."""


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
    end_cls: Callable[..., AgentEvent] = _BLOCK_ENDS[cls]
    return end_cls(reply_id=start.reply_id, block_id=start.block_id, source=source)


_BLOCK_ENDS: dict[type[Any], type[Any]] = {
    TextBlockStart: TextBlockEnd, ThinkingBlockStart: ThinkingBlockEnd, DataBlockStart: DataBlockEnd,
}


class OpenBrackets:
    """The Starts a stream carried without their End yet, in order: what a layer that ends the
    stream itself must close. Keyed by kind, source and id (a sub-agent's ids are its own);
    ``top_only``: a sub-agent's brackets are left to the sub-agent. ``reply_id``: the last
    top-level model call's."""

    __slots__ = ("open", "reply_id", "top_only")

    def __init__(self, *, top_only: bool = False) -> None:
        self.open: dict[tuple[str, str | None, str], Any] = {}
        self.reply_id: str | None = None
        self.top_only = top_only

    def see(self, event: Any) -> None:
        cls = type(event)
        ident = IDS.get(cls)
        if ident is None:
            return
        fields = event.__dict__  # (pydantic's __getattr__ makes attribute reads slow)
        source = fields["source"]
        if source is not None and self.top_only:
            return
        start = OPENS.get(cls)
        key = (start or CLOSES[cls], source, fields[ident])
        if start is None:
            self.open.pop(key, None)
            return
        self.open[key] = event
        if cls is ModelCallStart and source is None:
            self.reply_id = fields["reply_id"]

    def close(self, why: str, *, discarded: bool, failed: bool) -> list[AgentEvent]:
        """The Ends of what is open, innermost first: the model call's says ``why`` (and whether
        its partial reply is ``discarded``), a tool result ends ``error`` when ``failed``, else
        ``interrupted``."""
        ends = [close_event(start, why, discarded, failed) for start in reversed(self.open.values())]
        self.open.clear()
        return ends
