"""Resuming a run whose tool calls wait: confirm results answer asking calls (run, denied or
edited), tool-result messages answer external calls (one input may carry both; each call takes
one answer), an empty input runs what is pending (after a restart). Calls left unanswered wait
on: an asking call is asked again, an external call whose tool the run does not declare (an
AG-UI frontend tool) keeps waiting for its result. Anything else is a `ResumeError` that says what
the session waits for.

Pending calls with a tool-journal entry are settled first (`_in_doubt`): a recorded result is
replayed, a call in doubt is decided by the user's answer or its policy, or asked about."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from .._history import answers_in
from .._tool_answers import tool_answers
from ..errors import InputError, PendingToolCallsError, ResumeError
from ..events import (
    AgentEvent,
    ConfirmResult,
    ExternalExecutionResult,
    RequireExternalExecution,
    ToolResultEnd,
    ToolResultStart,
    ToolResultTextDelta,
    UserConfirmResult,
)
from ..message import GenerateReason, Msg, ToolResultBlock, ToolResultState, ToolUseBlock
from ..stream import aclosing
from ._boundaries import admit, clean_block
from ._in_doubt import Settled, settle
from ._journal import entry_of
from ._structured import check_resume
from ._subagent_tree import WAITS_KEY, route_confirms

if TYPE_CHECKING:
    from ._scope import StepScope

__all__ = ["check_no_control_input", "edit_call", "last_assistant", "resume"]


async def resume(exe: StepScope, pending: list[ToolUseBlock], input_msgs: list[Msg]) -> AsyncIterator[AgentEvent]:
    state = exe.run.session
    assert state is not None
    try:
        confirms = _confirm_results(input_msgs)
    except ResumeError:
        exe.run.refused = True
        raise
    # External results come from the client: made storable like any input (`_boundaries.admit`).
    results = [clean_block(b) for m in input_msgs if m.role == "tool" for b in m.tool_results]
    by_id = {c.id: c for c in pending}
    if input_msgs and not confirms and not results:
        raise _refusing(exe, _pending_error(exe, pending))
    check_resume(exe.run)  # (a new prompt is refused above, as for any paused run)
    answered_by_result = {r.id for r in results}
    _check_ids(exe, Settled(), [r.id for r in results], by_id, "tool result")  # (before settling changes anything)
    after = _after_answers(exe, input_msgs, confirms, answered_by_result, by_id)
    settled = Settled()
    if state.tool_journal:
        # (a call a tool result answers is not settled: the result is its answer)
        settled = await settle(exe, [c for c in pending if c.id not in answered_by_result], confirms)
        for ev in settled.events:
            yield ev
        if settled.error is not None:
            raise settled.error
    asked = {c.id for c in settled.asked}
    if confirms or results:
        # Confirms for the calls a paused sub-agent waits on go to its call (run again below).
        own, rerun = route_confirms(exe.ctx, state, by_id, confirms) if confirms else ([], set())
        _check_ids(exe, settled, [c.tool_call_id for c in own], by_id, "confirm result")
        _check_not_waiting_below(exe, settled, own, rerun)
        twice = [c.tool_call_id for c in own if c.tool_call_id in answered_by_result]
        if twice:
            error = ResumeError(f"both a confirm result and a tool result for {', '.join(map(repr, twice))}: "
                                "answer each waiting call once (a confirm result for a call that asks, a tool "
                                "result for an external one)")
            raise _refusing(exe, error) if not settled.events else error
        if confirms:
            yield UserConfirmResult(reply_id=exe.reply_id, confirm_results=confirms)
        if results:
            yield ExternalExecutionResult(reply_id=exe.reply_id, tool_results=results)
            state.context.append(Msg.tool(results))
        left = [c for c in pending if c.id not in answered_by_result]
        if not confirms and not any(_asks(exe, c) or c.id in settled.decided or c.id in asked for c in left):
            # Only external calls are left: the run stays suspended for their results.
            state.pending_tool_calls = [c.id for c in left]
            if left:
                _suspend(exe, left)
            state.context.extend(after)  # (only when nothing is left: `_after_answers`)
            return
        answered = {c.tool_call_id: c for c in own}
        run: list[ToolUseBlock] = []
        denied: list[ToolResultBlock] = []
        undeclared: list[ToolUseBlock] = []
        for call in left:
            answer = answered.get(call.id)
            if call.id in settled.decided or call.id in asked:  # was in doubt: settled above
                if call.id not in asked:
                    run.append(as_it_ran(exe, call))
            elif call.id in rerun:
                exe.run.preapproved.add(call.id)  # its sub-agent asks, not the gate
                run.append(call)
            elif answer is None and _undeclared(exe, call):
                undeclared.append(call)
            elif answer is None:
                # still waiting: the gate asks again (an external call asks for its result again)
                run.append(call)
            elif not answer.confirmed:
                reason = f" Reason: {answer.reason}" if answer.reason else ""
                denied.append(ToolResultBlock(id=call.id, name=call.name, state=ToolResultState.DENIED,
                                              output=f"The user denied this tool call.{reason}"))
            else:
                if answer.input is not None:
                    call = call.model_copy(update={"input": answer.input, "raw_input": None})
                    edit_call(exe, call)
                if answer.answer is not None:  # for the question the tool asked (ToolInputRequired)
                    tool_answers(exe.ctx)[call.id] = answer.answer
                exe.run.preapproved.add(call.id)
                run.append(call)
        for block in denied:
            for ev in _result_events(exe.reply_id, block):
                yield ev
        if denied:
            state.context.append(Msg.tool(denied))
        if undeclared:
            yield RequireExternalExecution(reply_id=exe.reply_id, tool_calls=undeclared)
        assistant = last_assistant(exe)
        if run:
            async with aclosing(exe.act(run, assistant)) as steps:
                async for ev in steps:
                    yield ev
        for ev in _ask(exe, settled):
            yield ev
        if undeclared and exe.run.final is None:
            _suspend(exe, undeclared)
        state.pending_tool_calls = [c.id for c in exe.run.pending_calls()]
        return
    # An empty input resumes acting on what is pending (e.g. after a restart); a frontend call
    # this run does not declare goes on waiting for its result.
    undeclared = [c for c in pending if c.id not in asked and c.id not in settled.decided and _undeclared(exe, c)]
    if undeclared:
        yield RequireExternalExecution(reply_id=exe.reply_id, tool_calls=undeclared)
    waits = asked.union(c.id for c in undeclared)
    to_run = [c for c in pending if c.id not in waits] if waits else pending
    if to_run:
        async with aclosing(exe.act(to_run, last_assistant(exe))) as steps:
            async for ev in steps:
                yield ev
    if asked:
        for ev in _ask(exe, settled):
            yield ev
    if undeclared and exe.run.final is None:
        _suspend(exe, undeclared)
    if waits:
        state.pending_tool_calls = [c.id for c in exe.run.pending_calls()]


def _after_answers(exe: StepScope, msgs: list[Msg], confirms: list[ConfirmResult], results: set[str],
                   pending: dict[str, ToolUseBlock]) -> list[Msg]:
    """The new messages sent beside answers, as memory takes them: after the results, when those
    answer every waiting call (a client that answers a frontend tool and sends the user's next
    message at once; the model then sees both, as it would have one run after the other).
    Beside confirm results, or beside results that leave calls waiting, a message would have to
    wait for a later run that the answers may not reach: a `ResumeError`, nothing taken."""
    new = [m for m in msgs if m.role != "tool" and not m.metadata.get("confirm_results")]
    if not new:
        return []
    if confirms or set(pending) - results or exe.run.session is None or exe.run.session.tool_journal:
        waiting = ", ".join(c for c in pending if c not in results) or ", ".join(pending)
        raise _refusing(exe, ResumeError(
            f"a new message was sent with answers that leave tool calls waiting or must run them ({waiting}): "
            "send the answers on their own, then the message once the run they resume has ended"))
    if any(m.role == "assistant" for m in new):
        raise _refusing(exe, ResumeError("an assistant message was sent with the answers to waiting tool calls: "
                                         "send the results on their own, or with the user's next message"))
    try:
        return [admit(m) for m in new]
    except InputError:
        exe.run.refused = True
        raise


def _suspend(exe: StepScope, calls: list[ToolUseBlock]) -> None:
    """End the run TOOL_SUSPENDED: its reply the calls' message, with ``calls`` running."""
    running = [ToolResultBlock(id=c.id, name=c.name, state=ToolResultState.RUNNING) for c in calls]
    assistant = last_assistant(exe)
    pause = assistant.model_copy(update={"content": [*assistant.content, *running]})
    exe.run.end(pause, GenerateReason.TOOL_SUSPENDED, remember=False)


def _undeclared(exe: StepScope, call: ToolUseBlock) -> bool:
    """A waiting call whose tool this run does not know: an AG-UI frontend tool the run does not
    declare. It is no unknown tool (an acting pass would answer it with that error): it waits for
    its result, as it did."""
    return exe.agent.toolkit.get(call.name) is None


def _asks(exe: StepScope, call: ToolUseBlock) -> bool:
    """Whether a waiting call waits for a confirmation: its tool is one of the agent's, and not
    external (an external call, or one the run's toolkit does not know, waits for its result)."""
    tool = exe.agent.toolkit.get(call.name)
    return tool is not None and not tool.external


def _pending_error(exe: StepScope, pending: list[ToolUseBlock]) -> PendingToolCallsError:
    """What a new input gets while calls wait; calls in doubt (an intent, no result: their run
    stopped while they ran) are named as such, with the answer they take — the run that would
    have asked about them died, so this is where the user first hears of them."""
    state = exe.run.session
    assert state is not None
    where = f"session {exe.ctx.user_id}/{exe.ctx.session_id}"
    ids = tuple(c.id for c in pending)
    doubtful = tuple(c.id for c in pending if (entry := entry_of(state, c.id)) is not None and entry.result is None)
    if not doubtful:
        return PendingToolCallsError(
            f"{where} has tool calls waiting ({', '.join(ids)}): answer them with confirm results "
            "(agentscope_py.confirm_message) or tool results first", tool_call_ids=ids)
    return PendingToolCallsError(
        f"{where} has tool calls in doubt ({', '.join(doubtful)}): the run that made them stopped while they ran, "
        "so they may or may not have taken effect. Answer each first with a confirm result "
        "(agentscope_py.confirm_message): answer={'done': True} if it took effect, answer={'done': False} to run "
        "it now, or confirmed=False to skip it; or resume with no input to let its in_doubt policy decide",
        tool_call_ids=ids, in_doubt=doubtful)


def _ask(exe: StepScope, settled: Settled) -> list[AgentEvent]:
    """The questions about the calls in doubt the user is asked about; the run then pauses for
    the answers (unless it already ended)."""
    if not settled.asked:
        return []
    assert exe.run.session is not None
    questions = settled.questions(exe.reply_id, exe.run.session.tool_journal)
    if exe.run.final is None:
        exe.run.end(last_assistant(exe), GenerateReason.PERMISSION_ASKING, remember=False)
    return questions

def last_assistant(exe: StepScope) -> Msg:
    assert exe.run.session is not None
    for msg in reversed(exe.run.session.context):
        if msg.role == "assistant":
            return msg
    raise ResumeError("no assistant message to resume")


def as_it_ran(exe: StepScope, call: ToolUseBlock) -> ToolUseBlock:
    """A call whose recorded result is replayed, with the arguments it ran with: memory shows
    what ran. They differ from the call's own when it ran with an edit's arguments and its turn
    was then taken back (a rollback restores the call as the model made it, and the journal keeps
    what ran); whatever the new answer says, the replayed result is the one of that run."""
    assert exe.run.session is not None
    entry = entry_of(exe.run.session, call.id)
    if entry is None or entry.result is None or entry.arguments == call.input:
        return call
    ran = call.model_copy(update={"input": dict(entry.arguments), "raw_input": None})
    edit_call(exe, ran)
    return ran


def edit_call(exe: StepScope, call: ToolUseBlock) -> None:
    """Replace a call's arguments in memory, so the model sees what actually ran."""
    assert exe.run.session is not None
    context = exe.run.session.context
    for i in range(len(context) - 1, -1, -1):
        msg = context[i]
        if msg.role == "assistant":
            content = [call if getattr(b, "id", None) == call.id and b.type == "tool_use" else b
                       for b in msg.content]
            context[i] = msg.model_copy(update={"content": content})
            return



def _confirm_results(msgs: list[Msg]) -> list[ConfirmResult]:
    """The answers the input carries (`confirm_message`'s metadata). A message built by hand, or
    sent as JSON, may carry anything there: what is no answer is the caller's mistake."""
    out: list[ConfirmResult] = []
    for m in msgs:
        answers = m.metadata.get("confirm_results", ())
        if not isinstance(answers, list | tuple):
            answers = [answers]
        for raw in answers:
            if isinstance(raw, ConfirmResult):
                out.append(raw)
                continue
            try:
                out.append(ConfirmResult.model_validate(raw))
            except ValidationError as exc:
                problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'answer'}: {_answer_problem(e)}"
                                     for e in exc.errors())
                raise ResumeError(f"message {m.id}: metadata.confirm_results holds a value that is not a confirm "
                                  f"result ({problems}): build answers with confirm_message(...), over HTTP with "
                                  "`confirm`") from None
    return out


def _answer_problem(error: Any) -> str:
    """pydantic's words for what is wrong with an answer; for one that is no mapping at all, its
    shape, which reads the same as a Python dict and as JSON (the answer may have come as either)."""
    if error["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return 'should be {"tool_call_id": ..., "confirmed": true or false}'
    return str(error["msg"])


def check_no_control_input(msgs: list[Msg]) -> None:
    """Refuse answers when no call waits: confirmations, and tool results for calls the input
    does not make itself (a call and its result, both in the input, are history: `answers_in`)."""
    for m in answers_in(msgs):
        if m.metadata.get("confirm_results"):
            raise ResumeError("confirm results were given, but no tool call is waiting for confirmation"
                              f"{_ALL_ANSWERED}")
        raise ResumeError(f"tool results were given, but no tool call is waiting for a result{_ALL_ANSWERED}")


# What a refused answer says when nothing waits: a second answer (two sent at once: the session
# takes them in turn) finds its call answered by the first.
_ALL_ANSWERED = " (each was answered, or none asked): send the user's next message instead"


def _refusing(exe: StepScope, error: Exception) -> Exception:
    """``error``, the run marked as refusing its input (`RunState.refused`): raised before the
    resume changed the session."""
    exe.run.refused = True
    return error


def _check_ids(exe: StepScope, settled: Settled, ids: list[str], pending: dict[str, ToolUseBlock],
               what: str) -> None:
    """Each of ``ids`` names a different pending call; else a `ResumeError`, which refuses the
    input unless calls in doubt were settled before (`settle` changed the session)."""
    seen: set[str] = set()
    for i in ids:
        error = None
        if i not in pending:
            error = ResumeError(f"{what} for {i!r}, which is not a pending tool call (pending: {', '.join(pending)})")
        elif i in seen:
            error = ResumeError(f"duplicate {what} for {i!r}: answer each waiting call once")
        if error is not None:
            raise _refusing(exe, error) if not settled.events else error
        seen.add(i)


def _check_not_waiting_below(exe: StepScope, settled: Settled, own: list[ConfirmResult], rerun: set[str]) -> None:
    """No answer is for a sub-agent call that waits on its sub-agent's calls: those calls are the
    ones asked about (an answer to the sub-agent call itself would be dropped, or, a `Respond`,
    would end the call and leave its sub-agent's session waiting for ever). A `ResumeError`,
    refusing the input unless calls in doubt were settled before."""
    state = exe.run.session
    assert state is not None
    waits = state.metadata.get(WAITS_KEY)
    settling = settled.decided.union(c.id for c in settled.asked)  # (answered as calls in doubt)
    below = [c.tool_call_id for c in own if c.tool_call_id in rerun and c.tool_call_id not in settling]
    if not below or not isinstance(waits, dict):
        return
    leaves = [leaf for call_id in below for leaf in waits.get(call_id, ())]
    error = ResumeError(f"confirm result for {', '.join(map(repr, below))}, a sub-agent call waiting on its "
                        f"sub-agent's tool calls ({', '.join(leaves)}): answer those instead")
    raise _refusing(exe, error) if not settled.events else error


def _result_events(reply_id: str, block: ToolResultBlock) -> tuple[AgentEvent, ...]:
    return (
        ToolResultStart(reply_id=reply_id, tool_call_id=block.id, tool_name=block.name),
        ToolResultTextDelta(reply_id=reply_id, tool_call_id=block.id, tool_name=block.name, delta=block.text),
        ToolResultEnd(reply_id=reply_id, tool_call_id=block.id, tool_name=block.name, state=block.state),
    )
