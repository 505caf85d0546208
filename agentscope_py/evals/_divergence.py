"""`first_divergence`: replay a recorded run against today's agent and name the first event that
differs — its index, type, field, and the recorded and current values — so a changed prompt,
tool or middleware shows where it changed behaviour.

Events are compared without what differs on every run: ids (``id`` and every ``*_id`` field,
the messages' too), ``created_at`` and ``duration_ms``; pass ``ignore`` for more field names.
What today's agent runs on is its own model: give it ``recorded.scripted_model()`` to replay the
recorded replies (only your code can diverge then), a `ReplayModel` of the run's cassette, or a
live model."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._jsondiff import first_difference
from ..events import AgentEvent
from ._recorded import RecordedRun, collect_run

if TYPE_CHECKING:
    from ..agent.react import ReActAgent

__all__ = ["DEFAULT_IGNORED", "Divergence", "compare_events", "first_divergence"]

DEFAULT_IGNORED = frozenset({"id", "created_at", "duration_ms"})
_END = "<end of stream>"


@dataclass(frozen=True)
class Divergence:
    """The first difference: event ``index``, the recorded event's ``type`` (or the current one's
    when the recording ended first), the ``field`` path, the ``recorded`` and ``now`` values (an
    event type when one stream ended first) and both events (None past a stream's end). ``error``
    is what today's run raised, when it did."""

    index: int
    type: str
    field: str
    recorded: Any
    now: Any
    recorded_event: AgentEvent | None = None
    now_event: AgentEvent | None = None
    error: str | None = None

    def describe(self) -> str:
        text = (f"event {self.index} ({self.type}): {self.field}: recorded {_short(self.recorded)}, "
                f"now {_short(self.now)}")
        return f"{text} (today's run raised {self.error})" if self.error else text

    def __str__(self) -> str:
        return self.describe()


def _short(value: Any, limit: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _plain(value: Any, ignore: Collection[str]) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v, ignore) for k, v in value.items() if k not in ignore and not k.endswith("_id")}
    if isinstance(value, list):
        return [_plain(v, ignore) for v in value]
    return value


def compare_events(recorded: Sequence[AgentEvent], now: Sequence[AgentEvent], *,
                   ignore: Collection[str] = ()) -> Divergence | None:
    """The first `Divergence` between two event sequences, or None when they agree."""
    ignored = DEFAULT_IGNORED | set(ignore)
    for index in range(max(len(recorded), len(now))):
        was = recorded[index] if index < len(recorded) else None
        is_ = now[index] if index < len(now) else None
        if was is None or is_ is None:
            present = was if was is not None else is_
            return Divergence(index, present.type if present is not None else _END, "(stream length)",
                              was.type if was else _END, is_.type if is_ else _END, was, is_)
        if was.type != is_.type:
            return Divergence(index, was.type, "type", was.type, is_.type, was, is_)
        found = first_difference(_plain(was.model_dump(mode="json"), ignored),
                                 _plain(is_.model_dump(mode="json"), ignored))
        if found is not None:
            where, before, after = found
            return Divergence(index, was.type, where, before, after, was, is_)
    return None


async def first_divergence(recorded: RecordedRun | str | Path,
                           agent: ReActAgent | Callable[[], Any], *,
                           ignore: Collection[str] = ()) -> Divergence | None:
    """Run ``agent`` (or ``agent()``, a factory, maybe async) on the recorded run's input in a
    fresh session and return the first `Divergence` from the recorded events, or None when
    the run agrees with the recording event for event. A run that raises diverges where its
    events stop; the error is in ``Divergence.error``."""
    from ..agent.react import ReActAgent

    run = RecordedRun.of(recorded)
    today: Any = agent if isinstance(agent, ReActAgent) else agent()
    if inspect.isawaitable(today):
        today = await today
    events, error = await collect_run(today, run.input)
    found = compare_events(run.events, events, ignore=ignore)
    if found is not None and error is not None:
        found = Divergence(found.index, found.type, found.field, found.recorded, found.now, found.recorded_event,
                           found.now_event, f"{type(error).__name__}: {error}")
    elif found is None and error is not None:
        found = Divergence(len(events), _END, "(error)", _END, f"{type(error).__name__}: {error}",
                           error=f"{type(error).__name__}: {error}")
    return found
