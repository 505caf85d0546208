"""The brackets one middleware layer let out, so it can close them itself when it ends a model
call early (a guardrail that trips mid-stream): the caller's stream stays balanced and the
``ModelCallEnd`` says why."""

from __future__ import annotations

from typing import Any

from ..events import (
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
)

__all__ = ["OpenBrackets"]

_STARTS = (ModelCallStart, TextBlockStart, ThinkingBlockStart, DataBlockStart, ToolCallStart)
_END_OF: dict[type[Any], type[Any]] = {
    ModelCallEnd: ModelCallStart, TextBlockEnd: TextBlockStart, ThinkingBlockEnd: ThinkingBlockStart,
    DataBlockEnd: DataBlockStart, ToolCallEnd: ToolCallStart}
_BLOCK_ENDS: dict[type[Any], type[Any]] = {TextBlockStart: TextBlockEnd, ThinkingBlockStart: ThinkingBlockEnd,
                                           DataBlockStart: DataBlockEnd}


def _key(ev: Any) -> tuple[type[Any], str]:
    cls = type(ev)
    start = cls if cls in _STARTS else _END_OF[cls]
    if start is ModelCallStart:
        return start, ev.reply_id
    if start is ToolCallStart:
        return start, ev.tool_call_id
    return start, ev.block_id


class OpenBrackets:
    """Starts seen (top-level events only) without their End, in order."""

    __slots__ = ("open", "reply_id")

    def __init__(self) -> None:
        self.open: dict[tuple[type[Any], str], Any] = {}
        self.reply_id: str | None = None

    def see(self, ev: Any) -> None:
        cls = type(ev)
        if ev.__dict__.get("source") is not None:
            return
        if cls in _STARTS:
            self.open[_key(ev)] = ev
            if cls is ModelCallStart:
                self.reply_id = ev.reply_id
        elif cls in _END_OF:
            self.open.pop(_key(ev), None)

    def close(self, why: str, *, discarded: bool) -> list[Any]:
        """The Ends of what is open, innermost first (the model call's says ``why``)."""
        out: list[Any] = []
        for start in reversed(list(self.open.values())):
            cls = type(start)
            if cls is ModelCallStart:
                out.append(ModelCallEnd(reply_id=start.reply_id, error=why, discarded=discarded))
            elif cls is ToolCallStart:
                out.append(ToolCallEnd(reply_id=start.reply_id, tool_call_id=start.tool_call_id,
                                       tool_name=start.tool_name))
            else:
                out.append(_BLOCK_ENDS[cls](reply_id=start.reply_id, block_id=start.block_id))
        self.open.clear()
        return out
