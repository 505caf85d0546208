"""Judging what runs leave behind: two runs that must behave the same (`differences`), and a model
call made outside the chain that shows in the caller's stream (`leaks`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..events import ModelCallEnd, ModelCallStart, TextBlockDelta, ThinkingBlockDelta
from ..message import ChatUsage
from ._checks import normal_events, normal_msg, trace
from ._report import Violation
from ._scenario import Leg

__all__ = ["differences", "leaks"]


def differences(first: Sequence[Leg], other: Sequence[Leg], name: str, clause: str) -> list[Violation]:
    """Where ``other``'s executions differ from ``first``'s: how each ended, its final message,
    what the session remembers, the caller's events (normalised)."""
    found: list[Violation] = []
    for number, (a, b) in enumerate(zip(first, other, strict=False)):
        scenario = name if number == 0 else f"{name}/resume{number}"
        if type(a.error) is not type(b.error):
            found.append(Violation(clause, scenario, "caller", -1,
                                   f"ends with {_err(b.error)}, the stream run with {_err(a.error)}"))
            continue
        if normal_msg(a.result) != normal_msg(b.result):
            found.append(Violation(clause, scenario, "caller", -1,
                                   f"final message {normal_msg(b.result)}, the stream run's {normal_msg(a.result)}"))
        at = _first_difference(a.memory, b.memory)
        if at is not None:
            found.append(Violation(clause, scenario, "session", -1,
                                   f"the session remembers message {at} as {_at(b.memory, at)}, the stream run as "
                                   f"{_at(a.memory, at)}"))
        left, right = normal_events(a.log.caller.events), normal_events(b.log.caller.events)
        at = _first_difference(left, right)
        if at is not None:
            found.append(Violation(clause, scenario, "caller", at,
                                   f"event {at} is {_at(right, at)}, in the stream run {_at(left, at)}",
                                   trace(b.log.caller.events, at)))
    if len(first) != len(other):
        found.append(Violation(clause, name, "caller", -1,
                               f"{len(other)} execution(s), the stream run {len(first)} (a HITL pause differs)"))
    return found


def leaks(scenario: str, leg: Leg, chain_texts: Sequence[str], internal_texts: Sequence[str]) -> list[Violation]:
    """When the middleware called the agent's model outside the chain (``internal_texts``: those
    replies), that call shows in the caller's stream nowhere: no more model calls and no more
    tokens than the chain made, and no reply text only such a call gave."""
    if not internal_texts:
        return []  # no model call outside the chain (a cache's replayed reply is no model call)
    found: list[Violation] = []
    log = leg.log
    events = log.caller.events
    started = [i for i, e in enumerate(events) if isinstance(e, ModelCallStart) and e.source is None]
    if len(started) > log.chain_calls:
        at = started[log.chain_calls]
        found.append(Violation("no_leak", scenario, "caller", at,
                               f"{len(started)} model calls in the caller's stream, {log.chain_calls} made through "
                               "the agent's chain", trace(events, at)))
    spoken = "".join(e.delta for e in events if isinstance(e, TextBlockDelta | ThinkingBlockDelta))
    ours = set(chain_texts)
    for text in internal_texts:
        if len(text) >= 8 and text not in ours and text in spoken:
            found.append(Violation("no_leak", scenario, "caller", -1,
                                   f"the reply of a model call made outside the chain reached the caller: {text!r}"))
    counted = ChatUsage()
    for e in events:
        if isinstance(e, ModelCallEnd) and e.source is None and e.usage is not None:
            counted = counted + e.usage
    made = log.chain_usage
    if counted.input_tokens > made.input_tokens or counted.output_tokens > made.output_tokens:
        found.append(Violation("no_leak", scenario, "caller", -1,
                               f"the caller's model calls report {counted.input_tokens}+{counted.output_tokens} "
                               f"tokens, the chain's calls used {made.input_tokens}+{made.output_tokens}"))
    return found


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _at(items: Sequence[Any], index: int) -> Any:
    return items[index] if index < len(items) else "missing"


def _err(error: BaseException | None) -> str:
    return "no error" if error is None else type(error).__name__
