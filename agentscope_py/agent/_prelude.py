"""The prelude of a run, before the first round: the session's state loaded and bound,
``on_agent_state_ready``, the system prompt through ``on_system_prompt``, then the input into
memory — or, when tool calls of the session wait, the resume (`_resume`).

The prelude is awaited, not iterated: most runs publish nothing before their first round. What
it has to publish — the hooks' trace events when the agent traces its middleware, a resume's
events — it returns as a stream, and the loop runs that as the run's first step
(`_steps.PRELUDE`); without one, the first step is the first round.

An ``on_agent_state_ready`` hook that raises `InputError` or `ResumeError` refuses the input
(`HumanApprovalMiddleware`: a decision its tool does not allow), as the loop's own checks do: the
run has no turn and saves nothing (`RunState.refused`), so the caller gets that error, not a
failed save's, and the store is left as it was."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from .._history import waiting_history
from ..errors import InputError, ResumeError
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
    from .._state import AgentState
    from ..extension.base import MiddlewareBase
    from ._run_state import RunState
    from ._scope import StepScope

__all__ = ["never_told", "prelude"]

# Read from their class once (an attribute read on an Enum class takes the slow path of
# EnumType's ``__getattr__`` on Python 3.11: `agent._loop`).
_ON_AGENT_STATE_READY, _ON_SYSTEM_PROMPT = ExtensionPoint.ON_AGENT_STATE_READY, ExtensionPoint.ON_SYSTEM_PROMPT


async def prelude(exe: StepScope) -> AsyncIterator[AgentEvent] | None:
    """Run the prelude; what it still has to publish, as a stream (None: nothing)."""
    agent, ctx, run, runtime = exe.agent, exe.ctx, exe.run, exe.runtime
    state = await load_session(runtime, ctx, run)
    if run.waited and state.context:
        # An input sent while another run held the session may repeat that run's input (a client
        # that resends its conversation sent the message the run ahead took): what the session
        # holds (by id) is not taken twice.
        held = {m.id for m in state.context}
        if any(m.id in held for m in run.input_msgs):
            run.input_msgs = [m for m in run.input_msgs if m.id not in held]
    run.keep_before()  # what a rollback of this turn restores (`RunState.roll_back`)
    ctx.agent_state = state
    ctx.agent = agent
    hooks = runtime.participants.hooks
    ready, prompting = hooks[_ON_AGENT_STATE_READY], hooks[_ON_SYSTEM_PROMPT]
    if runtime.trace and (ready or prompting):
        return _traced(exe, state)
    input_msgs = run.input_msgs
    mw: Any = None
    try:
        for mw in ready:
            hook: Callable[..., Any] = mw.on_agent_state_ready  # (an ``async def`` override returns a coroutine)
            result = hook(agent, ctx, state, input_msgs)
            if result is not None and asyncio.iscoroutine(result):
                await result
    except BaseException as exc:
        never_told(run, ready, ready.index(mw) + 1)
        if isinstance(exc, InputError | ResumeError):
            run.refused = True  # a hook refused the input: no turn, nothing saved (module docstring)
        raise
    prompt: Any = agent.sys_prompt
    for mw in prompting:
        prompt = mw.on_system_prompt(agent, ctx, prompt)
        if asyncio.iscoroutine(prompt):  # (the base hook is an ``async def``; an override may be a plain one)
            prompt = await prompt
    return _take_input(exe, state, prompt)


async def _traced(exe: StepScope, state: AgentState) -> AsyncIterator[AgentEvent]:
    """The hooks of the prelude each inside its trace events, then the rest of the prelude."""
    agent, ctx, run, runtime = exe.agent, exe.ctx, exe.run, exe.runtime
    hooks, input_msgs = runtime.participants.hooks, run.input_msgs
    participants = hooks[_ON_AGENT_STATE_READY]
    told = 0  # the hooks called so far (a consumer may leave at a hook's MiddlewareStarted, before its call)
    try:
        for mw in participants:
            ready = HookCall(mw, _ON_AGENT_STATE_READY,
                             functools.partial(mw.on_agent_state_ready, agent, ctx, state, input_msgs), True)
            try:
                async for ev in ready.events():
                    yield ev
            finally:
                told += ready.called
    except BaseException as exc:
        never_told(run, participants, told)
        if isinstance(exc, InputError | ResumeError):
            run.refused = True  # a hook refused the input: no turn, nothing saved (module docstring)
        raise
    prompt: Any = agent.sys_prompt
    for mw in hooks[_ON_SYSTEM_PROMPT]:
        transform = HookCall(mw, _ON_SYSTEM_PROMPT,
                             functools.partial(mw.on_system_prompt, agent, ctx, prompt), True)
        async for ev in transform.events():
            yield ev
        prompt = transform.value
    rest = _take_input(exe, state, prompt)
    if rest is not None:
        async with aclosing(rest) as steps:
            async for ev in steps:
                yield ev


def never_told(run: RunState, participants: tuple[MiddlewareBase, ...], told: int) -> None:
    """The state-ready pass stopped after ``told`` of its ``participants`` (the last of them may have
    raised): the rest are never told the run's state was ready, and so not its finish either — a
    hook that pairs the two (a span, a count of the runs in flight, a sample to score) never sees
    an end without its start (docs/middleware.md)."""
    run.unready = participants[told:]


def _take_input(exe: StepScope, state: AgentState, prompt: Any) -> AsyncIterator[AgentEvent] | None:
    """The system message set, then the input into memory; or, when calls of the session wait,
    their resume (returned: its events are the prelude's)."""
    run = exe.run
    # One immutable system message per distinct prompt, shared by executions.
    run.system_msg = (_system_message(prompt) if type(prompt) is str else Msg.system(prompt)) if prompt else None
    run.input_taken = True
    input_msgs = run.input_msgs
    pending = run.pending_calls()
    if pending:
        return resume(exe, pending, input_msgs)
    try:
        waiting = waiting_history(input_msgs)
        if waiting is not None:
            history, rest = waiting
            check_no_control_input(history)
            return _resume_history(exe, state, [admit(m) for m in history], rest)
        check_input(input_msgs, resuming=False)
        check_no_control_input(input_msgs)
        admitted = [admit(m) for m in input_msgs]
    except (InputError, ResumeError):
        run.refused = True  # checked before any of it is remembered: the session is as loaded
        raise
    state.context.extend(admitted)
    return None


async def _resume_history(exe: StepScope, state: AgentState, history: list[Msg],
                          rest: list[Msg]) -> AsyncIterator[AgentEvent]:
    """An input that brings along a conversation with calls waiting (`waiting_history`: a thread
    the store dropped, resent whole): the conversation is taken, and the rest of the input meets
    its waiting calls as a session's (`resume`): answers resume them, a new message is refused as
    it is while any session's calls wait. A refused input leaves the session as loaded."""
    taken = len(state.context)
    state.context.extend(history)
    try:
        async with aclosing(resume(exe, exe.run.pending_calls(), rest)) as steps:
            async for ev in steps:
                yield ev
    except BaseException:
        if exe.run.refused:
            del state.context[taken:]
        raise


@functools.lru_cache(maxsize=128)
def _system_message(prompt: str) -> Msg:
    """The system message of a prompt. Messages are immutable, so executions with the same prompt
    share one (it is never remembered, only sent)."""
    return Msg.system(prompt)
