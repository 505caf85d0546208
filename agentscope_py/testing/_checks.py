"""The contract's checks over recorded events: brackets, ids and deltas at one boundary, and the
normal form two runs are compared in. Pure functions: the scenarios (`_scenario`) record, these
judge."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._bracket_kinds import CLOSES, IDS, OPENS
from ..events import (
    AgentResult,
    Custom,
    DataBlockDelta,
    ModelCallEnd,
    TextBlockDelta,
    ThinkingBlockDelta,
    ToolCallDelta,
    ToolCallStart,
    ToolResultDataDelta,
    ToolResultEnd,
    ToolResultTextDelta,
)
from ..message import Msg
from ._report import Violation

__all__ = ["Key", "check_boundary", "normal_events", "normal_memory", "normal_msg", "trace"]

Key = tuple[str, str | None, str]
"""A bracket: its kind, the event's ``source`` and its id."""

# A delta belongs inside the open block of this kind (the kinds of `_bracket_kinds.OPENS`).
_DELTAS: dict[type[Any], tuple[str, str]] = {
    TextBlockDelta: ("text", "block_id"), ThinkingBlockDelta: ("thinking", "block_id"),
    DataBlockDelta: ("data", "block_id"), ToolCallDelta: ("call", "tool_call_id"),
    ToolResultTextDelta: ("result", "tool_call_id"), ToolResultDataDelta: ("result", "tool_call_id"),
}


def _line(index: int, event: Any) -> str:
    fields = event.__dict__
    ident = next((fields[k] for k in ("block_id", "tool_call_id", "reply_id") if k in fields), "")
    extra = ""
    if "delta" in fields:
        extra = f" {fields['delta']!r}"[:40]
    elif isinstance(event, AgentResult):
        extra = f" {event.result.text!r}"[:40]
    elif isinstance(event, ModelCallEnd) and event.error:
        extra = f" error={event.error!r}"[:60]
    return f"{index:>4} {event.type} {ident}{extra}"


def trace(events: Sequence[Any], index: int, *, around: int = 3) -> tuple[str, ...]:
    """The events around ``index`` (all of them when ``index`` is -1 and they are few), one short
    line each, the one at ``index`` marked ``>``."""
    if index < 0:
        lo, hi = max(0, len(events) - 2 * around), len(events)
    else:
        lo, hi = max(0, index - around), min(len(events), index + around + 1)
    return tuple(("> " if i == index else "  ") + _line(i, events[i]) for i in range(lo, hi))


def check_boundary(
    events: Sequence[Any],
    seqs: Sequence[int],
    *,
    scenario: str,
    where: str,
    closed_inside: Mapping[Key, int] | None = None,
    complete: bool = True,
) -> list[Violation]:
    """The bracket, id and delta clauses for the events one boundary carried in one run.

    ``seqs``: each event's place in the run's interleaving of every boundary's events.
    ``closed_inside``: for the output of a middleware's layer, where its input carried each End
    (by bracket). A layer may end its stream with brackets open — the runtime closes them outside
    every layer (a guardrail that trips, a timeout) — but a bracket whose End the layer received
    and then went on emitting without is a dropped End. ``complete``: the stream ran to its end
    (the caller's stream must then be balanced; a consumer that stopped early gets nothing more)."""
    found: list[Violation] = []

    def flag(clause: str, index: int, message: str) -> None:
        found.append(Violation(clause, scenario, where, index, message, trace(events, index)))

    open_: dict[Key, int] = {}
    ids: dict[str, int] = {}
    # What an event inside a bracket must agree on with its Start: a replaced event keeps them.
    same = ("reply_id", "tool_name")
    for i, event in enumerate(events):
        cls = type(event)
        fields = event.__dict__
        first = ids.setdefault(fields["id"], i)
        if first != i:
            flag("unique_ids", i, f"event id {fields['id']!r} already used by event {first}")
        if cls in _DELTAS:
            kind, attr = _DELTAS[cls]
            start = open_.get((kind, fields["source"], fields[attr]))
            if start is None:
                flag("kind_invariants", i, f"{event.type} for {fields[attr]!r} outside an open {kind} block")
            else:
                _agree(flag, i, event, events[start], same)
            continue
        ident = IDS.get(cls)
        if ident is None:
            continue
        kind = OPENS.get(cls) or CLOSES[cls]
        key = (kind, fields["source"], fields[ident])
        if cls in OPENS:
            if key in open_:
                flag("balanced", i, f"{event.type} for {key[2]!r} while it is already open (event {open_[key]})")
            open_[key] = i
        elif key in open_:
            _agree(flag, i, event, events[open_.pop(key)], same)
        else:
            flag("balanced", i, f"{event.type} for {key[2]!r} without an open *Start")
    for key, start in open_.items():
        if closed_inside is None:
            if complete:
                flag("balanced", start, f"{events[start].type} for {key[2]!r} never gets its End")
            continue
        inside = closed_inside.get(key)
        went_on = next((i for i, seq in enumerate(seqs) if inside is not None and seq > inside and i > start), None)
        if went_on is not None:
            flag("balanced", went_on, f"the End of {events[start].type} {key[2]!r} (event {start}) came from inside "
                                      "and was dropped: the stream went on without it")
    return found


def _agree(flag: Any, index: int, event: Any, start: Any, names: Sequence[str]) -> None:
    for name in names:
        mine, theirs = event.__dict__.get(name), start.__dict__.get(name)
        if mine is not None and theirs is not None and mine != theirs:
            flag("kind_invariants", index, f"{event.type} has {name}={mine!r}, its Start {theirs!r}")
            return


def normal_events(events: Sequence[Any]) -> list[tuple[Any, ...]]:
    """What a caller observes, without ids, times and usage: two runs that behave the same have
    equal normal forms."""
    out: list[tuple[Any, ...]] = []
    for event in events:
        fields = event.__dict__
        if "delta" in fields:
            out.append((event.type, fields["delta"]))
        elif isinstance(event, ToolCallStart):
            out.append((event.type, event.tool_name))
        elif isinstance(event, ToolResultEnd):
            out.append((event.type, event.tool_name, event.state.value))
        elif isinstance(event, ModelCallEnd):
            out.append((event.type, event.error is not None))
        elif isinstance(event, AgentResult):
            out.append((event.type, *normal_msg(event.result)))
        elif isinstance(event, Custom):
            out.append((event.type, event.name))
        else:
            out.append((event.type,))
    return out


def normal_msg(msg: Msg | None) -> tuple[Any, ...]:
    """A final message without ids: its text, why it ended, the tools it calls."""
    if msg is None:
        return (None,)
    reason = msg.generate_reason.value if msg.generate_reason is not None else None
    return (msg.text, reason, tuple(c.name for c in msg.tool_calls))


def normal_memory(messages: Sequence[Msg]) -> list[tuple[Any, ...]]:
    """What a session remembers, without ids: each message's role, text, tool calls and results."""
    return [(m.role, m.text, tuple((c.name, repr(c.input)) for c in m.tool_calls),
             tuple((r.name, str(r.output), r.state.value) for r in m.tool_results)) for m in messages]
