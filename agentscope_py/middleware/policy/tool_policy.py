"""Tool-policy middleware.

* `ToolPolicyMiddleware` (``on_acting``, and ``on_model_call`` to hide tools): allow / deny lists
  of glob patterns (``fnmatch``: ``"delete_*"``) and per-tool rules that see the call's arguments
  and the `RuntimeContext`. A denied call gets a ``denied`` result the model sees; the other calls
  of the round run. When every call of a round is denied — by the policy, by the permission gate,
  or both — one `AllToolsDenied` lists them all, as the core's own does (so
  `StopOnAllDeniedMiddleware` acts on it). Tools that the lists deny whatever the arguments are
  also hidden from the model (``hide_denied=True``): it is not offered what it may not call, and
  a tool selector of the agent does not choose among them (it asks `ToolPolicyMiddleware.hides`).
* `StopOnAllDeniedMiddleware` (``on_acting``): when every tool call of a round was denied, the
  core emits `AllToolsDenied` and, by default, the loop goes on to the next round (the model sees
  the denied results and may try something else). With this middleware the run stops there
  instead: right after the `AllToolsDenied` event it emits `RequestStop` with
  ``GenerateReason.ALL_TOOLS_DENIED``, and the final message carries that reason.

A structured run's ``generate_response`` tool (`agent.RESPONSE_TOOL`, registered per run when the
agent has no tool of that name) is how the run answers, not a tool of the agent: the lists and
rules neither hide nor deny it, as `ToolSelectorMiddleware` never narrows it away.

Unknown tool names: every pattern must match a tool of the agent. With ``toolkit=`` the check runs
at construction; without, at the first run of each agent (a `ValueError` from
``on_agent_state_ready``, before the model is called).
"""

from __future__ import annotations

import asyncio
import fnmatch
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..._replies import result_events
from ..._response_tool import answer_tool
from ...events import AllToolsDenied, RequestStop
from ...extension.base import ActingInput, ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from ...message import GenerateReason, ToolResultState, ToolUseBlock
from ...stream import EventStream, aclosing

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ..._state import AgentState
    from ...extension.base import AgentView
    from ...message import Msg
    from ...tool.toolkit import Toolkit

__all__ = ["StopOnAllDeniedMiddleware", "ToolPolicyMiddleware", "ToolRule", "check_tool_names"]

ToolRule = Callable[[ToolUseBlock, "RuntimeContext"], "bool | str | Awaitable[bool | str | None] | None"]
"""A per-tool rule: ``rule(call, ctx)`` returns True/None (allowed), False (denied) or a str (denied,
with that reason for the model); it may be async."""

DENIED_TEXT = "Permission denied: the call to {name} was not allowed by the tool policy."


def check_tool_names(patterns: Iterable[str], names: Iterable[str], parameter: str) -> None:
    """Raise a ValueError naming ``parameter`` for each pattern that matches none of ``names``."""
    known = list(names)
    unknown = [p for p in patterns if not fnmatch.filter(known, p)]
    if unknown:
        raise ValueError(
            f"{parameter}: no tool matches {', '.join(map(repr, unknown))} (the agent's tools: "
            f"{', '.join(known) or 'none'}); fix the name or register the tool"
        )


class ToolPolicyMiddleware(MiddlewareBase):
    """Allow / deny lists and per-call rules for tool calls.

    ``allow``: patterns of the tools that may be called (None: all); ``deny``: patterns that may
    not (deny wins over allow); ``rules``: pattern -> `ToolRule`, every matching rule must allow
    the call. ``message``: the denied result's text (``{name}`` and ``{reason}`` are filled in).
    ``hide_denied``: drop the tools the lists deny from the schemas the model is offered.
    ``toolkit``: check the patterns against it now (else at the first run)."""

    def __init__(
        self,
        *,
        allow: Iterable[str] | None = None,
        deny: Iterable[str] = (),
        rules: Mapping[str, ToolRule] | None = None,
        message: str = DENIED_TEXT,
        hide_denied: bool = True,
        toolkit: Toolkit | None = None,
    ) -> None:
        self.allow = None if allow is None else _patterns(allow, "allow")
        self.deny = _patterns(deny, "deny")
        self.rules = dict(rules or {})
        for pattern, rule in self.rules.items():
            _patterns([pattern], "rules")
            if not callable(rule):
                raise TypeError(f"rules[{pattern!r}] must be a callable rule(call, ctx), not {type(rule).__name__}")
        if not isinstance(message, str):
            raise TypeError("message must be a str (it may use {name} and {reason})")
        self.message = message
        self.hide_denied = hide_denied
        self._checked: set[tuple[str, ...]] = set()
        if toolkit is not None:
            self._check(toolkit.names)

    def active_points(self) -> frozenset[ExtensionPoint]:
        points = {ExtensionPoint.ON_ACTING, ExtensionPoint.ON_AGENT_STATE_READY}
        if self.hide_denied and (self.allow is not None or self.deny):
            points.add(ExtensionPoint.ON_MODEL_CALL)
        return frozenset(points)

    # -- the decision ----------------------------------------------------------------------------

    def listed(self, name: str) -> bool:
        """Whether the allow / deny lists let ``name`` be called (rules aside)."""
        if any(fnmatch.fnmatchcase(name, p) for p in self.deny):
            return False
        return self.allow is None or any(fnmatch.fnmatchcase(name, p) for p in self.allow)

    def hides(self, name: str) -> bool:
        """Whether the model is never offered ``name``: ``hide_denied`` and the lists deny it
        (a tool selector asks this, so it chooses only among the tools the model may be offered)."""
        return self.hide_denied and not self.listed(name)

    async def decide(self, call: ToolUseBlock, ctx: RuntimeContext) -> str | None:
        """None when ``call`` is allowed, else the reason it is denied."""
        if not self.listed(call.name):
            return "the tool is not allowed"
        for pattern, rule in self.rules.items():
            if not fnmatch.fnmatchcase(call.name, pattern):
                continue
            verdict = rule(call, ctx)
            if asyncio.iscoroutine(verdict) or isinstance(verdict, Awaitable):
                verdict = await verdict
            if verdict is False or isinstance(verdict, str):
                return verdict if isinstance(verdict, str) else f"rule {pattern!r} denied it"
        return None

    # -- hooks -----------------------------------------------------------------------------------

    def on_agent_state_ready(
        self, agent: AgentView, ctx: RuntimeContext, state: AgentState, input_messages: list[Msg]
    ) -> None:
        if ctx.parent is None:  # (inherited by a sub-agent: checked at the root, against the whole tree)
            self._check(agent.toolkit.tree_names)

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        answer = answer_tool(agent.toolkit)
        tools = tuple(t for t in input.tools if t.name == answer or not self.hides(t.name))
        return next(input if len(tools) == len(input.tools) else input.replace(tools=tools))

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        return EventStream(lambda: self._act(ctx, input, next, answer_tool(agent.toolkit)))

    async def _act(self, ctx: RuntimeContext, input: ActingInput, next: Next, answer: str | None
                   ) -> AsyncIterator[Any]:
        reply_id = ctx.reply_id or ""
        denied: list[ToolUseBlock] = []
        for call in input.tool_calls:
            reason = None if call.name == answer else await self.decide(call, ctx)
            if reason is not None:
                denied.append(call)
                for ev in result_events(reply_id, call, self._text(call, reason), ToolResultState.DENIED):
                    yield ev
        if not denied:
            async with aclosing(next(input).__aiter__()) as it:
                async for ev in it:
                    yield ev
            return
        denied_ids = {c.id for c in denied}
        rest = [c for c in input.tool_calls if c.id not in denied_ids]
        if not rest:
            yield AllToolsDenied(reply_id=reply_id, denied_tool_calls=denied)
            return
        async with aclosing(next(input.replace(tool_calls=rest)).__aiter__()) as it:
            async for ev in it:
                if type(ev) is AllToolsDenied and ev.source is None:
                    # The gate denied the rest: one notice for the whole round, in call order.
                    both = {c.id for c in (*denied, *ev.denied_tool_calls)}
                    ev = AllToolsDenied(reply_id=ev.reply_id, denied_tool_calls=_in_order(input.tool_calls, both))
                yield ev

    def _text(self, call: ToolUseBlock, reason: str) -> str:
        try:
            return self.message.format(name=call.name, reason=reason)
        except (KeyError, IndexError, ValueError):
            return self.message

    def _check(self, names: Sequence[str]) -> None:
        key = tuple(names)
        if key in self._checked:
            return
        check_tool_names(self.allow or (), key, "allow")
        check_tool_names(self.deny, key, "deny")
        check_tool_names(self.rules, key, "rules")
        self._checked.add(key)


def _patterns(values: Iterable[str], parameter: str) -> tuple[str, ...]:
    if isinstance(values, str):
        raise TypeError(f"{parameter} must be a list of tool-name patterns, not a str ({values!r}): wrap it in a list")
    out = tuple(values)
    for p in out:
        if not isinstance(p, str) or not p:
            raise TypeError(f"{parameter}: a tool-name pattern must be a non-empty str, not {p!r}")
    return out


def _in_order(calls: Sequence[ToolUseBlock], ids: set[str]) -> list[ToolUseBlock]:
    return [c for c in calls if c.id in ids]


class StopOnAllDeniedMiddleware(MiddlewareBase):
    """Ends the run with ``ALL_TOOLS_DENIED`` when every tool call of a round was denied."""

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_ACTING})

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        return next(input).concat_map(_stop_after_denial)


def _stop_after_denial(event: Any) -> tuple[Any, ...]:
    # Only this agent's own notice: a sub-agent's forwarded one (non-empty source) is not ours.
    if type(event) is AllToolsDenied and event.source is None:
        names = ", ".join(c.name for c in event.denied_tool_calls)
        stop = RequestStop(
            reason=f"every tool call was denied ({names})",
            generate_reason=GenerateReason.ALL_TOOLS_DENIED,
        )
        return (event, stop)
    return (event,)
