"""Sub-agents inside one AG-UI run: the events a child agent forwards into its parent's stream
(``source`` set, as `ReActAgent.as_tool` does) as AG-UI 1.0's subagent events.

Each invocation of a child is one ``subagentRunId`` (the child's reply id): SUBAGENT_STARTED
names the child and ties it to the tool call that runs it (``parentToolCallId``, the assistant
message holding that call as ``parentMessageId``, and ``parentSubagentRunId`` when the caller is
itself a child); every event of the child carries that ``subagentRunId``, its text and tool calls
in messages of its own (never the parent's assistant message); SUBAGENT_FINISHED (or
SUBAGENT_ERROR) closes it before the parent's TOOL_CALL_RESULT. A plain client sees a valid,
balanced stream; the official client's verifier checks steps, messages and tool calls per
subagent.

Which invocation an event belongs to is read from its ``reply_id`` (each child run has its own);
events without one (the child's result, custom events) go to the newest open invocation with
that ``source``. The tool call a child runs under is the oldest running call of its caller whose
tool is named like the child (the last segment of ``source``) and has no child yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ag_ui.core import (
    CustomEvent,
    SubagentErrorEvent,
    SubagentFinishedEvent,
    SubagentFinishedSuspendedOutcome,
    SubagentStartedEvent,
)

from ...message import ChatUsage, GenerateReason, Msg, ToolUseBlock, new_id
from . import wire
from .content import CONTENT_HANDLERS, OpenContent, attribute, end_step, jsonable, start_step
from .wire import AguiEvent

__all__ = ["SUSPENDED", "Subagents"]

SUSPENDED = (GenerateReason.PERMISSION_ASKING, GenerateReason.TOOL_SUSPENDED)
"""The reasons of a reply that paused for an answer (an approval, an external result)."""



class SubRun:
    """One invocation of a sub-agent: its open content and step, and how it ended."""

    __slots__ = ("asking", "call_id", "content", "id", "model", "name", "parent", "reason", "result",
                 "segments", "source", "step")

    def __init__(self, run_id: str, name: str, source: str, parent: SubRun | None, call_id: str | None,
                 emitted_ids: set[str]) -> None:
        self.id = run_id
        self.name = name
        self.source = source
        self.segments = tuple(source.split("/"))
        self.parent = parent
        self.call_id = call_id
        self.content = OpenContent(emitted_ids, subagent_run_id=run_id)
        self.step: str | None = None
        self.model = ""
        self.asking: list[ToolUseBlock] = []
        self.reason: GenerateReason | None = None
        self.result: Any = None


class Subagents:
    """The sub-agent invocations open in one AG-UI run (owned by `AguiMapper`).

    ``add_usage(model, usage)`` receives the children's model usage, so the run's RUN_FINISHED
    reports the whole tree's. ``asking`` collects the calls children asked approval for, with the
    invocation that asked."""

    def __init__(self, top: OpenContent, emitted_ids: set[str], add_usage: Callable[[str, ChatUsage], None]) -> None:
        self._top = top
        self._emitted = emitted_ids
        self._add_usage = add_usage
        self._runs: dict[str, SubRun] = {}  # reply id -> open invocation
        self._latest: dict[str, SubRun] = {}  # source -> the open invocation that spoke last
        self._claimed: set[str] = set()  # tool call ids that run (or ran) a child
        self._ended: set[str] = set()  # invocations closed (AG-UI never lets an id start twice)
        self.asking: list[tuple[ToolUseBlock, str]] = []

    @property
    def open(self) -> bool:
        return bool(self._runs)

    def map(self, ev: Any, out: list[AguiEvent]) -> None:
        """The AG-UI events for one event of a child (``ev.source`` is set)."""
        kind = ev.type
        if kind == "agent_start" and ev.reply_id not in self._runs:
            self._start(ev.reply_id, ev.name, ev.source, out)
            return
        run = self._find(ev)
        if run is None:  # a forwarded event of a run we saw no start of (or saw end): open one for it
            reply_id = getattr(ev, "reply_id", None)
            if reply_id is None or reply_id in self._ended:
                reply_id = new_id("subrun_")
            run = self._start(reply_id, ev.source.rsplit("/", 1)[-1], ev.source, out)
        self._latest[run.source] = run
        first = len(out)
        content = CONTENT_HANDLERS.get(kind)
        if content is not None:
            content(run.content, ev, out)
        elif kind == "tool_result_end":
            self.close_call(ev.tool_call_id, ev.state.value, out, owner=run)
            first = len(out)  # the grandchildren closed above carry their own ids
            run.content.on_result_end(ev, out)
        elif kind == "model_call_start":
            run.model = ev.model
            run.step = start_step(run.step, ev.model, run.content, out)
        elif kind == "model_call_end":
            if ev.usage is not None:
                self._add_usage(run.model, ev.usage)
            end_step(run.step, ev, run.content, out)
            run.step = None
        elif kind == "agent_result":
            # Only a structured output is SUBAGENT_FINISHED's result: the text is the caller's
            # TOOL_CALL_RESULT already, and repeating a long one doubles what a slow client buffers.
            msg: Msg = ev.result
            run.reason = msg.generate_reason
            run.result = jsonable(msg.metadata.get("structured_output"))
        elif kind == "agent_end":
            if ev.error is None:
                self._finish(run, None, out)
            # A failed child is finished by its caller's tool result, whose state is what the
            # client may see (the error's own text stays in the server's log).
            return
        elif kind == "require_user_confirm":
            run.asking.extend(ev.tool_calls)
            self.asking.extend((c, run.id) for c in ev.tool_calls)
        elif kind == "custom":
            out.append(CustomEvent(name=ev.name, value=jsonable(ev.value)))
        else:
            out.append(CustomEvent(name=kind, value=ev.model_dump(mode="json")))
        attribute(out[first:], run.id)

    def delta_frame(self, ev: Any) -> bytes | None:
        """A child's delta as a frame, on the top level's fast path (`OpenContent.delta_frame`)."""
        reply_id = getattr(ev, "reply_id", None)
        run = self._runs.get(reply_id) if reply_id is not None else None
        if run is None:
            return None
        self._latest[run.source] = run
        return run.content.delta_frame(ev)

    def close_call(self, call_id: str, state: str, out: list[AguiEvent], owner: SubRun | None = None) -> None:
        """A tool call of ``owner`` (None: the top level) has its result: the children it ran and
        that are still open end here, in error unless the call succeeded (a child that raised, or
        was cut, sends no end of its own)."""
        for run in [r for r in self._runs.values() if r.call_id == call_id and r.parent is owner]:
            self._finish(run, None if state == "success" else (f"the {run.name} tool call ended: {state}", state), out)

    def close_all(self, out: list[AguiEvent], error: tuple[str, str] | None) -> None:
        """End every open invocation (the run is ending), innermost first."""
        for run in [r for r in self._runs.values() if r.parent is None]:
            self._finish(run, error or ("the run ended before the sub-agent did", "unfinished"), out)

    # -- lifecycle -------------------------------------------------------------------------------

    def _start(self, run_id: str, name: str, source: str, out: list[AguiEvent]) -> SubRun:
        segments = source.split("/")
        parent: SubRun | None = None
        for run in self._runs.values():  # the caller: the open run with the longest prefix of our path
            n = len(run.segments)
            longer = parent is None or n > len(parent.segments)
            if longer and n < len(segments) and tuple(segments[:n]) == run.segments:
                parent = run
        scope = parent.content if parent is not None else self._top
        call_id = self._pick_call(scope, segments[-1])
        run = SubRun(run_id, name, source, parent, call_id, self._emitted)
        self._runs[run_id] = run
        self._latest[source] = run
        out.append(SubagentStartedEvent(
            subagent_run_id=run_id, name=name, parent_subagent_run_id=parent.id if parent is not None else None,
            parent_tool_call_id=call_id, parent_message_id=scope.call_messages.get(call_id) if call_id else None,
        ))
        return run

    def _pick_call(self, scope: OpenContent, tool_name: str) -> str | None:
        free = [c for c in scope.running if c not in self._claimed]
        call_id = next((c for c in free if scope.running[c] == tool_name), free[0] if free else None)
        if call_id is not None:
            self._claimed.add(call_id)
        return call_id

    def _finish(self, run: SubRun, error: tuple[str, str] | None, out: list[AguiEvent]) -> None:
        for child in [r for r in self._runs.values() if r.parent is run]:
            self._finish(child, error or ("the calling sub-agent ended first", "unfinished"), out)
        first = len(out)
        out.extend(run.content.close())
        if run.step is not None:
            out.append(wire.step_finished(run.step))
            run.step = None
        attribute(out[first:], run.id)
        if error is None and run.reason is GenerateReason.INTERRUPTED:
            error = ("the sub-agent was interrupted", "interrupted")
        if error is not None:
            out.append(SubagentErrorEvent(subagent_run_id=run.id, message=error[0], code=error[1]))
        elif run.reason in SUSPENDED and run.asking:
            outcome = SubagentFinishedSuspendedOutcome(interrupt_ids=[c.id for c in run.asking])
            out.append(SubagentFinishedEvent(subagent_run_id=run.id, outcome=outcome))
        else:
            out.append(SubagentFinishedEvent(subagent_run_id=run.id, result=run.result))
        del self._runs[run.id]
        self._ended.add(run.id)
        if self._latest.get(run.source) is run:
            del self._latest[run.source]

    def _find(self, ev: Any) -> SubRun | None:
        reply_id = getattr(ev, "reply_id", None)
        run = self._runs.get(reply_id) if reply_id is not None else None
        return run if run is not None else self._latest.get(ev.source)
