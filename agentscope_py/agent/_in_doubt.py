"""Calls in doubt, settled when a run resumes its session's pending calls (`_resume`).

A pending call whose journal entry (`AgentState.tool_journal`) has a result ended before the
process died: it is replayed by the acting core, never run. One with an intent and no result may
or may not have taken effect: it is never run blindly. A user's answer to it decides first (a
`ConfirmResult`: ``confirmed=False`` skips it; ``answer={"done": True, "result": ...}`` says it
happened; ``answer={"done": False}`` runs it), else its policy (`in_doubt_policy`): ``"retry"``
runs an idempotent tool again, ``"reconcile"`` asks the tool's ``reconcile`` function, ``"ask"``
asks the user (a `RequireUserConfirm`; the run pauses). Every decision is a `ToolInDoubt` event.

Every call is decided before any is changed: when one cannot be (its ``reconcile`` raised, no
policy applies) the resume raises `ToolInDoubtError` with the session as it was, still in doubt."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._effects import InDoubtOutcome, InDoubtPolicy, ToolIntent, in_doubt_policy
from .._replies import join_output
from ..errors import ResumeError, ToolInDoubtError
from ..events import AgentEvent, ConfirmResult, RequireUserConfirm, ToolInDoubt
from ..message import DataBlock, ToolResultBlock, ToolResultState, ToolUseBlock
from ._journal import entry_of

if TYPE_CHECKING:
    from ._scope import StepScope

__all__ = ["SKIPPED_TEXT", "Settled", "settle"]

SKIPPED_TEXT = ("Error: this call may or may not have taken effect (its run stopped while it ran); the user chose "
                "to skip it, so it was not run again and its effect is unknown.")
DONE_TEXT = "The call had taken effect (confirmed by the user); its output was not recorded."


@dataclass(slots=True)
class Settled:
    """What settling a resume's pending calls decided."""

    events: list[AgentEvent] = field(default_factory=list)
    """The `ToolInDoubt` events, in call order."""
    decided: set[str] = field(default_factory=set)
    """Calls with a journal entry that the acting pass now replays or runs (preapproved)."""
    asked: list[ToolUseBlock] = field(default_factory=list)
    """Calls in doubt the user is asked about: they stay pending, and the run pauses."""
    error: ToolInDoubtError | None = None
    """Raised after ``events``: a call nothing could decide (the session was left unchanged)."""

    def questions(self, reply_id: str, entries: dict[str, ToolIntent]) -> list[AgentEvent]:
        """One `RequireUserConfirm` per asked call, its question in the metadata."""
        out: list[AgentEvent] = []
        for call in self.asked:
            key = entries[call.id].idempotency_key if call.id in entries else ""
            question = (f"Did the call to {call.name} take effect? Its run stopped while it ran "
                        f"(idempotency key {key}). Answer done (with its result, if known), not done (run it), "
                        "or skip.")
            out.append(RequireUserConfirm(reply_id=reply_id, tool_calls=[call], metadata={
                "in_doubt": True, "question": question, "idempotency_key": key}))
        return out


async def settle(exe: StepScope, pending: list[ToolUseBlock], confirms: list[ConfirmResult]) -> Settled:
    """Decide the pending calls that have a journal entry (the module docstring says how)."""
    state = exe.run.session
    assert state is not None
    journal = state.tool_journal
    settled = Settled()
    entries = [(c, entry_of(state, c.id)) for c in pending if c.id in journal]
    doubtful = [(c, entry) for c, entry in entries if entry is not None]
    if not doubtful:
        return settled
    answers = {c.tool_call_id: c for c in confirms}
    toolkit, default = exe.agent.toolkit, exe.runtime.in_doubt
    changes: dict[str, ToolIntent | None] = {}  # applied once every call is decided (None: forget it)
    for call, entry in doubtful:
        if entry.result is not None:
            settled.decided.add(call.id)  # ended before the process died: replayed
            continue
        tool = toolkit.get(call.name)
        answer = answers.get(call.id)
        policy: InDoubtPolicy
        outcome: InDoubtOutcome
        if answer is not None:
            policy = "ask"
            outcome, result = _answered(call, answer)
            changes[call.id] = None if result is None else entry.model_copy(update={"result": result})
        else:
            policy = "ask" if tool is None else in_doubt_policy(tool, default)
            result = None
            if policy == "ask":
                outcome = "asked"
                settled.asked.append(call)
            elif tool is not None and policy == "retry" and tool.idempotent:
                outcome = "retried"
                changes[call.id] = None
            elif tool is not None and policy == "reconcile" and tool.reconcile is not None:
                try:
                    found = await tool.reconciled(entry)
                except Exception as exc:
                    outcome = "failed"
                    settled.error = settled.error or ToolInDoubtError(
                        f"tool call {call.id} ({call.name}, key {entry.idempotency_key}) is in doubt and its "
                        f"reconcile raised {type(exc).__name__}: {exc}; nothing ran and the call stays in doubt: "
                        "resume again to reconcile again, or answer it with a ConfirmResult "
                        "(answer={'done': True|False}, or confirmed=False to skip it)",
                        tool_call_id=call.id, tool_name=call.name, idempotency_key=entry.idempotency_key,
                        policy=policy)
                else:
                    if found is None:
                        outcome = "not_done"
                        changes[call.id] = None
                    else:
                        outcome = "done"
                        output = join_output([p for p in found if isinstance(p, str | DataBlock)])
                        changes[call.id] = entry.model_copy(update={"result": ToolResultBlock(
                            id=call.id, name=call.name, output=output, state=ToolResultState.SUCCESS)})
            else:
                outcome = "failed"
                settled.error = settled.error or ToolInDoubtError(
                    f"tool call {call.id} ({call.name}, key {entry.idempotency_key}) is in doubt and no policy can "
                    f"decide it: {policy!r} needs "
                    f"{'an idempotent tool' if policy == 'retry' else 'a reconcile function'}; nothing ran and "
                    "the call stays in doubt: answer it with a ConfirmResult (answer={'done': True|False}, or "
                    "confirmed=False to skip it), or give the tool in_doubt='ask'",
                    tool_call_id=call.id, tool_name=call.name, idempotency_key=entry.idempotency_key, policy=policy)
        settled.events.append(ToolInDoubt(
            reply_id=exe.reply_id, tool_call_id=call.id, tool_name=call.name, arguments=entry.arguments,
            idempotency_key=entry.idempotency_key, policy=policy, outcome=outcome))
    if settled.error is not None:
        return settled
    for call_id, change in changes.items():
        if change is None:
            del journal[call_id]  # runs afresh: a new intent (with the same key) is recorded
        else:
            journal[call_id] = change
        settled.decided.add(call_id)
    exe.run.preapproved.update(settled.decided)  # every journaled call passed the permission gate
    return settled


def _answered(call: ToolUseBlock, answer: ConfirmResult) -> tuple[InDoubtOutcome, ToolResultBlock | None]:
    """The user's answer to a call in doubt: its outcome, and the result it gives the call (None:
    the call runs)."""
    if not answer.confirmed:
        return "skipped", ToolResultBlock(id=call.id, name=call.name, output=SKIPPED_TEXT,
                                          state=ToolResultState.ERROR)
    said = answer.answer or {}
    done = said.get("done")
    if done is False:
        return "not_done", None
    if done is not True:
        raise ResumeError(
            f"tool call {call.id} ({call.name}) is in doubt: answer whether it took effect with "
            "ConfirmResult(tool_call_id=..., confirmed=True, answer={'done': True, 'result': ...}) (it did) or "
            "answer={'done': False} (it did not: run it), or confirmed=False to skip it")
    return "done", ToolResultBlock(id=call.id, name=call.name, output=_text(said.get("result")),
                                   state=ToolResultState.SUCCESS)


def _text(result: Any) -> str:
    if result is None:
        return DONE_TEXT
    return result if isinstance(result, str) else json.dumps(result, default=str, ensure_ascii=False)
