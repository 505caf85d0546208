"""The closing guarantee: every Start the caller's stream carries gets exactly one matching End.

Seed 000 guarantees balanced MiddlewareStarted/Completed; this does the same for the content
brackets (text, thinking and data blocks, tool calls, tool results, model calls). Two places
keep it:

* The model call closes its own open blocks and emits ``ModelCallEnd(error=…)`` when the provider
  fails mid-stream (`_reply.model_events`), before the error travels outward, so a middleware
  that retries or falls back by calling ``next`` again starts the next attempt on a balanced
  stream.
* `Brackets` watches the events the loop publishes. When a step's stream ends (completes, fails,
  or is interrupted) with brackets still open — a layer stopped reading (``take_while``), a
  timeout closed the model call — it emits the missing Ends, innermost first. A ModelCallStart
  that arrives while an earlier attempt of the same source is still open closes that attempt
  first (``discarded=True``): a middleware abandoned it for a new one.

Closing events are made here, outside every on_reasoning/on_acting layer, so what a layer
dropped is closed anyway; they carry the source of the Start they close (a sub-agent's brackets
are closed as the sub-agent's).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..errors import AgentInterrupted
from ..events import (
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
from ..message import ToolResultState

__all__ = ["BRACKET_TYPES", "CUT_SHORT", "Brackets", "describe"]

_OPENS: dict[type[Any], str] = {
    ModelCallStart: "model", TextBlockStart: "text", ThinkingBlockStart: "thinking",
    DataBlockStart: "data", ToolCallStart: "call", ToolResultStart: "result",
}
_CLOSES: dict[type[Any], str] = {
    ModelCallEnd: "model", TextBlockEnd: "text", ThinkingBlockEnd: "thinking",
    DataBlockEnd: "data", ToolCallEnd: "call", ToolResultEnd: "result",
}
BRACKET_TYPES = frozenset(_OPENS) | frozenset(_CLOSES)
"""The event classes `Brackets.see` cares about (the loop tests membership inline: most events
are deltas, which need no call)."""

CUT_SHORT = "cut short: the stream ended before the model call did"
SUPERSEDED = "abandoned: a new attempt of the model call started"


def describe(error: BaseException) -> str:
    """``"Type: message"``, the form of ``ModelCallEnd.error`` and ``MiddlewareCompleted.error``."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


_IDS: dict[type[Any], str] = {cls: "reply_id" for cls in (ModelCallStart, ModelCallEnd)}
_IDS.update({cls: "tool_call_id" for cls in (ToolCallStart, ToolCallEnd, ToolResultStart, ToolResultEnd)})
_IDS.update({cls: "block_id" for cls in (TextBlockStart, TextBlockEnd, ThinkingBlockStart, ThinkingBlockEnd,
                                         DataBlockStart, DataBlockEnd)})
_NOTHING: list[AgentEvent] = []  # what `see` returns almost always (never appended to)


class Brackets:
    """The brackets the published stream has opened and not yet closed, in opening order."""

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open: dict[tuple[str, str | None, str], Any] = {}

    def see(self, ev: Any) -> list[AgentEvent]:
        """Note ``ev`` (one of `BRACKET_TYPES`); returns what must be emitted before it."""
        cls = type(ev)
        fields = ev.__dict__  # (pydantic's __getattr__ makes attribute reads slow)
        kind = _OPENS.get(cls)
        if kind is None:
            self._open.pop((_CLOSES[cls], fields["source"], fields[_IDS[cls]]), None)
            return _NOTHING
        key = (kind, fields["source"], fields[_IDS[cls]])
        if kind == "model" and key in self._open:
            early = self._close_from(key, SUPERSEDED, discarded=True)
            self._open[key] = ev
            return early
        self._open[key] = ev
        return _NOTHING

    def close(self, error: BaseException | None) -> list[AgentEvent]:
        """The Ends of everything still open, innermost first: the step that opened them ended
        (``error``: how; None when it completed although a layer had stopped reading)."""
        if not self._open:
            return []
        if error is None:
            why, discarded = CUT_SHORT, False
        else:
            # An interrupt keeps the partial reply (it is remembered as INTERRUPTED); an error that
            # ends the run does not.
            why, discarded = describe(error), not isinstance(error, AgentInterrupted)
        failed = error is not None and not isinstance(error, asyncio.CancelledError)
        out = [_end(start, why, discarded, failed) for start in reversed(self._open.values())]
        self._open.clear()
        return out

    def _close_from(self, key: tuple[str, str | None, str], why: str, *, discarded: bool) -> list[AgentEvent]:
        """Close the bracket ``key`` and everything of its source opened after it."""
        keys = list(self._open)
        later = [k for k in keys[keys.index(key):] if k[1] == key[1]]
        out = [_end(self._open.pop(k), why, discarded, True) for k in reversed(later)]
        return out


def _end(start: Any, why: str, discarded: bool, failed: bool) -> AgentEvent:
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
