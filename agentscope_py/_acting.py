"""The acting core: the permission gate, then the tools, as ToolResult* events.

Every tool call runs in a task of its own, made in the context current inside the innermost
``next()`` (so a span an acting middleware opened parents it), streaming its events through a
`Channel`. Contiguous concurrency-safe calls run in parallel; their events are emitted in call
order (the first call's live, the others' as soon as their turn comes). A tool that raises, times
out, is unknown or gets invalid arguments produces an error result the model sees. An interrupt
cancels the tasks (never the run's own task); each cancelled call ends with an INTERRUPTED
result, and the loop then raises `AgentInterrupted`.

A non-idempotent tool's call is journaled when the run has a `ToolJournal`: its intent is
recorded (durably) before the tool runs, its result after, and a call whose result is recorded
is replayed instead of run (a resumed run; `agentscope_py.agent._journal`).

The acting core sees its run only through a `ToolScope`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ._control import RunControl
from ._deadline import Deadline, DeadlineTimer
from ._recorded import INTERRUPTED_UNSURE_TEXT, UNSETTLED_TEXT, Recording, journaled, replay_events
from ._replies import arguments_problem, join_output, result_events
from ._sanitize import clean
from ._trusted import delta_maker
from .errors import AgentInterrupted, SubAgentPaused, ToolInputRequired
from .events import (
    AgentEvent,
    AllToolsDenied,
    EventBase,
    RequestStop,
    RequireExternalExecution,
    RequireUserConfirm,
    ToolResultDataDelta,
    ToolResultEnd,
    ToolResultStart,
    ToolResultTextDelta,
)
from .message import GenerateReason, ToolResultBlock, ToolResultState, ToolUseBlock
from .stream import Channel
from .tool.toolkit import PermissionDecision, Tool, ToolArgumentError, Toolkit, current_tool_call

if TYPE_CHECKING:
    from ._context import RuntimeContext
    from ._effects import ToolIntent

__all__ = ["INTERRUPTED_TEXT", "TOOL_CALL", "ToolExecutor", "ToolJournal", "ToolScope", "acting_events",
           "tool_output"]

TOOL_CALL: contextvars.ContextVar[tuple[ToolUseBlock, Channel] | None] = contextvars.ContextVar(
    "agentscope_tool_call", default=None)
"""The call a tool runs for and the channel of its events, set in the tool's own task: a sub-agent
tool keys its session and pending confirmations by the call id, and closes what its sub-agent left
open in the channel when it is cancelled."""


class ToolJournal(Protocol):
    """Where the intent and the result of each non-idempotent tool call are recorded."""

    @property
    def writes(self) -> bool:
        """Whether calls are journaled (else entries a resume settled are only replayed)."""
        ...

    def recorded(self, call_id: str) -> ToolIntent | None:
        """The call's entry, if any (with its result once it has one)."""
        ...

    async def intent(self, call: ToolUseBlock, tool: Tool) -> None:
        """Record the intent; returns once it is durable, else raises (the tool does not run)."""
        ...

    async def result(self, call: ToolUseBlock, block: ToolResultBlock) -> None:
        """Record the result of a call whose intent is recorded."""
        ...

    def drop(self, call_id: str) -> None:
        """Forget the intent of a call that paused before it took effect (it runs again)."""
        ...


@dataclass(slots=True, eq=False)
class ToolScope:
    """What the acting core knows of its run."""

    toolkit: Toolkit
    ctx: RuntimeContext
    reply_id: str
    control: RunControl
    """An interrupt cancels the tool tasks registered here."""
    preapproved: set[str]
    """Call ids the user confirmed: the gate lets them through without asking again."""
    started: int = 0
    """Tool calls started so far (`AgentRun.tool_calls`)."""
    paused: bool = False
    """A sub-agent call of this pass paused for a confirmation (`SubAgentPaused`): the pass ends
    the run with PERMISSION_ASKING."""
    executor: ToolExecutor | None = None
    """Runs a permitted tool's body in place of `tool_output` (`AgentRuntime.tool_executor`)."""
    journal: ToolJournal | None = None
    """Records non-idempotent calls (intent, result) and replays recorded results; None: none
    (a durable run journals in its own history)."""


ToolExecutor = Callable[[ToolScope, ToolUseBlock, Tool, Channel], Awaitable[None]]
"""What runs a permitted tool's body and hands its output to the channel as events, in place of
`tool_output` (a durable run makes it an activity); failures are handled by `_invoke` as for `tool_output`."""


async def _decide(scope: ToolScope, call: ToolUseBlock, tool: Tool) -> PermissionDecision:
    for check in (scope.toolkit.policy, tool.check_permissions):
        if check is None:
            continue
        decision = check(call, scope.ctx)
        if asyncio.iscoroutine(decision):
            decision = await decision
        decision = PermissionDecision(decision)
        if decision is not PermissionDecision.ALLOW:
            return decision
    return PermissionDecision.ALLOW


async def acting_events(
    scope: ToolScope, calls: Sequence[ToolUseBlock], context: contextvars.Context,
    deadline: Deadline | None = None,
) -> AsyncIterator[AgentEvent]:
    """The acting core's events: the permission gate, then the tools (in tasks made in
    ``context``, each keeping ``deadline`` or its tool's own timeout, the shorter)."""
    reply_id, toolkit = scope.reply_id, scope.toolkit
    allowed: list[ToolUseBlock] = []
    asking: list[ToolUseBlock] = []
    external: list[ToolUseBlock] = []
    denied: list[ToolUseBlock] = []
    for call in calls:
        tool = toolkit.get(call.name)
        if tool is None or call.raw_input is not None:
            allowed.append(call)  # becomes an error result the model sees
            continue
        if call.id in scope.preapproved or (toolkit.policy is None and tool.check_permissions is None):
            decision = PermissionDecision.ALLOW  # nothing to ask: no coroutine
        else:
            decision = await _decide(scope, call, tool)
        if decision is PermissionDecision.DENY:
            denied.append(call)
            for ev in result_events(
                reply_id, call, f"Permission denied: the call to {call.name} was not allowed.",
                ToolResultState.DENIED,
            ):
                yield ev
        elif decision is PermissionDecision.ASK:
            asking.append(call)
        elif tool.external:
            external.append(call)
        else:
            allowed.append(call)
    if denied and not (allowed or asking or external):
        yield AllToolsDenied(reply_id=reply_id, denied_tool_calls=denied)
        return
    for group in _groups(toolkit, allowed):
        it = _run_group(scope, group, context, deadline)
        try:
            async for ev in it:
                yield ev
        except BaseException:  # closed early: cancel the tool tasks before returning
            await it.aclose()
            raise
    if asking or scope.paused:
        if asking:
            yield RequireUserConfirm(reply_id=reply_id, tool_calls=asking)
        # (a paused sub-agent's own RequireUserConfirm reached the caller, with its source)
        scope.paused = False
        yield RequestStop(reason="waiting for the user to confirm tool calls",
                          generate_reason=GenerateReason.PERMISSION_ASKING)
    elif external:
        yield RequireExternalExecution(reply_id=reply_id, tool_calls=external)


def _groups(toolkit: Toolkit, calls: Sequence[ToolUseBlock]) -> list[list[ToolUseBlock]]:
    """The calls in runs that may go in parallel: contiguous concurrency-safe calls together, any
    other call alone (an unknown tool is safe: it only becomes an error result)."""
    groups: list[list[ToolUseBlock]] = []
    parallel = False
    for call in calls:
        tool = toolkit.get(call.name)
        safe = tool is None or tool.concurrency_safe
        if safe and parallel:
            groups[-1].append(call)
        else:
            groups.append([call])
        parallel = safe
    return groups


async def _run_group(
    scope: ToolScope, group: Sequence[ToolUseBlock], context: contextvars.Context, deadline: Deadline | None,
) -> AsyncGenerator[AgentEvent, None]:
    """The calls of one group, each in its own task; their events in call order.

    Each task registers itself with the run's control at its first step (`_run_tool`), not when
    it is made: an interrupt cancelling a task before that step would cancel it before any of its
    code ran, leaving its channel open (no result) and its consumer waiting on it for ever."""
    loop = asyncio.get_running_loop()
    journal = scope.journal
    writes = journal is not None and journal.writes
    channels = [Recording(256) if writes and journaled(scope.toolkit.get(call.name)) else Channel(256)
                for call in group]
    tasks = [loop.create_task(_run_tool(scope, call, ch, deadline), context=context.copy())
             for call, ch in zip(group, channels, strict=True)]
    try:
        for ch in channels:
            async for ev in ch.drain():
                yield ev
    finally:
        scope.control.tasks.difference_update(tasks)
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


async def _run_tool(scope: ToolScope, call: ToolUseBlock, channel: Channel, deadline: Deadline | None) -> None:
    """One call, its output streamed through ``channel`` as it comes."""
    reply_id, cid, name = scope.reply_id, call.id, call.name
    task = asyncio.current_task()
    assert task is not None
    # Registered here, in the same step that reads the interrupt flag below: an interrupt either
    # came before (the call ends interrupted, without running) or cancels this task.
    scope.control.tasks.add(task)
    scope.started += 1
    tool = scope.toolkit.get(name)
    # A tool's metadata (an MCP tool's server) goes on its call's brackets; most tools have none.
    # Passed only when there is some, so other tools' events stay exactly as they were.
    meta: dict[str, Any] = {"metadata": dict(tool.metadata)} if tool is not None and tool.metadata else {}
    # In this task's own context (nothing to reset): the tool can name its call, and a sub-agent
    # forwards its events straight into the call's channel.
    current_tool_call.set(call)
    TOOL_CALL.set((call, channel))
    journal = scope.journal
    if journal is not None:
        entry = journal.recorded(cid)
        if entry is not None:  # (a resumed run settled its calls in doubt first: `agent._in_doubt`)
            block = entry.result if entry.result is not None else ToolResultBlock(
                id=cid, name=name, output=UNSETTLED_TEXT, state=ToolResultState.ERROR)
            for ev in replay_events(reply_id, block, meta.get("metadata")):
                channel.push(ev)
            channel.finish(None)
            return
    recording = channel if type(channel) is Recording else None
    if recording is None:
        journal = None  # (not journaled: an idempotent tool, or a store that needs no journal)
    await channel.put(ToolResultStart(reply_id=reply_id, tool_call_id=cid, tool_name=name, **meta))
    error_text: str | None = INTERRUPTED_TEXT
    state = ToolResultState.INTERRUPTED
    if not scope.control.interrupted:  # (while the consumer held the Start, the tool never starts)
        try:
            state, error_text = await _invoke(scope, call, tool, channel, deadline, journal)
        except ToolInputRequired as exc:  # the call waits for the user, like an asking call
            if journal is not None:
                journal.drop(cid)
            ends = ToolResultEnd(reply_id=reply_id, tool_call_id=cid, tool_name=name,
                                 state=ToolResultState.RUNNING, **meta)
            question = {**meta.get("metadata", {}), "question": exc.question}
            channel.push(ends)
            channel.push(RequireUserConfirm(reply_id=reply_id, tool_calls=[call], metadata=question))
            channel.push(RequestStop(reason=f"waiting for the user's answer to {name}: {exc}",
                                     generate_reason=GenerateReason.PERMISSION_ASKING))
            channel.finish(None)
            return
    if journal is not None and recording is not None:
        if state is ToolResultState.SUCCESS or state is ToolResultState.ERROR:
            parts = recording.parts if error_text is None else [*recording.parts, error_text]
            block = ToolResultBlock(id=cid, name=name, output=join_output(parts), state=state)
            # A cancel is held until the result is written; then the call ends as it did (the run
            # sees the interrupt through its control).
            with contextlib.suppress(asyncio.CancelledError):
                await journal.result(call, block)
        elif state is ToolResultState.RUNNING:
            journal.drop(cid)  # its sub-agent asks the user: it runs again when answered
        elif journal.recorded(cid) is not None:  # interrupted after it started: the model must not assume
            error_text = INTERRUPTED_UNSURE_TEXT  # it did nothing (and call it again)
    # After a cancellation nobody may be reading: pushed without waiting for room.
    if error_text is not None:
        channel.push(ToolResultTextDelta(reply_id=reply_id, tool_call_id=cid, tool_name=name, delta=error_text))
    channel.push(ToolResultEnd(reply_id=reply_id, tool_call_id=cid, tool_name=name, state=state, **meta))
    channel.finish(None)


INTERRUPTED_TEXT = "The tool call was interrupted."


async def _invoke(
    scope: ToolScope, call: ToolUseBlock, tool: Tool | None, channel: Channel, deadline: Deadline | None,
    journal: ToolJournal | None = None,
) -> tuple[ToolResultState, str | None]:
    """Run the tool, handing its output to ``channel`` as events; every failure becomes the state
    and text of the result the model sees."""
    name = call.name
    limit = None if tool is None else tool.timeout
    by = ""  # who set the limit when it is not the tool's own timeout
    if deadline is not None and deadline.total is not None and (limit is None or deadline.total < limit):
        limit, by = deadline.total, f" ({deadline.by})"
    timer: DeadlineTimer | None = None
    try:
        if tool is None:
            available = ", ".join(scope.toolkit.names) or "none"
            raise ToolArgumentError(f"unknown tool {name!r}; available tools: {available}")
        if call.raw_input is not None:
            raise ToolArgumentError(f"the arguments for {name} are not a JSON object: "
                                    f"{arguments_problem(call.raw_input)}")
        if limit is not None:
            timer = DeadlineTimer(limit)  # kept in this task: it cancels the tool, not the run
        if journal is not None:
            await journal.intent(call, tool)  # durable before the tool runs; if it fails, the tool never runs
        await (tool_output if scope.executor is None else scope.executor)(scope, call, tool, channel)
    except (asyncio.CancelledError, AgentInterrupted):  # (a sub-agent interrupted with its caller)
        if timer is not None and timer.stop() and not scope.control.interrupted:
            return ToolResultState.ERROR, f"Error: {name} timed out after {limit:g} s{by}."
        return ToolResultState.INTERRUPTED, INTERRUPTED_TEXT
    except SubAgentPaused:
        # The call waits for its sub-agent's confirmation: no result yet (a "running" end closes
        # the bracket; the acting pass keeps the call pending and pauses the run).
        scope.paused = True
        return ToolResultState.RUNNING, None
    except ToolInputRequired:
        raise
    except TimeoutError as exc:  # raised by the tool itself
        return ToolResultState.ERROR, f"Error: TimeoutError: {exc}"
    except ToolArgumentError as exc:
        return ToolResultState.ERROR, clean(f"Error: {exc}")
    except Exception as exc:
        return ToolResultState.ERROR, clean(f"Error: {type(exc).__name__}: {exc}")
    finally:
        if timer is not None:
            timer.stop()
    return ToolResultState.SUCCESS, None


async def tool_output(scope: ToolScope, call: ToolUseBlock, tool: Tool, channel: Channel) -> None:
    reply_id, cid, name = scope.reply_id, call.id, call.name
    text_delta = delta_maker(ToolResultTextDelta, reply_id=reply_id, tool_call_id=cid, tool_name=name)
    if tool.kind != "stream":  # a tool that returns once (most): its chunks awaited directly, no generator
        for chunk in await tool.call_once(call.input, scope.ctx):
            await channel.put(_output_event(chunk, text_delta, reply_id, cid, name))
        return
    async for chunk in tool.run(call.input, scope.ctx):
        await channel.put(_output_event(chunk, text_delta, reply_id, cid, name))


def _output_event(chunk: Any, text_delta: Callable[[str], ToolResultTextDelta], reply_id: str, cid: str,
                  name: str) -> EventBase:
    if isinstance(chunk, EventBase):
        return chunk  # a sub-agent's events (they carry a source path), as they are
    if isinstance(chunk, str):
        # A tool's text enters the session here: made encodable (`_sanitize`), so no output can
        # poison it.
        return text_delta(clean(str(chunk)))
    return ToolResultDataDelta(reply_id=reply_id, tool_call_id=cid, tool_name=name, data=chunk)
