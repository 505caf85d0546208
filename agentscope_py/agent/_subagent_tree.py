"""What ties a sub-agent's run to its caller's: the middleware it inherits, the limits of the tree
(depth, cycles), and the bookkeeping that lets a confirmation sent to the root resume the
sub-agent that asked for it (`_resume` routes it here) — or, where no answer can reach it (a
durable run's tool call), answers its waits with an error (`close_waits`).

Kept apart from the sub-agent tool itself (`_subagent`) so the resume path and the toolkit's
build-time check need none of the tool's machinery."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .._history import unanswered_calls
from ..errors import SubAgentCycleError, SubAgentDepthError
from ..events import ConfirmResult
from ..extension.base import ExtensionPoint, MiddlewareBase, overrides
from ..extension.chain import Participants
from ..message import Msg, ToolResultBlock, ToolResultState
from ..tool.toolkit import _subagent_of

if TYPE_CHECKING:
    from .._context import RuntimeContext
    from .._state import AgentState
    from ._runtime import AgentRuntime

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "WAITS_KEY",
    "InheritSpec",
    "check_limits",
    "close_waits",
    "inherited_runtime",
    "inherits",
    "route_confirms",
    "set_waiting",
    "subagent_at",
    "take_confirms",
]

DEFAULT_MAX_DEPTH = 5
"""How deep a tree of sub-agents may go by default (the root is depth 0)."""

WAITS_KEY = "agentscope.subagent_waits"
"""In a caller's ``AgentState.metadata``: ``{call id: [the ids of the tool calls it waits on]}``
for each sub-agent call paused for a confirmation (persisted with the session, so a restart
resumes it)."""

_RESUME_KEY = "agentscope.subagent_resume"
"""In a caller's context, during a resume: ``{call id: [ConfirmResult, ...]}`` routed to it."""

InheritSpec = bool | Callable[[MiddlewareBase], bool]
"""``inherit_middleware=``: True (the caller's middleware, but those that shape one agent's own
reply), False (none), or a predicate choosing them."""


def inherits(mw: MiddlewareBase) -> bool:
    """The default choice of ``inherit_middleware=True``: a middleware's own
    ``inherit_to_subagents`` attribute when it has one (the built-ins that shape one agent's own
    reply — its answer filter, task list, structured output, prompt — set it False), else True."""
    own = getattr(mw, "inherit_to_subagents", None)
    return own if isinstance(own, bool) else True


def inherited_runtime(
    child: AgentRuntime, caller: AgentRuntime | None, spec: InheritSpec,
    cache: dict[int, tuple[Participants, AgentRuntime]],
) -> AgentRuntime:
    """The runtime a sub-agent's execution runs with: its own, with the caller's inherited
    middleware outside its own at every point (one instance registered on both runs once, as
    the caller's). Cached per caller participants: a sub-agent called in a loop folds its
    chains once."""
    if spec is False or caller is None:
        return child
    outer = caller.participants
    hit = cache.get(id(outer))
    if hit is not None and hit[0] is outer:
        return hit[1]
    keep = inherits if spec is True else spec
    merged = _layered(outer, child.participants, keep)
    runtime = child if merged is None else dataclasses.replace(child, participants=merged)
    if len(cache) >= 64:  # callers are few (agents, not runs): a bound against a pathological churn
        cache.clear()
    cache[id(outer)] = (outer, runtime)
    return runtime


def _layered(
    outer: Participants, inner: Participants, keep: Callable[[MiddlewareBase], bool]
) -> Participants | None:
    """Participants with ``outer``'s kept middleware outermost, then ``inner``'s own; None when
    nothing is kept (the sub-agent runs with its own participants, untouched)."""
    chosen = {mw for mws in outer.by_point.values() for mw in mws if keep(mw)}
    if not chosen:
        return None
    by_point: dict[ExtensionPoint, tuple[MiddlewareBase, ...]] = {}
    hooks: dict[ExtensionPoint, tuple[MiddlewareBase, ...]] = {}
    for point in ExtensionPoint:
        mine = tuple(mw for mw in outer.by_point[point] if mw in chosen)
        by_point[point] = mine + tuple(mw for mw in inner.by_point[point] if mw not in mine)
        hooks[point] = tuple(mw for mw in by_point[point] if overrides(mw, point))
    merged = Participants(())
    merged.by_point = MappingProxyType(by_point)
    merged.hooks = MappingProxyType(hooks)
    return merged


def check_limits(ctx: RuntimeContext, agent: Any, name: str, max_depth: int) -> None:
    """Refuse a call that would enter a cycle (``agent`` already runs above) or go deeper than
    ``max_depth``."""
    depth = len(ctx.agent_path)  # the depth the sub-agent would run at (the root is 0)
    if depth > max_depth:
        path = "/".join((*ctx.agent_path, name))
        raise SubAgentDepthError(f"calling sub-agent {name!r} would nest {depth} levels deep ({path}); the limit is "
                                 f"max_depth={max_depth}", depth=depth, max_depth=max_depth)
    above: RuntimeContext | None = ctx
    while above is not None:
        if above.agent is agent:
            path = "/".join((*ctx.agent_path, name))
            raise SubAgentCycleError(f"sub-agent {name!r} is already running above this call ({path}): an agent "
                                     "cannot call itself through its sub-agents")
        above = above.parent


# -- confirmations that reach a paused sub-agent ---------------------------------------------------


def route_confirms(
    ctx: RuntimeContext, state: AgentState, pending: Mapping[str, Any], confirms: list[ConfirmResult],
) -> tuple[list[ConfirmResult], set[str]]:
    """Split ``confirms`` into the caller's own and those for tool calls a paused sub-agent call
    waits on; the latter are handed to that call through ``ctx`` (`take_confirms`). Returns the
    caller's own confirms and the ids of the sub-agent calls to run again."""
    waits = state.metadata.get(WAITS_KEY)
    if not isinstance(waits, dict) or not waits:
        return confirms, set()
    owner = {leaf: cid for cid, leaves in waits.items() if cid in pending for leaf in leaves}
    own: list[ConfirmResult] = []
    routed: dict[str, list[ConfirmResult]] = {}
    for c in confirms:
        cid = owner.get(c.tool_call_id)
        if cid is None:
            own.append(c)
        else:
            routed.setdefault(cid, []).append(c)
    if routed:
        ctx.put(_RESUME_KEY, routed)
    return own, {cid for cid in waits if cid in pending}


def take_confirms(ctx: RuntimeContext, call_id: str) -> list[ConfirmResult] | None:
    """For a sub-agent call that paused: the confirms routed to it (``[]``: none this time, its
    sub-agent asks again); None when the call did not pause (a new task)."""
    state = ctx.agent_state
    waits = state.metadata.get(WAITS_KEY) if state is not None else None
    if not isinstance(waits, dict) or call_id not in waits:
        return None
    routed = ctx._values.get(_RESUME_KEY)  # the caller's own (not an ancestor's)
    return list(routed.pop(call_id, ())) if isinstance(routed, dict) else []


def set_waiting(ctx: RuntimeContext, call_id: str, leaves: list[str] | None) -> None:
    """Record (``leaves``) or clear (None) what a sub-agent call waits on, in the caller's state."""
    state = ctx.agent_state
    if state is None:
        return
    waits = state.metadata.get(WAITS_KEY)
    if leaves:
        if not isinstance(waits, dict):
            waits = state.metadata[WAITS_KEY] = {}
        waits[call_id] = list(leaves)
    elif isinstance(waits, dict) and call_id in waits:
        del waits[call_id]
        if not waits:
            del state.metadata[WAITS_KEY]


# -- a sub-agent's session, reached from outside its call ------------------------------------------


def subagent_at(agent: Any, path: Sequence[str]) -> Any:
    """The sub-agent at ``path`` (its tool names, from ``agent``'s toolkit down)."""
    sub = agent
    for name in path:
        tool = sub.toolkit.get(name)
        sub = _subagent_of(tool) if tool is not None else None
        if sub is None:
            raise LookupError(f"the agent has no sub-agent at {'/'.join(path)}: every worker must build the same agent")
    return sub


async def close_waits(runtime: AgentRuntime, user_id: str, session_id: str, saved: int, text: str) -> int:
    """Answer the calls a sub-agent's session waits on (a pause no one can answer: a durable tool
    call's) with an error result ``text``, so its next call starts from a usable session; it is
    left as it is when someone saved it since the paused call (``saved``, its version then).
    The session's version after it."""
    state, version = await runtime.store.load(user_id, session_id)
    if state is None or version != saved:
        return version
    calls = unanswered_calls(state.context)
    if not calls and WAITS_KEY not in state.metadata:
        return version
    if calls:
        state.context.append(Msg.tool([ToolResultBlock(id=c.id, name=c.name, state=ToolResultState.ERROR, output=text)
                                       for c in calls]))
    state.pending_tool_calls = []
    state.metadata.pop(WAITS_KEY, None)
    return await runtime.store.save(user_id, session_id, state, version)
