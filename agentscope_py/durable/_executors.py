"""The workflow's side of the seam: the runtime's model and tool executors
(`AgentRuntime.model_executor` / ``tool_executor``) replaced by activities, so the loop and the
middleware run in the workflow and every model call and tool call is a step of its history."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from types import MappingProxyType
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.exceptions import TimeoutError as ActivityTimeout

from .._acting import ToolScope
from .._control import RunControl
from .._deadline import Deadline
from .._effects import idempotency_key, in_doubt_policy
from .._model_call import UsageSink
from .._tool_answers import tool_answers
from ..agent.react import ReActAgent
from ..errors import AgentInterrupted, DurableActivityError, GuardrailTripped, ToolInputRequired
from ..events import AgentEvent, parse_event
from ..extension.base import ExtensionPoint
from ..message import ChatUsage, DataBlock, ToolUseBlock
from ..middleware.safety.pii import PIIRedactionMiddleware
from ..model.base import ChatModel, ModelRequest
from ..stream import Channel, EventStream
from ..tool.toolkit import Tool
from ._codec import dump_request, load_events
from ._config import MODEL_ACTIVITY, TOOL_ACTIVITY, TOOL_BESIDE, DurableConfig
from ._in_doubt import InDoubt, asked, in_doubt, journaled, once, reconciled, recorded, replay
from ._journal import Journal
from ._sub_sessions import SubTurns

__all__ = ["CancelledCalls", "Stop", "install", "redaction_beside_model"]


def _failure(exc: ActivityError, what: str) -> DurableActivityError:
    cause = exc.cause
    message = cause.message if isinstance(cause, ApplicationError) else str(cause or exc)
    kind = cause.type if isinstance(cause, ApplicationError) else None
    return DurableActivityError(f"{what} failed: {kind}: {message}" if kind else f"{what} failed: {message}",
                                error_type=kind)


class Stop:
    """The workflow's interrupt as its signal left it: whether one came (perhaps before the run
    was in flight, so the run stops at its first call), and whether it asked for the turn to be
    taken back (``multitask_strategy="rollback"``)."""

    __slots__ = ("interrupted", "rollback")

    def __init__(self) -> None:
        self.interrupted = False
        self.rollback = False


class CancelledCalls:
    """The model and tool calls the run cancelled (an interrupt, a tool's timeout) that have not
    ended on their workers yet. The run goes on without waiting for them (an interrupted reply
    streams at once), but it starts no other call, and its workflow does not close, before they
    ended: the session's next turn never runs beside a call it interrupted.

    A cancelled model call that had spent something (its usage read on the worker) ends with it
    in its failure's details (`_activities.model_call_activity`): once it ended, that usage goes
    to the usage sink of the run that cancelled it. A run that goes on after the cancellation (a
    hedge's losing attempt) counts it before its next call starts; an interrupted run's usage is
    final as its reply goes out, before the cancellation completes on the worker (at its next
    heartbeat): there it comes too late to count, unless the reply waited for it.

    A cancelled sub-agent call that saved its interrupted turn ends with its report in its failure's
    details (`_activities.tool_call_activity`: the sessions it changed, its usage): it goes to the
    turn that made the call."""

    def __init__(self) -> None:
        self.handles: list[tuple[workflow.ActivityHandle[Any], UsageSink | None, BesideSink | None]] = []

    def add(self, handle: workflow.ActivityHandle[Any], usage: UsageSink | None, beside: BesideSink | None) -> None:
        self.handles.append((handle, usage, beside))

    async def settled(self) -> None:
        """Once every cancelled call has ended on its worker (cancelled there within about a
        second, `_activities._heartbeats`; a dead worker's once its heartbeat timeout passed)."""
        while self.handles:
            handles, self.handles = self.handles, []
            await workflow.wait([handle for handle, _, _ in handles])
            for handle, usage, beside in handles:  # how they ended is no one's concern now: retrieved, not raised
                if handle.cancelled():
                    continue
                failure = handle.exception()
                if isinstance(failure, ActivityError):
                    _hand_over(failure, usage, beside)


BesideSink = Callable[[dict[str, Any]], None]
"""Where what a tool call's activity reports beside its outcome goes (`_activities._beside`)."""


def _hand_over(failure: ActivityError, usage: UsageSink | None, beside: BesideSink | None) -> None:
    """What a failed activity reported beside its failure, to whom it goes: a model call's usage
    (`spent_in`), a tool call's report (its last detail)."""
    cause = failure.cause
    if usage is not None:
        spent = spent_in(cause)
        if spent is not None:
            usage(spent)
    if beside is not None and isinstance(cause, ApplicationError) and cause.details:
        last = cause.details[-1]
        if isinstance(last, dict) and isinstance(last.get(TOOL_BESIDE), dict):
            beside(last[TOOL_BESIDE])


def spent_in(failure: BaseException | None) -> ChatUsage | None:
    """The usage a failed model call's activity reported beside its failure (`_activities._Spent`):
    its failure's details, or, when it timed out, its last heartbeat's."""
    if isinstance(failure, ApplicationError):
        details: Any = failure.details
    elif isinstance(failure, ActivityTimeout):
        details = failure.last_heartbeat_details
    else:
        return None
    return ChatUsage.model_validate(details[0]) if details and isinstance(details[0], dict) else None


async def _activity(name: str, payload: dict[str, Any], options: dict[str, Any], control: RunControl,
                    what: str, stop: Stop, cancelled: CancelledCalls, doubtful: bool = False,
                    usage: UsageSink | None = None, beside: BesideSink | None = None) -> Any:
    """Run the activity as a task of the run's control: an interrupt cancels it (Temporal asks
    the activity to stop at its next heartbeat), and that surfaces as `AgentInterrupted` at once,
    while the workflow waits for the activity's end elsewhere (`CancelledCalls`). ``stop``: the
    workflow was interrupted (perhaps before this run was in flight): nothing is scheduled.
    ``doubtful``: a journaled tool call, whose activity ending with no result is `InDoubt`.
    ``usage``: where the usage a failed model call's activity reported goes (`spent_in`);
    ``beside``: where a tool call's report goes when it fails (`_activities._beside`)."""
    if stop.interrupted:
        control.interrupt(stop.rollback)
        raise AgentInterrupted(f"the run was interrupted before the {what}")
    started: list[workflow.ActivityHandle[Any]] = []

    async def run() -> Any:
        await cancelled.settled()  # (a tool that timed out is still being cancelled)
        # Cancelled, the activity's handle resolves only once the activity has ended on its
        # worker: what `CancelledCalls` waits for. Shielded: its caller is released at once.
        handle = workflow.start_activity(
            name, payload, cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED, **options)
        started.append(handle)
        return await asyncio.shield(handle)

    task = asyncio.ensure_future(run())
    control.tasks.add(task)
    try:
        return await task
    except asyncio.CancelledError:  # an interrupt, or the caller's own cancellation (a tool's timeout)
        for handle in started:
            handle.cancel()
            cancelled.add(handle, usage, beside)
        if control.interrupted:
            raise AgentInterrupted(f"the {what} was interrupted") from None
        raise
    except ActivityError as exc:
        _hand_over(exc, usage, beside)
        if control.interrupted:
            raise AgentInterrupted(f"the {what} was interrupted") from None
        cause = exc.cause
        if isinstance(cause, ApplicationError) and cause.type == "ToolInputRequired":  # the run pauses
            raise ToolInputRequired(cause.message, *cause.details[:1]) from None
        if doubtful and in_doubt(exc):
            raise InDoubt(str(cause or exc)) from None
        raise _failure(exc, what) from None
    finally:
        control.tasks.discard(task)


def redaction_beside_model(agent: ReActAgent) -> PIIRedactionMiddleware | None:
    """The agent's innermost ``on_model_call`` layer when it is a `PIIRedactionMiddleware`. In a
    durable run it rewrites the model's events in the model call's activity, as they are made,
    rather than in the workflow: the activity's result is what Temporal's history keeps, so the
    history holds the redacted reply. Innermost, it wraps the model call alone, so running it
    beside the model is the same rewrite at the same place of the onion."""
    hooks = agent._runtime.participants.hooks[ExtensionPoint.ON_MODEL_CALL]
    return hooks[-1] if hooks and isinstance(hooks[-1], PIIRedactionMiddleware) else None


REDACTION_PATCH = "agentscope.redaction-beside-model"
"""The marker of a run whose model calls' activities run its redaction (`workflow.patched`): a
history without it, recorded by workers that redacted in the workflow, holds raw model results,
and its run keeps redacting in the workflow when it is replayed or goes on."""


def _redact_beside_model(agent: ReActAgent) -> bool:
    """Take the agent's innermost redaction out of the workflow's ``on_model_call`` chain (the
    model call's activity runs it, `redaction_beside_model`): whether it was."""
    if redaction_beside_model(agent) is None or not workflow.patched(REDACTION_PATCH):
        return False
    parts = agent._runtime.participants
    parts.hooks = MappingProxyType({**parts.hooks, ExtensionPoint.ON_MODEL_CALL:
                                    parts.hooks[ExtensionPoint.ON_MODEL_CALL][:-1]})
    parts.chains.clear()
    return True


def _deltas_live(agent: ReActAgent) -> bool:
    """Whether a model call's events may be published by its activity as they come: they are
    the events the run yields only when no middleware between the model and the run may change
    them (``on_model_call``, ``on_reasoning``), unless each such middleware says it passes them
    through unchanged (``durable_live_events = True``). Otherwise they are published when the
    call returns, as the run yields them."""
    hooks = agent._runtime.participants.hooks
    return all(getattr(mw, "durable_live_events", False)
               for point in (ExtensionPoint.ON_MODEL_CALL, ExtensionPoint.ON_REASONING) for mw in hooks[point])


def install(agent: ReActAgent, factory: str, config: DurableConfig, user_id: str, session_id: str,
            stop: Stop, journal: Journal, cancelled: CancelledCalls, sub_turns: SubTurns) -> None:
    """Make ``agent`` (built in the workflow) run its model and tool calls as activities;
    ``stop`` is the workflow's interrupt; ``journal`` numbers the run's events
    (the activities publish the pending ones, `Journal.pending`); ``cancelled`` holds the calls
    cancelled and not yet ended; ``sub_turns``, the notes of the sub-agent sessions the turn's
    tool calls changed."""

    def reported(scope: ToolScope) -> BesideSink:
        """Where a tool call's report goes: its notes to the turn that made it, its usage (its
        sub-agents') into the run's, as a local sub-agent call adds it."""
        notes = sub_turns.sink()

        def take(report: dict[str, Any]) -> None:
            if report.get("sub_turns"):
                notes(report["sub_turns"])
            if report.get("usage"):
                scope.ctx.add_usage(ChatUsage.model_validate(report["usage"]))

        return take
    redacted = _redact_beside_model(agent)
    deltas = _deltas_live(agent)

    def model_executor(models: Sequence[ChatModel], request: ModelRequest, reply_id: str, control: RunControl,
                       deadline: Deadline | None, usage: UsageSink) -> EventStream[AgentEvent]:
        async def events() -> AsyncIterator[AgentEvent]:
            # The run is pulled event by event: every event before this call has its position.
            live = journal.pending()
            seq, reply_name = journal.next, journal.ids.stable(reply_id)
            payload = {"factory": factory, "models": [m.name for m in models], "request": dump_request(request),
                       "reply_id": reply_id, "token": journal.token, "seq": seq,
                       "reply_name": reply_name, "live": {**live, "deltas": deltas} if live else {},
                       "redacted": redacted}
            options = config.for_model(models[0].name).options()
            if deadline is not None and deadline.total is not None:  # a middleware's deadline bounds the attempt
                options["schedule_to_close_timeout"] = _seconds(deadline.total)
            try:
                out = await _activity(MODEL_ACTIVITY, payload, options, control, f"model call to {models[0].name}",
                                      stop, cancelled, usage=usage)
            except (AgentInterrupted, DurableActivityError):
                if live and deltas:  # what the call published is the run's: it is closed as locally
                    for ev in load_events(await journal.seal(f"m{seq}"), reply_id, reply_name):
                        yield ev
                raise
            journal.confirm(out["published"])
            if out.get("usage") is not None:  # spent by attempts whose events never came back
                usage(ChatUsage.model_validate(out["usage"]))
            data = out["events"]
            for ev in load_events(data, reply_id, data[0].get("reply_id", reply_id) if data else reply_id):
                yield ev
            if out.get("tripped"):  # the redaction's block strategy refused the reply, in the activity
                raise GuardrailTripped(*out["tripped"])

        return EventStream(events)

    async def tool_executor(scope: ToolScope, call: ToolUseBlock, tool: Tool, channel: Channel) -> None:
        once_only = journaled(tool)
        if once_only:
            settled = recorded(scope, call)
            if settled is not None:  # the user said how a call in doubt ended: it never runs again
                await replay(scope, call, settled, channel)
                return
        payload = {"factory": factory, "call": call.model_dump(mode="json"), "user_id": user_id,
                   "session_id": session_id, "reply_id": scope.reply_id,
                   "answer": tool_answers(scope.ctx).pop(call.id, None), "journaled": once_only}
        options = config.for_tool(call.name, tool.timeout).options()
        what = f"tool call {call.name}"
        beside = reported(scope)
        while True:
            payload["live"] = journal.pending()
            try:
                out = await _activity(TOOL_ACTIVITY, payload, once(options) if once_only else options, scope.control,
                                      what, stop, cancelled, once_only, beside=beside)
                break
            except InDoubt:
                key = idempotency_key(user_id, session_id, call.id)
                if in_doubt_policy(tool, agent._runtime.in_doubt) != "reconcile" or tool.reconcile is None:
                    await asked(scope, call, key, channel)  # (raises: the run pauses for the answer)
                found = await reconciled(scope, call, tool, key, factory, options, channel)
                if found is not None:  # it happened: its result is what the reconcile found
                    out = found
                    break
                # It did not happen: it runs (once, again in doubt if its worker dies again).
        from ..events import ToolResultDataDelta, ToolResultTextDelta

        for kind, value in out:
            if kind == "text":
                await channel.put(ToolResultTextDelta(reply_id=scope.reply_id, tool_call_id=call.id,
                                                      tool_name=call.name, delta=value))
            elif kind == "published":
                journal.confirm(value)
            elif kind == TOOL_BESIDE:
                beside(value)
            elif kind == "data":
                await channel.put(ToolResultDataDelta(reply_id=scope.reply_id, tool_call_id=call.id,
                                                      tool_name=call.name, data=DataBlock.model_validate(value)))
            else:
                await channel.put(parse_event(value))

    runtime = agent._runtime
    runtime.model_executor = model_executor
    runtime.tool_executor = tool_executor


def _seconds(value: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=value)
