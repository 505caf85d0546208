"""What a durable run waits for between its turns: asking tool calls (approval, or a question a
running tool asked — `ToolInputRequired`, an MCP elicitation) answered by ``confirm``, and
external tool calls answered by ``tool_results``. Kept apart from the workflow class, which only
routes signals and queries here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..events import AgentEvent, ConfirmResult, RequireExternalExecution, RequireUserConfirm
from ..message import GenerateReason, Msg, ToolResultBlock, ToolResultState

__all__ = ["Waits", "external_calls"]


def external_calls(final: Msg) -> list[dict[str, Any]]:
    """The calls a TOOL_SUSPENDED reply waits on: its tool calls whose result is still running."""
    running = {r.id for r in final.tool_results if r.state is ToolResultState.RUNNING}
    return [c.model_dump(mode="json") for c in final.tool_calls if c.id in running]


class Waits:
    """The run's waiting state (all JSON-able: queries return it as it is)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """A new turn asks afresh."""
        self.asking: list[dict[str, Any]] = []
        self.questions: dict[str, dict[str, Any]] = {}
        self.external: list[dict[str, Any]] = []
        self.waiting = False
        self.answers: list[ConfirmResult] | None = None
        self.results: list[ToolResultBlock] | None = None

    def see(self, ev: AgentEvent) -> None:
        """Note what a top-level event of the turn asks for (a sub-agent's own events carry a
        ``source`` and are answered through its call). The calls are known from here on, so an
        answer sent as soon as the caller sees the event (before the turn has saved and ended)
        is taken, and acted on when the turn ends."""
        if type(ev) is RequireUserConfirm and ev.source is None:
            self.asking.extend(call.model_dump(mode="json") for call in ev.tool_calls)
            question = ev.metadata.get("question")
            if question:
                for call in ev.tool_calls:
                    self.questions[call.id] = question
        elif type(ev) is RequireExternalExecution and ev.source is None:
            self.external.extend(call.model_dump(mode="json") for call in ev.tool_calls)
    def begin(self, final: Msg) -> bool:
        """After a turn: whether the run now waits (for confirms or external results)."""
        if final.generate_reason is GenerateReason.TOOL_SUSPENDED:
            self.external = external_calls(final)  # after partial results, only the rest
        self.waiting = final.generate_reason in (GenerateReason.PERMISSION_ASKING, GenerateReason.TOOL_SUSPENDED)
        return self.waiting

    def answered(self) -> bool:
        return self.answers is not None or self.results is not None

    def next_input(self) -> list[Msg]:
        """The next turn's input (the answers that arrived: confirms and external results alike,
        when a turn waits on both kinds), and the waiting state cleared."""
        from ..agent.react import confirm_message

        msgs = [confirm_message(*self.answers)] if self.answers is not None else []
        if self.results is not None or not msgs:
            msgs.append(Msg.tool(self.results or []))
        self.clear()
        return msgs

    # -- the signals' checks: an answer for no waiting call is dropped (a signal cannot fail the
    # caller, and a bad resume input must not fail the run); the client checks first. ------------

    def confirm(self, answers: list[ConfirmResult], results: Sequence[ToolResultBlock] = ()) -> list[str]:
        """Take confirm answers, and with them ``results`` for external calls; the ids that do
        not wait on their kind of answer (then nothing is taken)."""
        bad = _unknown([a.tool_call_id for a in answers], self.asking) + _unknown([r.id for r in results],
                                                                                  self.external)
        if not bad and answers:
            self.answers = answers
            if results:
                self.results = list(results)
        return bad

    def tool_results(self, results: list[ToolResultBlock]) -> list[str]:
        """Take external results; the ids that were not waiting (then nothing is taken)."""
        bad = _unknown([r.id for r in results], self.external)
        if not bad and results:
            self.results = results
        return bad


def _unknown(ids: list[str], calls: list[dict[str, Any]]) -> list[str]:
    known = {c["id"] for c in calls}
    return [i for i in ids if i not in known]
