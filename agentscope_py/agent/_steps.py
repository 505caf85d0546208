"""The steps of a run as the loop drives them (`_loop.Execution.events`): one `Step` per prelude,
reasoning round, acting pass or summary, each with its stream and what reads its events; and
what a completed step leads to, as a typed value (`NextStep`)."""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from .._replies import ToolResultCollector
from .._trusted import shape
from ..errors import AgentInterrupted
from ..events import AgentEvent, AgentStart, RequestStop
from ..extension.base import ExtensionPoint
from ..message import GenerateReason, Msg, ToolResultBlock, ToolResultState, ToolUseBlock
from ._brackets import BRACKET_TYPES, OPENS, RUN_BRACKETS, describe
from ._run_state import RunState

__all__ = ["ACT", "DROPPED_TEXT", "END", "MARKS", "PRELUDE", "REASON", "RUN_AGAIN", "START", "STOP", "SUMMARY",
           "NextStep", "NextStepAct", "NextStepFinalOutput", "NextStepRunAgain", "Step", "result_block"]

PRELUDE, REASON, ACT, SUMMARY = range(4)

START, END, STOP = "start", "end", "stop"
MARKS: dict[type[Any], str] = {cls: (START if cls in OPENS else END) for cls in BRACKET_TYPES}
MARKS.update({cls: (START if cls is AgentStart else END) for cls in RUN_BRACKETS})
MARKS[RequestStop] = STOP
"""The event classes the loop looks at itself: the brackets of `_brackets` (a sub-agent's run
among them), and a stop."""


@dataclass(frozen=True, slots=True)
class NextStepRunAgain:
    """Another round is due: reasoning, or the summary once the iterations are used up."""


@dataclass(frozen=True, slots=True)
class NextStepFinalOutput:
    """The run has its final message (an answer, a stop, a pause for confirmation or external
    results, the summary)."""

    msg: Msg


_TOOL_MSG = shape(Msg, "role", "content")  # (``Msg.tool(results)``)


class NextStepAct:
    """The reply's tool calls are remembered and due to run: ``calls``, and ``assistant``, the reply
    as the caller saw it (the result of a run that ends in this pass). The acting pass over them
    gathers here what it produced, read from the events leaving the acting chain (`add`)."""

    __slots__ = ("asking", "assistant", "calls", "collector", "paused", "stop", "suspended")

    def __init__(self, calls: Sequence[ToolUseBlock], assistant: Msg) -> None:
        self.calls = calls
        self.assistant = assistant
        self.collector = ToolResultCollector()
        self.stop: RequestStop | None = None
        self.suspended: list[ToolUseBlock] = []
        self.asking: list[ToolUseBlock] = []
        self.paused: list[str] | None = None
        """Sub-agent calls paused for a confirmation (a ``running`` end): pending, no result."""

    def add(self, ev: Any) -> None:
        if ev.source is not None:
            return  # a sub-agent's event, forwarded: not this agent's results or stop
        t = ev.type
        if t.startswith("tool_result"):
            if t == "tool_result_end" and ev.state is ToolResultState.RUNNING:
                if self.paused is None:
                    self.paused = []
                self.paused.append(ev.tool_call_id)
                return
            self.collector.add(ev)
        elif t == "request_stop":
            self.stop = ev
        elif t == "require_external_execution":
            self.suspended.extend(ev.tool_calls)
        elif t == "require_user_confirm":
            self.asking.extend(ev.tool_calls)

    def result(self, block: ToolResultBlock) -> None:
        """A call's result, handed whole by the acting pass (`_acting.ActingReader`)."""
        self.collector.results[block.id] = block

    def waiting(self) -> set[str]:
        """The calls that wait, rightly, for a confirmation or an external result."""
        waiting = {c.id for c in (*self.suspended, *self.asking)}
        return waiting.union(self.paused) if self.paused else waiting

    def remember(self, run: RunState) -> None:
        """The pass's results into memory. A call with no result that nobody waits on (an
        on_acting layer dropped its events) gets an error result: the conversation stays
        well-formed, and the session usable."""
        session = run.session
        assert session is not None
        calls, found = self.calls, self.collector.results
        if self.asking:  # a call paused mid-run (`ToolInputRequired`) ended RUNNING: no result yet
            found = {k: r for k, r in found.items() if r.state is not ToolResultState.RUNNING}
        results = [found[c.id] for c in calls if c.id in found]
        if len(results) < len(calls):
            waiting = self.waiting()
            results += [result_block(c, DROPPED_TEXT, ToolResultState.ERROR) for c in calls
                        if c.id not in found and c.id not in waiting]
            session.pending_tool_calls = [c.id for c in calls if c.id in waiting and c.id not in found]
        elif session.pending_tool_calls:
            session.pending_tool_calls = []
        if results:
            # (``Msg.tool(results)``, built from the ToolResultBlocks gathered above)
            session.context.append(_TOOL_MSG.build(role="tool", content=results))

    def end_run(self, run: RunState) -> None:
        """A stop, a pause for confirmation or a suspension for external results ends the run
        (its result: the reply as the caller saw it, with the suspended calls running)."""
        assistant = self.assistant
        if self.stop is not None:
            run.end(assistant, self.stop.generate_reason, remember=False)
        elif self.suspended:
            running = [ToolResultBlock(id=c.id, name=c.name, state=ToolResultState.RUNNING) for c in self.suspended]
            pause = assistant.model_copy(update={"content": [*assistant.content, *running]})
            run.end(pause, GenerateReason.TOOL_SUSPENDED, remember=False)

    def keep_results(self, run: RunState, error: BaseException) -> None:
        """The pass failed or was cut: the results it produced are remembered, and (for an error)
        every other call gets an error result, so no call is left dangling and the next call of
        the session is not refused for pending tool calls. An interrupted pass leaves the rest to
        `RunState.end_interrupted` (interrupted results)."""
        session = run.session
        assert session is not None
        found = self.collector.results
        results = [found[c.id] for c in self.calls if c.id in found]
        if isinstance(error, Exception) and not isinstance(error, AgentInterrupted):
            text = f"Error: the tool call did not complete: {describe(error)}"
            results += [result_block(c, text, ToolResultState.ERROR) for c in self.calls if c.id not in found]
        if results:
            session.context.append(Msg.tool(results))
        session.pending_tool_calls = []


NextStep: TypeAlias = NextStepRunAgain | NextStepAct | NextStepFinalOutput
RUN_AGAIN = NextStepRunAgain()


class Step:
    """One step of a run as the loop drives it: its stream, what to call with each of its events
    (a reply builder, an acting collector, or a check; None for a model call that hands its
    builder the reply itself, and for an acting pass that hands its step the results), the
    extension point its events leave (named in errors), and for acting the pass it belongs to.

    ``closed``: the stream closes every bracket it opens however it ends, and the loop hands its
    events to nobody who could fail — a model call the loop reads itself (its blocks closed by
    `PartsManager.fail`, one call per subscription): the loop keeps none of its brackets
    (`_brackets.Brackets` would find nothing to close)."""

    __slots__ = ("acting", "closed", "kind", "on_event", "point", "stream")

    def __init__(
        self, kind: int, stream: AsyncIterable[AgentEvent], on_event: Callable[[Any], None] | None,
        point: ExtensionPoint, acting: NextStepAct | None = None, closed: bool = False,
    ) -> None:
        self.kind = kind
        self.stream = stream
        self.on_event = on_event
        self.point = point
        self.acting = acting
        self.closed = closed


DROPPED_TEXT = "Error: the tool call produced no result (an on_acting middleware dropped its events)."


def result_block(call: ToolUseBlock, text: str, state: ToolResultState) -> ToolResultBlock:
    return ToolResultBlock(id=call.id, name=call.name, state=state, output=text)


