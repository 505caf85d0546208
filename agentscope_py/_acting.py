"""The acting core: the permission gate, then the tools, as ToolResult* events.

Every tool call runs in a task of its own, made in the context current inside the innermost
``next()`` (so a span an acting middleware opened parents it): a tool that cancels "its" task
ends only itself, with its own context copy and timeout. The acting pass is one generator that
opens each call with its ToolResultStart and reads the call's task in one of two shapes:

- a tool that returns once (most tools; also a call that only becomes an error result): the
  task hands the pass the call's other events as one list, through a future the pass awaits;
- a generator tool, or a call a `ToolExecutor` runs (a durable run's activity): the task streams
  its events through a `Channel` the pass drains as they come (a sub-agent forwards its own
  events into it: `TOOL_CALL`).

A call's task takes its first step at the next loop turn, or (Python 3.12+, `_starting`) as soon
as the consumer takes the next event after its ToolResultStart if that comes first: a consumer
that awaits while it holds the Start has the tool running meanwhile, and one that does not has,
on 3.12+, a tool that returns without waiting done with no loop turn (on 3.11, in one: the pass
lets that turn come before it waits for the result). The first step reads the interrupt flag: an
interrupt while the consumer handles the Start (without awaiting) means the tool never runs.
Contiguous concurrency-safe calls run in parallel, their events in call order (the first call's
as they come, the others' when their turn comes).
A tool that raises, times out, is unknown or gets invalid arguments produces an error result the
model sees. An interrupt cancels the tasks (never the run's own task); each cancelled call ends
with an INTERRUPTED result, and the loop then raises `AgentInterrupted`.

A non-idempotent tool's call is journaled when the run has a `ToolJournal` (`_recorded`): its
intent is recorded (durably) before the tool runs, its result after, and a call whose result is
recorded is replayed instead of run (a resumed run; `agentscope_py.agent._journal`).

The acting core sees its run only through a `ToolScope`.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from ._control import RunControl
from ._deadline import Deadline, DeadlineTimer, tool_timeout_text
from ._recorded import Recording, ToolJournal, journaled, output_parts, replay_events, settle
from ._replies import arguments_problem, result_end, result_events, result_of, result_start, result_text
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
    ToolResultTextDelta,
)
from .message import DataBlock, GenerateReason, ToolResultBlock, ToolResultState, ToolUseBlock
from .stream import Channel, EventStream
from .tool.toolkit import PermissionDecision, Tool, ToolArgumentError, Toolkit, current_tool_call

if TYPE_CHECKING:
    from ._context import RuntimeContext

__all__ = [
    "INTERRUPTED_TEXT", "TOOL_CALL", "ActingPass", "ActingReader", "ToolExecutor", "ToolScope", "acting_events",
    "read_passed", "tool_output",
]

# The enum members every acting pass reads, read from their classes once (an attribute read on an
# Enum class takes the slow path of EnumType's ``__getattr__`` on Python 3.11: `agent._loop`).
_ALLOW, _DENY, _ASK = PermissionDecision.ALLOW, PermissionDecision.DENY, PermissionDecision.ASK
_SUCCESS, _ERROR, _INTERRUPTED, _RUNNING = (
    ToolResultState.SUCCESS, ToolResultState.ERROR, ToolResultState.INTERRUPTED, ToolResultState.RUNNING)

TOOL_CALL: contextvars.ContextVar[tuple[ToolUseBlock, Channel] | None] = contextvars.ContextVar(
    "agentscope_tool_call", default=None)
"""The call a tool runs for and the channel of its events, set in the task of a call that streams
(a generator tool, as a sub-agent tool is): a sub-agent tool keys its session and pending
confirmations by the call id, and closes what its sub-agent left open in the channel when it is
cancelled."""


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
        if decision is not _ALLOW:
            return decision
    return _ALLOW


class ActingReader(Protocol):
    """What reads an acting pass's events when nothing stands between the pass and it (the agent
    loop's `NextStepAct`, when no hook wraps the acting core): the pass hands it each event as it
    yields it (`add`), and a call's result whole (`result`) when the call's task returned its
    output and end at once, rather than the events it would be rebuilt from."""

    def add(self, ev: Any) -> None: ...

    def result(self, block: ToolResultBlock) -> None: ...


async def acting_events(
    scope: ToolScope, calls: Sequence[ToolUseBlock], context: contextvars.Context,
    deadline: Deadline | None = None, reader: ActingReader | None = None,
) -> AsyncIterator[AgentEvent]:
    """The acting core's events: the permission gate, then the tools (in tasks made in
    ``context``, each keeping ``deadline`` or its tool's own timeout, the shorter). ``reader``:
    what reads the events next, handed what they carry by the pass itself (`ActingReader`)."""
    reply_id, toolkit = scope.reply_id, scope.toolkit
    # The permitted calls in runs that may go in parallel: contiguous concurrency-safe calls
    # together, any other call alone (an unknown tool is safe: it only becomes an error result).
    groups: list[list[tuple[ToolUseBlock, Tool | None]]] = []
    parallel = False
    asking: list[ToolUseBlock] = []
    external: list[ToolUseBlock] = []
    denied: list[ToolUseBlock] = []
    for call in calls:
        fields = call.__dict__  # (its fields dict, as `ToolResultCollector.add` reads an event's)
        tool = toolkit.get(fields["name"])
        if tool is not None and fields["raw_input"] is None:  # (else an error result the model sees)
            if fields["id"] in scope.preapproved or (toolkit.policy is None and tool.check_permissions is None):
                decision = _ALLOW  # nothing to ask: no coroutine
            else:
                decision = await _decide(scope, call, tool)
            if decision is _DENY:
                denied.append(call)
                text = f"Permission denied: the call to {call.name} was not allowed."
                for ev in result_events(reply_id, call, text, ToolResultState.DENIED):
                    if reader is not None:
                        reader.add(ev)
                    yield ev
                continue
            if decision is _ASK:
                asking.append(call)
                continue
            if tool.external:
                external.append(call)
                continue
        safe = tool is None or tool.concurrency_safe
        if safe and parallel:
            groups[-1].append((call, tool))
        else:
            groups.append([(call, tool)])
        parallel = safe
    if denied and not (groups or asking or external):
        yield _read(reader, AllToolsDenied(reply_id=reply_id, denied_tool_calls=denied))
        return
    for group in groups:
        runs: list[_Call] = []
        for call, tool in group:
            runs.append(_Call(scope, call, tool))
        starting = _starting(scope, runs, context, deadline)
        try:
            for run in runs:
                out = run.output
                # (a call whose result comes whole hands the reader that result, not its Start)
                opening = reader if reader is not None and not isinstance(out, asyncio.Future) else None
                for ev in run.opening:
                    if opening is not None:
                        opening.add(ev)
                    yield ev
                if starting is not None:  # the consumer took the first Start before the loop turned
                    starting = None  # (its callback then finds every task made: nothing to do)
                    _start(scope, runs, context, deadline)
                if isinstance(out, Channel):
                    async for ev in out.drain():
                        if reader is not None:
                            reader.add(ev)
                        yield ev
                elif out is not None:  # (None: a recorded result, replayed)
                    if _EAGER_START is None and not out.done():
                        # Python 3.11: the call's task takes its first step at the next loop turn
                        # (`_starting`). The pass lets that turn come before it waits, so a tool
                        # that returns without waiting is done when the pass looks again: no second
                        # turn only to wake the pass.
                        await asyncio.sleep(0)
                    events = await out
                    block = None if reader is None else _whole(events)
                    if block is None or reader is None:
                        for ev in events:
                            if reader is not None:
                                reader.add(ev)
                            yield ev
                    else:
                        for ev in events[:-1]:
                            yield ev
                        reader.result(block)  # (as the end's reader would have, before the end goes out)
                        yield events[-1]
        except BaseException:  # closed early, or cancelled: cancel the tool tasks before returning
            pending = [run.task for run in runs if run.task is not None and not run.task.done()]
            if starting is not None:
                runs.clear()  # its callback, still to come, starts nothing this pass closed
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            raise
    if asking or scope.paused:
        # External calls of the round wait beside the asking ones, announced first as under
        # `HumanApprovalMiddleware`: whichever the client answers first, the other calls still wait.
        if external:
            yield _read(reader, RequireExternalExecution(reply_id=reply_id, tool_calls=external))
        if asking:
            yield _read(reader, RequireUserConfirm(reply_id=reply_id, tool_calls=asking))
        # (a paused sub-agent's own RequireUserConfirm reached the caller, with its source)
        scope.paused = False
        yield _read(reader, RequestStop(reason="waiting for the user to confirm tool calls",
                                        generate_reason=GenerateReason.PERMISSION_ASKING))
    elif external:
        yield _read(reader, RequireExternalExecution(reply_id=reply_id, tool_calls=external))


def _read(reader: ActingReader | None, ev: AgentEvent) -> AgentEvent:
    """``ev``, handed to ``reader`` first."""
    if reader is not None:
        reader.add(ev)
    return ev


def _whole(events: list[AgentEvent]) -> ToolResultBlock | None:
    """The result a call's events from its task carry, when they are its own output deltas and its
    end; None for any other list (a call that paused or asks the user, a tool that returned
    events of its own), which its reader reads event by event."""
    end = events[-1] if events else None
    if type(end) is not ToolResultEnd:
        return None
    ended = end.__dict__  # (the events' fields dicts, as `ToolResultCollector.add` reads them)
    state, call_id = ended["state"], ended["tool_call_id"]
    if state is _RUNNING or ended["source"] is not None:
        return None
    parts: list[str | DataBlock] = []
    for ev in events[:-1]:
        kind = type(ev)
        if kind is not ToolResultTextDelta and kind is not ToolResultDataDelta:
            return None
        fields = ev.__dict__
        if fields["source"] is not None or fields["tool_call_id"] != call_id:
            return None
        parts.append(fields["delta"] if kind is ToolResultTextDelta else fields["data"])
    return result_of(call_id, ended["tool_name"], parts, state)


class ActingPass:
    """The factory of the acting core's stream (for the ``on_acting`` chain to compose): each
    subscription is an `acting_events` pass over ``calls``, its tools' tasks made in ``context``
    (captured when the core was built, inside the innermost ``next()``)."""

    __slots__ = ("calls", "context", "deadline", "scope")

    def __init__(self, scope: ToolScope, calls: Sequence[ToolUseBlock], context: contextvars.Context,
                 deadline: Deadline | None) -> None:
        self.scope = scope
        self.calls = calls
        self.context = context
        self.deadline = deadline

    def __call__(self, reader: ActingReader | None = None) -> AsyncIterator[AgentEvent]:
        return acting_events(self.scope, self.calls, self.context, self.deadline, reader)


def read_passed(stream: object, reader: ActingReader) -> AsyncIterator[AgentEvent] | None:
    """The acting core's own stream (`ActingPass`) that came back from the ``on_acting`` hooks as
    it was (passed through: no operator added, not wrapped), subscribed by ``reader``, which the
    pass then hands what its events carry (`ActingReader`). None for any other stream."""
    if type(stream) is EventStream and not stream._steps and type(stream._factory) is ActingPass:
        return stream._factory(reader)
    return None


_EAGER_START: Callable[..., asyncio.Task[Any]] | None = getattr(asyncio, "eager_task_factory", None)
"""What `_start` makes a call's task with, where there is one (Python 3.12+): its first step runs
at once, as the task (asyncio swaps the current task) in its own context, so a tool that returns
without waiting is done with no loop turn. None (Python 3.11: no public eager start): the loop's
task factory, the first step in a later loop turn."""


def _starting(scope: ToolScope, runs: list[_Call], context: contextvars.Context,
              deadline: Deadline | None) -> asyncio.Handle | None:
    """Have a group's tasks take their first step at the next loop turn, before its first Start
    goes out. Python 3.11: the tasks are made now (a task's first step is that turn). Python
    3.12+: `_start` is called back then, unless the pass calls it first, when the consumer takes
    the next event without having awaited: their first steps run at once, eagerly, the pass's
    ``next()`` waiting for no loop turn. The handle is never cancelled (the callback finds the
    tasks made, or ``runs`` emptied by a pass that closed): Temporal's workflow loop runs a
    cancelled handle as it runs any other, and a cancelled handle has no callback left."""
    if _EAGER_START is None:
        _start(scope, runs, context, deadline)
        return None
    return asyncio.get_running_loop().call_soon(_start, scope, runs, context, deadline)


def _start(scope: ToolScope, runs: list[_Call], context: contextvars.Context, deadline: Deadline | None) -> None:
    """Make the tasks of a group of calls that have none yet."""
    loop, eager = asyncio.get_running_loop(), _EAGER_START
    for run in runs:
        if run.output is not None and run.task is None:  # (no output: a recorded result, replayed)
            coro = _run_tool(scope, run, deadline)
            run.task = (loop.create_task(coro, context=context.copy()) if eager is None
                        else eager(loop, coro, context=context.copy()))


class _Call:
    """One permitted call of the pass: the events it opens with, its task (`_starting`), and where
    the pass reads its events (the result it awaits, or the channel it drains; neither: replayed)."""

    __slots__ = ("call", "journal", "meta", "opening", "output", "task", "tool")

    def __init__(self, scope: ToolScope, call: ToolUseBlock, tool: Tool | None) -> None:
        self.call = call
        self.tool = tool
        # A tool's metadata (an MCP tool's server) goes on its call's brackets; most tools have none.
        # Passed only when there is some, so other tools' events stay exactly as they were.
        meta: dict[str, Any] = {"metadata": dict(tool.metadata)} if tool is not None and tool.metadata else {}
        self.meta = meta
        self.task: asyncio.Task[None] | None = None
        self.output: asyncio.Future[list[AgentEvent]] | Channel | None = None
        scope.started += 1
        journal = scope.journal
        self.journal: ToolJournal | None = None
        if journal is not None:
            entry = journal.recorded(call.id)
            if entry is not None:  # (a resumed run settled its calls in doubt first: `agent._in_doubt`)
                self.opening: Sequence[AgentEvent] = replay_events(scope.reply_id, call, entry, meta.get("metadata"))
                return
            if journal.writes and journaled(tool):
                self.journal = journal  # (else an idempotent tool, or a store that needs no journal)
        # Its events are made once each from its typed ids (exact str), not validated, as
        # `ToolResultCollector` makes results; ids a middleware derived untyped are validated.
        self.opening = (result_start(scope.reply_id, call, meta),)
        if tool is not None and (tool.kind == "stream" or scope.executor is not None):
            self.output = Recording(256) if self.journal is not None else Channel(256)
        else:
            self.output = asyncio.get_running_loop().create_future()


async def _run_tool(scope: ToolScope, run: _Call, deadline: Deadline | None) -> None:
    """One call in its own task: its events, handed to the pass (through its channel or future).

    The task registers itself with the run's control at its first step, the one that reads the
    interrupt flag, not when it is made (cancelled before any of its code ran, it would leave the
    pass waiting for ever): an interrupt either came before (the tool never runs) or cancels it."""
    call, out = run.call, run.output
    channel = out if isinstance(out, Channel) else None
    task = run.task or asyncio.current_task()  # (an eager first step runs before `_start` has the task)
    assert task is not None
    tasks = scope.control.tasks
    tasks.add(task)
    # In this task's own context (nothing to reset): the tool can name its call, and a sub-agent
    # forwards its events straight into the call's channel.
    current_tool_call.set(call)
    if channel is not None:
        TOOL_CALL.set((call, channel))
    journal = run.journal
    state = _INTERRUPTED
    error_text: str | None = INTERRUPTED_TEXT
    events: list[AgentEvent] = []
    try:
        if not scope.control.interrupted:  # (interrupted before this first step: the tool never runs)
            state, error_text, chunks = await _invoke(scope, call, run.tool, channel, deadline, task, journal)
            if chunks:
                events = _output_at_once(scope.reply_id, run, chunks)
        if journal is not None:
            parts = channel.parts if isinstance(channel, Recording) else output_parts(events)
            error_text = await settle(journal, call, state, error_text, parts)
        _end(events, scope.reply_id, run, state, error_text)
    except ToolInputRequired as exc:  # the call waits for the user, like an asking call
        if journal is not None:
            journal.drop(call.id)
        events = _asking(scope.reply_id, call, run.meta, exc)
    except BaseException as exc:  # (not the tool's failure, which is its result): the pass raises it
        tasks.discard(task)
        _hand(out, [], exc)
        if not isinstance(exc, Exception):
            raise
        return
    tasks.discard(task)
    _hand(out, events, None)


def _hand(out: asyncio.Future[list[AgentEvent]] | Channel | None, events: list[AgentEvent],
          error: BaseException | None) -> None:
    """Give the pass a call's last events, or the error that ended its task. After a cancellation
    nobody may be reading the channel: pushed without waiting for room."""
    if isinstance(out, Channel):
        for ev in events:
            out.push(ev)
        out.finish(error)
    elif out is not None and not out.done():  # (the pass stopped waiting: cancelled)
        if error is None:
            out.set_result(events)
        else:
            out.set_exception(error)


def _end(events: list[AgentEvent], reply_id: str, run: _Call, state: ToolResultState, error_text: str | None) -> None:
    """Add a call's last events to ``events``: its error text, if any, and its end."""
    if error_text is not None:
        events.append(result_text(reply_id, run.call, error_text))
    events.append(result_end(reply_id, run.call, state, run.meta))


def _asking(reply_id: str, call: ToolUseBlock, meta: dict[str, Any], exc: ToolInputRequired) -> list[AgentEvent]:
    """A call that asks the user (`ToolInputRequired`): it ends running, and the run waits for the answer."""
    name = call.name
    question = {**meta.get("metadata", {}), "question": exc.question}
    return [
        result_end(reply_id, call, _RUNNING, meta),
        RequireUserConfirm(reply_id=reply_id, tool_calls=[call], metadata=question),
        RequestStop(reason=f"waiting for the user's answer to {name}: {exc}",
                    generate_reason=GenerateReason.PERMISSION_ASKING),
    ]


INTERRUPTED_TEXT = "The tool call was interrupted."


async def _invoke(
    scope: ToolScope, call: ToolUseBlock, tool: Tool | None, channel: Channel | None, deadline: Deadline | None,
    task: asyncio.Task[Any], journal: ToolJournal | None = None,
) -> tuple[ToolResultState, str | None, tuple[Any, ...]]:
    """Run the tool, in ``task`` (the call's own, which a timeout cancels): with a ``channel``, its
    output goes there as events; without, it returns once (`Tool.call_once`) and its chunks are
    returned. Every failure becomes the state and text of the result the model sees."""
    fields = call.__dict__
    name, raw_input = fields["name"], fields["raw_input"]
    limit = None if tool is None else tool.timeout
    if deadline is not None and deadline.total is not None and (limit is None or deadline.total < limit):
        limit = deadline.total  # (a timeout's error then names who set it: ``deadline.by``)
    else:
        deadline = None  # the tool's own timeout counts, if any
    timer: DeadlineTimer | None = None
    chunks: tuple[Any, ...] = ()
    try:
        if tool is None:
            available = ", ".join(scope.toolkit.names) or "none"
            raise ToolArgumentError(f"unknown tool {name!r}; available tools: {available}")
        if raw_input is not None:
            raise ToolArgumentError(f"the arguments for {name} are not a JSON object: "
                                    f"{arguments_problem(raw_input)}")
        if limit is not None:
            timer = DeadlineTimer(limit, None, task)  # it cancels the tool, not the run
        if journal is not None:
            await journal.intent(call, tool)  # durable before the tool runs; if it fails, the tool never runs
        if channel is None:
            chunks = await tool.call_once(fields["input"], scope.ctx)
        else:
            await (tool_output if scope.executor is None else scope.executor)(scope, call, tool, channel)
    except (asyncio.CancelledError, AgentInterrupted):  # (a sub-agent interrupted with its caller)
        if timer is not None and limit is not None and timer.stop() and not scope.control.interrupted:
            return _ERROR, tool_timeout_text(name, limit, None if deadline is None else deadline.by), ()
        return _INTERRUPTED, INTERRUPTED_TEXT, ()
    except SubAgentPaused:
        # The call waits for its sub-agent's confirmation: no result yet (a "running" end closes
        # the bracket; the acting pass keeps the call pending and pauses the run).
        scope.paused = True
        return _RUNNING, None, ()
    except ToolInputRequired:
        raise
    except TimeoutError as exc:  # raised by the tool itself
        return _ERROR, f"Error: TimeoutError: {exc}", ()
    except ToolArgumentError as exc:
        return _ERROR, clean(f"Error: {exc}"), ()
    except Exception as exc:
        return _ERROR, clean(f"Error: {type(exc).__name__}: {exc}"), ()
    finally:
        if timer is not None:
            timer.stop()
    return _SUCCESS, None, chunks


async def tool_output(scope: ToolScope, call: ToolUseBlock, tool: Tool, channel: Channel) -> None:
    reply_id, cid, name = scope.reply_id, call.id, call.name
    text_delta = delta_maker(ToolResultTextDelta, reply_id=reply_id, tool_call_id=cid, tool_name=name)
    if tool.kind != "stream":  # a tool that returns once (most): its chunks awaited directly, no generator
        for chunk in await tool.call_once(call.input, scope.ctx):
            await channel.put(_output_event(chunk, text_delta, reply_id, cid, name))
        return
    async for chunk in tool.run(call.input, scope.ctx):
        await channel.put(_output_event(chunk, text_delta, reply_id, cid, name))


def _output_at_once(reply_id: str, run: _Call, chunks: tuple[Any, ...]) -> list[AgentEvent]:
    """The events of a tool's output that came at once, made one each (a `delta_maker` serves a
    stream's many deltas)."""
    call = run.call
    fields = call.__dict__
    cid, name = fields["id"], fields["name"]

    def text_delta(delta: str) -> ToolResultTextDelta:
        return result_text(reply_id, call, delta)

    return [_output_event(chunk, text_delta, reply_id, cid, name) for chunk in chunks]


def _output_event(chunk: Any, text_delta: Callable[[str], ToolResultTextDelta], reply_id: str, cid: str,
                  name: str) -> AgentEvent:
    if isinstance(chunk, EventBase):
        return cast("AgentEvent", chunk)  # a sub-agent's events (they carry a source path), as they are
    if isinstance(chunk, str):
        # A tool's text enters the session here: made encodable (`_sanitize`), so no output can
        # poison it.
        return text_delta(clean(str(chunk)))
    return ToolResultDataDelta(reply_id=reply_id, tool_call_id=cid, tool_name=name, data=chunk)
