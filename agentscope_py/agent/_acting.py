"""The acting core: the permission gate, then the tools, as ToolResult* events.

Contiguous concurrency-safe calls run in parallel, each in its own task; their events are emitted
in call order (the first call's live, the others' as soon as their turn comes). A tool that
raises, times out, is unknown or gets invalid arguments produces an error result the model sees.
An interrupt cancels the tasks; each cancelled call ends with an INTERRUPTED result.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

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
from ..stream import _Channel
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
    if call.id in exe.preapproved:
        return PermissionDecision.ALLOW
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


async def acting_events(
    exe: Execution, calls: Sequence[ToolUseBlock], context: contextvars.Context | None = None
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
    # Closed with this generator, so an early close cancels the tool tasks before it returns.
    async with contextlib.aclosing(_execute(exe, allowed, context or contextvars.copy_context())) as run:  # type: ignore[type-var]
        async for ev in run:
            yield ev
    if asking:
        yield RequireUserConfirm(reply_id=reply_id, tool_calls=asking)
        yield RequestStop(reason="waiting for the user to confirm tool calls",
                          generate_reason=GenerateReason.PERMISSION_ASKING)
    elif external:
        yield RequireExternalExecution(reply_id=reply_id, tool_calls=external)


async def _execute(
    exe: Execution, calls: Sequence[ToolUseBlock], context: contextvars.Context
) -> AsyncIterator[AgentEvent]:
    i = 0
    while i < len(calls):
        group = [calls[i]]
        if _safe(exe, calls[i]):
            while i + len(group) < len(calls) and _safe(exe, calls[i + len(group)]):
                group.append(calls[i + len(group)])
        i += len(group)
        channels = [_Channel(256) for _ in group]
        tasks = [
            asyncio.get_running_loop().create_task(_run_tool(exe, call, ch), context=context.copy())
            for call, ch in zip(group, channels, strict=True)
        ]
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


async def _run_tool(exe: Execution, call: ToolUseBlock, channel: _Channel) -> None:
    reply_id, cid, name = exe.reply_id, call.id, call.name
    exe.tool_calls += 1
    state = ToolResultState.SUCCESS
    error_text: str | None = None
    await channel.put(_ToolResultStart(reply_id=reply_id, tool_call_id=cid, tool_name=name))
    try:
        tool = exe.toolkit.get(name)
        if tool is None:
            available = ", ".join(exe.toolkit.names) or "none"
            raise ToolArgumentError(f"unknown tool {name!r}; available tools: {available}")
        if call.raw_input is not None:
            raise ToolArgumentError(
                f"the arguments for {name} are not a JSON object: {call.raw_input[:500]!r}"
            )
        async with asyncio.timeout(tool.timeout):
            async for chunk in tool.run(call.input, exe.ctx):
                # A sub-agent's events (they carry a source path) are forwarded as they are.
                await channel.put(chunk if isinstance(chunk, EventBase) else _delta(reply_id, cid, name, chunk))
    except asyncio.CancelledError:
        state, error_text = ToolResultState.INTERRUPTED, "The tool call was interrupted."
    except TimeoutError:
        timeout = exe.toolkit.get(name).timeout  # type: ignore[union-attr]
        state, error_text = ToolResultState.ERROR, f"Error: {name} timed out after {timeout} s."
    except ToolArgumentError as exc:
        state, error_text = ToolResultState.ERROR, f"Error: {exc}"
    except Exception as exc:
        state, error_text = ToolResultState.ERROR, f"Error: {type(exc).__name__}: {exc}"
    # After a cancellation nobody may be reading: append without waiting for room.
    if error_text is not None:
        channel.items.append(_ToolResultTextDelta(reply_id=reply_id, tool_call_id=cid, tool_name=name,
                                                  delta=error_text))
    channel.items.append(_ToolResultEnd(reply_id=reply_id, tool_call_id=cid, tool_name=name, state=state))
    channel.finish(None)


def _delta(reply_id: str, cid: str, name: str, chunk: Any) -> AgentEvent:
    if type(chunk) is str:
        return _ToolResultTextDelta(reply_id=reply_id, tool_call_id=cid, tool_name=name, delta=chunk)
    if isinstance(chunk, str):
        return ToolResultTextDelta(reply_id=reply_id, tool_call_id=cid, tool_name=name, delta=chunk)
    return ToolResultDataDelta(reply_id=reply_id, tool_call_id=cid, tool_name=name, data=chunk)
