"""The prelude of a run, before the first round: the session's state loaded and bound,
``on_agent_state_ready``, the system prompt through ``on_system_prompt``, then the input into
memory — or, when tool calls of the session wait, the resume (`_resume`).

Its events are trace events (when the agent traces its middleware) and the resume's; it runs as
the run's first step (`_steps.PRELUDE`), so one path serves traced and untraced runs."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from ..events import AgentEvent
from ..extension.base import ExtensionPoint
from ..message import Msg
from ..stream import aclosing
from ._boundaries import admit
from ._hooks import HookCall
from ._input import check_input
from ._persist import load_session
from ._resume import check_no_control_input, resume

if TYPE_CHECKING:
    from ._scope import StepScope

__all__ = ["prelude"]


async def prelude(exe: StepScope) -> AsyncIterator[AgentEvent]:
    agent, ctx, run, runtime = exe.agent, exe.ctx, exe.run, exe.runtime
    state = await load_session(runtime, ctx, run)
    run.keep_before()  # what a rollback of this turn restores (`RunState.roll_back`)
    ctx.agent_state = state
    ctx.agent = agent
    hooks, trace = runtime.participants.hooks, runtime.trace
    input_msgs = run.input_msgs
    for mw in hooks[ExtensionPoint.ON_AGENT_STATE_READY]:
        if not trace:  # no trace events to emit: the hook called as HookCall would, without it
            hook: Callable[..., Any] = mw.on_agent_state_ready  # (an ``async def`` override returns a coroutine)
            result = hook(agent, ctx, state, input_msgs)
            if result is not None and asyncio.iscoroutine(result):  # (an ``async def`` hook)
                await result
            continue
        ready = HookCall(mw, ExtensionPoint.ON_AGENT_STATE_READY,
                         functools.partial(mw.on_agent_state_ready, agent, ctx, state, input_msgs), trace)
        async for ev in ready.events():
            yield ev
    prompt = agent.sys_prompt
    for mw in hooks[ExtensionPoint.ON_SYSTEM_PROMPT]:
        transform = HookCall(mw, ExtensionPoint.ON_SYSTEM_PROMPT,
                             functools.partial(mw.on_system_prompt, agent, ctx, prompt), trace)
        async for ev in transform.events():
            yield ev
        prompt = transform.value
    # One immutable system message per distinct prompt, shared by executions.
    run.system_msg = (_system_message(prompt) if type(prompt) is str else Msg.system(prompt)) if prompt else None
    run.input_taken = True
    pending = run.pending_calls()
    if pending:
        async with aclosing(resume(exe, pending, input_msgs)) as steps:
            async for ev in steps:
                yield ev
        return
    check_input(input_msgs, resuming=False)
    check_no_control_input(input_msgs)
    remember = state.context.append
    for m in input_msgs:
        remember(admit(m))


@functools.lru_cache(maxsize=128)
def _system_message(prompt: str) -> Msg:
    """The system message of a prompt. Messages are immutable, so executions with the same prompt
    share one (it is never remembered, only sent)."""
    return Msg.system(prompt)
