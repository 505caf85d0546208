"""Render an agent's event stream in a terminal, as ``agentscope-py demo`` does.

>>> msg = await render(agent.stream("What is 2 + 3?"))              # to stdout, returns the result
>>> await render(agent.stream("hi"), file=log, json=True)           # one JSON event per line

Text streams inline, thinking dimmed, tool calls and their results as labelled lines, usage and
``Custom("timing")`` reports in grey, the final answer last. Colour is used only on a terminal
(and never with ``NO_COLOR`` set). `Renderer` is the same, one event at a time, for a loop of your
own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterable
from typing import Any, TextIO

from .events import (
    AgentEvent,
    AgentResult,
    AgentStart,
    AllToolsDenied,
    Custom,
    ExceedMaxIters,
    ModelCallEnd,
    ModelCallStart,
    RequireExternalExecution,
    RequireUserConfirm,
    TextBlockDelta,
    TextBlockEnd,
    TextBlockStart,
    ThinkingBlockDelta,
    ThinkingBlockEnd,
    ThinkingBlockStart,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolResultEnd,
    ToolResultStart,
    ToolResultTextDelta,
)
from .message import Msg, ToolResultState

__all__ = ["Renderer", "render"]


def _use_colour(file: TextIO) -> bool:
    isatty = getattr(file, "isatty", None)
    return bool(isatty and isatty()) and "NO_COLOR" not in os.environ


class Renderer:
    """Writes events to ``file`` as they arrive (``renderer.render(event)``, or call it).

    ``file``: a text stream (default: ``sys.stdout`` at construction). ``colour``: ANSI colours;
    default: only when ``file`` is a terminal and ``NO_COLOR`` is not set. Events forwarded from a
    sub-agent are rendered too; its start line names its ``source`` and its result (the tool
    result the caller sees anyway) is not repeated. ``result`` is the last top-level result seen.
    """

    def __init__(self, file: TextIO | None = None, *, colour: bool | None = None) -> None:
        self.out: TextIO = file if file is not None else sys.stdout
        self.colour = _use_colour(self.out) if colour is None else colour
        self.result: Msg | None = None
        self._args: dict[str, list[str]] = {}
        self._at_line_start = True

    def __call__(self, event: AgentEvent) -> None:
        self.render(event)

    def _c(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.colour else text

    def _line(self, text: str) -> None:
        if not self._at_line_start:
            self.out.write("\n")
        self.out.write(text + "\n")
        self._at_line_start = True

    def _inline(self, text: str) -> None:
        self.out.write(text)
        self._at_line_start = text.endswith("\n")

    def render(self, event: AgentEvent) -> None:
        """Write one event (events with nothing to show write nothing)."""
        ev: Any = event
        match ev:
            case AgentStart():
                source = f"  via {ev.source}" if ev.source else ""
                self._line(self._c("1;35", f"● {ev.name}") + self._c("90", f"  session {ev.session_id}{source}"))
            case ModelCallStart():
                self._line(self._c("90", f"┌ model {ev.model}"))
            case ThinkingBlockStart():
                self._inline(self._c("2;3", "  thinking: "))
            case ThinkingBlockDelta():
                self._inline(self._c("2;3", ev.delta))
            case TextBlockStart():
                self._inline("  ")
            case TextBlockDelta():
                self._inline(ev.delta.replace("\n", "\n  "))
            case TextBlockEnd() | ThinkingBlockEnd():
                self._inline("" if self._at_line_start else "\n")
            case ToolCallStart():
                self._args[ev.tool_call_id] = []
            case ToolCallDelta():
                self._args.setdefault(ev.tool_call_id, []).append(ev.delta)
            case ToolCallEnd():
                args = "".join(self._args.pop(ev.tool_call_id, []))
                self._line(self._c("36", f"  ⚙ {ev.tool_name}({args})"))
            case ModelCallEnd():
                u = ev.usage
                used = f"{u.input_tokens} in / {u.output_tokens} out" if u else "usage unknown"
                self._line(self._c("90", f"└ {ev.finish_reason or 'done'} · {used}"))
            case ToolResultStart():
                self._inline(self._c("32", f"  ↳ {ev.tool_name}: "))
            case ToolResultTextDelta():
                self._inline(self._c("32", ev.delta))
            case ToolResultEnd():
                failed = ev.state is not ToolResultState.SUCCESS
                self._inline((self._c("31", f" [{ev.state.value}]") if failed else "") + "\n")
            case RequireUserConfirm():
                self._line(self._c("33", f"  ? waiting for confirmation: {_names(ev.tool_calls)}"))
            case RequireExternalExecution():
                self._line(self._c("33", f"  ⇢ to be run by the caller: {_names(ev.tool_calls)}"))
            case AllToolsDenied():
                self._line(self._c("31", f"  ✗ all tool calls denied: {_names(ev.denied_tool_calls)}"))
            case Custom(name="timing"):
                v = ev.value
                self._line(self._c("90", f"  ⏱ {v['kind']} {v['label']}: {v['ms']} ms"))
            case ExceedMaxIters():
                self._line(self._c("33", f"  max iterations ({ev.max_iters}) reached"))
            case AgentResult() if ev.source is None:
                msg: Msg = ev.result
                self.result = msg
                reason = msg.generate_reason.value if msg.generate_reason else "?"
                u = msg.usage
                total = f" · {u.input_tokens} in / {u.output_tokens} out" if u else ""
                self._line(self._c("1", "Final answer: ") + msg.text)
                self._line(self._c("90", f"({reason}{total})"))
            case _:
                pass
        self.out.flush()


def _names(calls: Any) -> str:
    return ", ".join(c.name for c in calls)


async def render(
    stream: AsyncIterable[AgentEvent],
    *,
    file: TextIO | None = None,
    json: bool = False,
    colour: bool | None = None,
) -> Msg | None:
    """Iterate ``stream`` (e.g. ``agent.stream(...)``), write each event to ``file`` (default
    ``sys.stdout``), and return the run's final message (its top-level `AgentResult`), or None if
    the stream carried none. ``json=True`` writes one event per line as JSON (``parse_event``
    reads it back) instead of the terminal rendering. An error of the stream propagates."""
    out = file if file is not None else sys.stdout
    if json:
        result: Msg | None = None
        async for ev in stream:
            out.write(ev.model_dump_json() + "\n")
            if type(ev) is AgentResult and ev.source is None:
                result = ev.result
        out.flush()
        return result
    renderer = Renderer(out, colour=colour)
    async for ev in stream:
        renderer.render(ev)
    return renderer.result
