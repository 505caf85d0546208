"""The steps of a run as the loop drives them (`_loop.Execution._run`): one `Step` per prelude,
reasoning round, acting pass or summary, each with its stream and what reads its events."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..events import AgentEvent, RequestStop
from ..message import Msg, ToolResultBlock, ToolResultState, ToolUseBlock
from ..middleware.base import ExtensionPoint
from ..stream import EventStream
from ._brackets import BRACKET_TYPES, OPENS
from ._reply import ToolResultCollector

__all__ = ["ACT", "DROPPED_TEXT", "END", "MARKS", "PRELUDE", "REASON", "START", "STOP", "SUMMARY", "Acting", "Step",
           "result_block"]

PRELUDE, REASON, ACT, SUMMARY = range(4)

START, END, STOP = "start", "end", "stop"
MARKS: dict[type[Any], str] = {cls: (START if cls in OPENS else END) for cls in BRACKET_TYPES}
MARKS[RequestStop] = STOP
"""The event classes the loop looks at itself: the brackets of `_brackets`, and a stop."""



class Acting:
    """What one acting pass produced, read from the events leaving the acting chain."""

    __slots__ = ("asking", "assistant", "calls", "collector", "stop", "suspended")

    def __init__(self, calls: Sequence[ToolUseBlock], assistant: Msg) -> None:
        self.calls = calls
        self.assistant = assistant
        self.collector = ToolResultCollector()
        self.stop: RequestStop | None = None
        self.suspended: list[ToolUseBlock] = []
        self.asking: list[ToolUseBlock] = []

    def add(self, ev: Any) -> None:
        if ev.source is not None:
            return  # a sub-agent's event, forwarded: not this agent's results or stop
        t = ev.type
        if t.startswith("tool_result"):
            self.collector.add(ev)
        elif t == "request_stop":
            self.stop = ev
        elif t == "require_external_execution":
            self.suspended.extend(ev.tool_calls)
        elif t == "require_user_confirm":
            self.asking.extend(ev.tool_calls)

    def waiting(self) -> set[str]:
        """The calls that wait, rightly, for a confirmation or an external result."""
        return {c.id for c in (*self.suspended, *self.asking)}


class Step:
    """One step of a run as the loop drives it: its stream, what to call with each of its events
    (a reply builder, an acting collector, or a check), the extension point its events leave
    (named in errors), and for acting the pass it belongs to."""

    __slots__ = ("acting", "kind", "on_event", "point", "stream")

    def __init__(
        self, kind: int, stream: EventStream[AgentEvent], on_event: Callable[[Any], None], point: ExtensionPoint,
        acting: Acting | None = None,
    ) -> None:
        self.kind = kind
        self.stream = stream
        self.on_event = on_event
        self.point = point
        self.acting = acting


DROPPED_TEXT = "Error: the tool call produced no result (an on_acting middleware dropped its events)."


def result_block(call: ToolUseBlock, text: str, state: ToolResultState) -> ToolResultBlock:
    return ToolResultBlock(id=call.id, name=call.name, state=state, output=text)


