"""The closing guarantee: every Start the caller's stream carries gets exactly one matching End.

Traced middleware is guaranteed balanced MiddlewareStarted/Completed; this does the same for the content
brackets (text, thinking and data blocks, tool calls, tool results, model calls). Two places
keep it:

* The model call closes its own open blocks and emits ``ModelCallEnd(error=…)`` when the provider
  fails mid-stream (`_model_call.model_events`), before the error travels outward, so a middleware
  that retries or falls back by calling ``next`` again starts the next attempt on a balanced
  stream.
* `Brackets` watches the events the loop publishes. When a step's stream ends (completes, fails,
  or is interrupted) with brackets still open — a layer stopped reading (``take_while``), a
  timeout closed the model call — it emits the missing Ends, innermost first. A ModelCallStart
  that arrives while an earlier attempt of the same source is still open closes that attempt
  first (``discarded=True``): a middleware abandoned it for a new one.

Closing events are made here, outside every on_reasoning/on_acting layer, so what a layer
dropped is closed anyway; they carry the source of the Start they close (a sub-agent's brackets
are closed as the sub-agent's). A sub-agent's run forwarded into its caller's stream is a
bracket here too (its `AgentStart` and `AgentEnd`, `RUN_BRACKETS`): a sub-agent cancelled
mid-run (a deadline, its caller's step failing) publishes no AgentEnd of its own, and its
caller's stream goes on, so the AgentEnd naming how it ended is made here with the other Ends.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .._bracket_kinds import BRACKET_TYPES, IDS, OPENS, close_event, describe
from ..errors import AgentInterrupted
from ..events import AgentEnd, AgentEvent, AgentStart

__all__ = ["BRACKET_TYPES", "CUT_SHORT", "OPENS", "RUN_BRACKETS", "Brackets", "describe"]

CUT_SHORT = "cut short: the stream ended before the model call did"
SUPERSEDED = "abandoned: a new attempt of the model call started"


_NOTHING: list[AgentEvent] = []  # (never appended to)

RUN_BRACKETS = frozenset({AgentStart, AgentEnd})
"""A sub-agent's run, as its caller's stream carries it (the run's own AgentStart never passes
through its own loop's steps: only a forwarded one is logged)."""

# Each bracket's key: its kind and its id (a sub-agent's AgentStart shares its reply id with its
# model calls).
_KEYS: dict[type[Any], tuple[str, str]] = {cls: ("", ident) for cls, ident in IDS.items()}
_KEYS.update({cls: ("run", "reply_id") for cls in RUN_BRACKETS})
_OPENS = frozenset(OPENS) | {AgentStart}


def _close(start: Any, why: str, discarded: bool, failed: bool) -> AgentEvent:
    if type(start) is AgentStart:
        return AgentEnd(reply_id=start.reply_id, error=why, source=start.source)
    return close_event(start, why, discarded, failed)


class Brackets:
    """The bracket events one step published, kept in order (`log`, appended to by the loop
    itself: a list append per bracket event, nothing per delta); what is still open is worked
    out only when the step ends or a model call starts. Brackets are keyed by their id (block id,
    tool call id, or the reply id for a model call): ids are unique per kind, and a tool call's
    result reuses its id only after the call's End."""

    __slots__ = ("early", "log")

    def __init__(self, log: list[Any] | None = None) -> None:
        # ``log``: a list the caller appends to itself (the loop's, which makes this object only
        # when a step's brackets must be worked out).
        self.log: list[Any] = [] if log is None else log
        self.early: list[AgentEvent] = _NOTHING  # what `superseding` said must be emitted first

    def _opened(self) -> dict[tuple[str, str], Any]:
        opened: dict[tuple[str, str], Any] = {}
        for ev in self.log:
            cls = type(ev)
            space, ident = _KEYS[cls]
            key = (space, ev.__dict__[ident])  # (pydantic's __getattr__ makes attribute reads slow)
            if cls in _OPENS:
                opened[key] = ev
            else:
                opened.pop(key, None)
        return opened

    def superseding(self, start: Any) -> bool:
        """True when ``start`` begins a model call whose id (the reply) is still open: a middleware
        abandoned that attempt for a new one. ``early`` then holds the Ends of the abandoned attempt
        (and of everything of its source opened after it), to emit before ``start``."""
        if not self.log:
            return False
        opened = self._opened()
        key = ("", start.reply_id)
        if key not in opened or opened[key].source != start.source:
            return False
        keys = list(opened)
        later = [k for k in keys[keys.index(key):] if opened[k].source == start.source]
        self.early = [_close(opened[k], SUPERSEDED, True, True) for k in reversed(later)]
        self.log.extend(self.early)
        return True

    def close(self, error: BaseException | None, starts: int) -> list[AgentEvent]:
        """The Ends of everything still open, innermost first: the step that opened them ended
        (``error``: how; None when it completed although a layer had stopped reading). ``starts``:
        how many of the logged events are Starts (the loop counts them: when they are half the log,
        every Start met its End and there is nothing to work out)."""
        log = self.log
        if starts * 2 == len(log):
            log.clear()
            return _NOTHING
        opened = self._opened()
        log.clear()
        if not opened:
            return _NOTHING
        if error is None:
            why, discarded = CUT_SHORT, False
        else:
            # An interrupt keeps the partial reply (it is remembered as INTERRUPTED); an error that
            # ends the run does not.
            why, discarded = describe(error), not isinstance(error, AgentInterrupted)
        failed = error is not None and not isinstance(error, asyncio.CancelledError | AgentInterrupted)
        return [_close(start, why, discarded, failed) for start in reversed(opened.values())]
