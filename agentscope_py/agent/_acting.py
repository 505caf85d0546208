"""The acting core: the permission gate, then the tools, as ToolResult* events.

Contiguous concurrency-safe calls run in parallel, each in its own task; their events are emitted
in call order (the first call's live, the others' as soon as their turn comes). A tool that
raises, times out, is unknown or gets invalid arguments produces an error result the model sees.
An interrupt cancels the tasks; each cancelled call ends with an INTERRUPTED result.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Generator, Sequence
from typing import TYPE_CHECKING, Any, cast

from .._sanitize import MAX_DEPTH, clean
from ..events import (
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
    trusted,
)
from ..message import GenerateReason, ToolResultState, ToolUseBlock
from ..stream import Channel
from ..tool.toolkit import PermissionDecision, Tool, ToolArgumentError
from ._reply import result_events

if TYPE_CHECKING:
    from ._loop import Execution

__all__ = ["acting_events"]


# Result events of values made here skip validation (`events.trusted`: the same objects).
_ToolResultStart = trusted(ToolResultStart, "reply_id", "tool_call_id", "tool_name")
_ToolResultTextDelta = trusted(ToolResultTextDelta, "reply_id", "tool_call_id", "tool_name", "delta")
_ToolResultEnd = trusted(ToolResultEnd, "reply_id", "tool_call_id", "tool_name", "state")


async def _decide(exe: Execution, call: ToolUseBlock, tool: Tool) -> PermissionDecision:
    for check in (exe.toolkit.policy, tool.check_permissions):
        if check is None:
            continue
        decision = check(call, exe.ctx)
        if asyncio.iscoroutine(decision):
            decision = await decision
        decision = PermissionDecision(decision)
        if decision is not PermissionDecision.ALLOW:
            return decision
    return PermissionDecision.ALLOW


def acting_events(
    exe: Execution, calls: Sequence[ToolUseBlock], context: contextvars.Context | None = None
) -> AsyncIterator[AgentEvent]:
    """The acting core's events: the permission gate, then the tools."""
    context = context or contextvars.copy_context()
    if len(calls) == 1 and not exe.toolkit.policy:
        tool = exe.toolkit.get(calls[0].name)
        if tool is not None and tool.check_permissions is None and not tool.external:
            single = _single(exe, calls, context)  # nothing to ask or decide: straight to the tool
            if single is not None:
                return single
    return _gate_and_run(exe, calls, context)


async def _gate_and_run(
    exe: Execution, calls: Sequence[ToolUseBlock], context: contextvars.Context
) -> AsyncIterator[AgentEvent]:
    reply_id = exe.reply_id
    allowed: list[ToolUseBlock] = []
    asking: list[ToolUseBlock] = []
    external: list[ToolUseBlock] = []
    denied: list[ToolUseBlock] = []
    for call in calls:
        tool = exe.toolkit.get(call.name)
        if tool is None or call.raw_input is not None:
            allowed.append(call)  # becomes an error result the model sees
            continue
        if call.id in exe.preapproved or (exe.toolkit.policy is None and tool.check_permissions is None):
            decision = PermissionDecision.ALLOW  # nothing to ask: no coroutine
        else:
            decision = await _decide(exe, call, tool)
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
    if allowed:
        it = _execute(exe, allowed, context)
        try:
            async for ev in it:
                yield ev
        except BaseException:  # closed early: cancel the tool tasks before returning
            await it.aclose()
            raise
    if asking:
        yield RequireUserConfirm(reply_id=reply_id, tool_calls=asking)
        yield RequestStop(reason="waiting for the user to confirm tool calls",
                          generate_reason=GenerateReason.PERMISSION_ASKING)
    elif external:
        yield RequireExternalExecution(reply_id=reply_id, tool_calls=external)


async def _execute(
    exe: Execution, calls: Sequence[ToolUseBlock], context: contextvars.Context
) -> AsyncGenerator[AgentEvent, None]:
    loop = asyncio.get_running_loop()
    i = 0
    while i < len(calls):
        group = [calls[i]]
        if _safe(exe, calls[i]):
            while i + len(group) < len(calls) and _safe(exe, calls[i + len(group)]):
                group.append(calls[i + len(group)])
        i += len(group)
        single = _single(exe, group, context)
        if single is not None:
            try:
                async for ev in single:
                    yield ev
            except BaseException:
                await single.aclose()
                raise
            continue
        channels = [Channel(256) for _ in group]
        tasks = [loop.create_task(_run_tool(exe, call, ch), context=context.copy())
                 for call, ch in zip(group, channels, strict=True)]
        exe.control.tasks.update(tasks)
        try:
            for ch in channels:
                async for ev in ch.drain():
                    yield ev
        finally:
            exe.control.tasks.difference_update(tasks)
            pending = [t for t in tasks if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)


def _safe(exe: Execution, call: ToolUseBlock) -> bool:
    tool = exe.toolkit.get(call.name)
    return tool is None or tool.concurrency_safe


def _single(
    exe: Execution, calls: Sequence[ToolUseBlock], context: contextvars.Context
) -> AsyncGenerator[AgentEvent, None] | None:
    """The steps of a lone call to a tool that returns once, or None (see `_run_single`)."""
    if len(calls) != 1:
        return None
    call = calls[0]
    tool = exe.toolkit.get(call.name)
    if tool is None or tool.kind == "stream" or call.raw_input is not None:
        return None
    return _run_single(exe, call, tool, context)


async def _run_single(
    exe: Execution, call: ToolUseBlock, tool: Tool, context: contextvars.Context
) -> AsyncGenerator[AgentEvent, None]:
    """One call of a tool that returns once (not a generator), run inline in this task, in its own
    copy of ``context``: no task and no loop turn for a quick tool. The tool starts when the event
    after ToolResultStart is asked for, and runs only while this stream is awaited, as a plain
    ``await`` would (so a timeout the tool sets cancels what it should). While it runs, an
    interrupt cancels this task: the tool ends with an INTERRUPTED result and the cancellation is
    taken back."""
    reply_id, cid, name = exe.reply_id, call.id, call.name
    exe.tool_calls += 1
    control = exe.control
    yield _ToolResultStart(reply_id=reply_id, tool_call_id=cid, tool_name=name)
    output: list[Any] = []
    if control.interrupted:  # while the consumer held the Start: the tool never starts
        state, error_text = ToolResultState.INTERRUPTED, INTERRUPTED_TEXT
    else:
        current = asyncio.current_task()
        assert current is not None
        cancels = current.cancelling()
        control.tasks.add(current)
        try:
            run = _Inline(context.copy(), _invoke(exe, call, tool, output))
            if not run.done:
                await run
        finally:
            control.tasks.discard(current)
            if control.interrupted and current.cancelling() > cancels:
                current.uncancel()  # the interrupt's cancellation: the tool's result reports it
        if current.cancelling() > cancels:
            # Cancelling this task reached the tool, which ended with a result instead of
            # raising: the cancellation is this stream's, so it goes on.
            raise asyncio.CancelledError
        state, error_text = run.result
    for chunk in output:
        yield cast(AgentEvent, chunk) if isinstance(chunk, EventBase) else _delta(reply_id, cid, name, chunk)
    if error_text is not None:
        yield _ToolResultTextDelta(reply_id=reply_id, tool_call_id=cid, tool_name=name, delta=error_text)
    yield _ToolResultEnd(reply_id=reply_id, tool_call_id=cid, tool_name=name, state=state)


class _Inline:
    """Runs a coroutine in the current task with every step inside ``ctx`` (a task's isolation,
    without the task): the first step runs at construction; awaiting runs the rest, handing the
    future it waits on to the current task, as a plain ``await`` would."""

    __slots__ = ("coro", "ctx", "done", "pending", "result")

    def __init__(self, ctx: contextvars.Context, coro: Coroutine[Any, Any, Any]) -> None:
        self.ctx = ctx
        self.coro = coro
        self.done = False
        self.result: Any = None
        self.pending: Any = None  # what the coroutine waits on (a future), handed to the task
        self._step(coro.send, None)

    def _step(self, fn: Callable[[Any], Any], arg: Any) -> None:
        try:
            self.pending = self.ctx.run(fn, arg)
        except StopIteration as stop:
            self.done, self.result, self.pending = True, stop.value, None

    def __await__(self) -> Generator[Any, Any, Any]:
        while not self.done:
            try:
                value = yield self.pending
            except BaseException as exc:
                self._step(self.coro.throw, exc)
            else:
                self._step(self.coro.send, value)
        return self.result


async def _run_tool(exe: Execution, call: ToolUseBlock, channel: Channel) -> None:
    """A call whose output is streamed as it comes (a generator tool, or one of a parallel
    group), through ``channel``."""
    reply_id, cid, name = exe.reply_id, call.id, call.name
    exe.tool_calls += 1
    await channel.put(_ToolResultStart(reply_id=reply_id, tool_call_id=cid, tool_name=name))
    state, error_text = await _invoke(exe, call, exe.toolkit.get(name), channel)
    # After a cancellation nobody may be reading: append without waiting for room.
    if error_text is not None:
        channel.items.append(_ToolResultTextDelta(reply_id=reply_id, tool_call_id=cid, tool_name=name,
                                                  delta=error_text))
    channel.items.append(_ToolResultEnd(reply_id=reply_id, tool_call_id=cid, tool_name=name, state=state))
    channel.finish(None)


INTERRUPTED_TEXT = "The tool call was interrupted."


async def _invoke(
    exe: Execution, call: ToolUseBlock, tool: Tool | None, sink: Channel | list[Any]
) -> tuple[ToolResultState, str | None]:
    """Run the tool, handing its output to ``sink`` (as events for a channel, raw for a list);
    every failure becomes the state and text of the result the model sees."""
    name = call.name
    try:
        if tool is None:
            available = ", ".join(exe.toolkit.names) or "none"
            raise ToolArgumentError(f"unknown tool {name!r}; available tools: {available}")
        if call.raw_input is not None:
            raise ToolArgumentError(f"the arguments for {name} are not a JSON object (nested at most "
                                    f"{MAX_DEPTH} levels): {call.raw_input[:500]!r}")
        if tool.timeout is None:
            await _output(exe, call, tool, sink)
        else:
            async with asyncio.timeout(tool.timeout):
                await _output(exe, call, tool, sink)
    except asyncio.CancelledError:
        return ToolResultState.INTERRUPTED, INTERRUPTED_TEXT
    except TimeoutError as exc:
        if tool is None or tool.timeout is None:  # raised by the tool itself
            return ToolResultState.ERROR, f"Error: TimeoutError: {exc}"
        return ToolResultState.ERROR, f"Error: {name} timed out after {tool.timeout} s."
    except ToolArgumentError as exc:
        return ToolResultState.ERROR, clean(f"Error: {exc}")
    except Exception as exc:
        return ToolResultState.ERROR, clean(f"Error: {type(exc).__name__}: {exc}")
    return ToolResultState.SUCCESS, None


async def _output(exe: Execution, call: ToolUseBlock, tool: Tool, sink: Channel | list[Any]) -> None:
    if type(sink) is list:
        sink.extend(await tool.call_once(call.input, exe.ctx))
        return
    assert isinstance(sink, Channel)
    reply_id, cid, name = exe.reply_id, call.id, call.name
    async for chunk in tool.run(call.input, exe.ctx):
        # A sub-agent's events (they carry a source path) are forwarded as they are.
        await sink.put(chunk if isinstance(chunk, EventBase) else _delta(reply_id, cid, name, chunk))


def _delta(reply_id: str, cid: str, name: str, chunk: Any) -> AgentEvent:
    # A tool's text enters the session here: made encodable (`_sanitize`), so no output can poison it.
    if type(chunk) is str:
        return _ToolResultTextDelta(reply_id=reply_id, tool_call_id=cid, tool_name=name, delta=clean(chunk))
    if isinstance(chunk, str):
        return ToolResultTextDelta(reply_id=reply_id, tool_call_id=cid, tool_name=name, delta=clean(str(chunk)))
    return ToolResultDataDelta(reply_id=reply_id, tool_call_id=cid, tool_name=name, data=chunk)
