"""`LifecycleMiddleware`: before/after hooks, as an adapter over the onion.

Override any of ``before_agent`` / ``after_agent``, ``before_model`` / ``on_model_delta`` /
``after_model``, ``before_tool`` / ``on_tool_delta`` / ``after_tool`` and ``on_error``; each is an
``async`` no-op by default, and a hook that is not overridden costs nothing (the middleware joins
only the points whose hooks it overrides). How they map onto the onion:

hook (point): when — what it may return

* ``before_agent(agent, ctx, input)`` (on_agent): before the execution — a new `AgentInput`
* ``after_agent(agent, ctx, result)`` (on_agent): the run's `AgentResult` passes — a new `Msg`
  (the caller's result)
* ``before_model(agent, ctx, input)`` (on_model_call): before each model call — a new
  `ModelCallInput`
* ``on_model_delta(agent, ctx, delta)`` (on_model_call): each text, thinking or tool-call delta —
  a rewritten delta event
* ``after_model(agent, ctx, reply)`` (on_model_call): a model call completed (its
  ``ModelCallEnd`` carries no error); ``reply`` is the assistant `Msg`
* ``before_tool(agent, ctx, call)`` (on_acting): before each tool call of the batch, in order — a
  new `ToolUseBlock`
* ``on_tool_delta(agent, ctx, delta)`` (on_acting): each `ToolResultTextDelta` — a rewritten one
* ``after_tool(agent, ctx, result)`` (on_acting): a tool result ended (`ToolResultBlock`)
* ``on_error(agent, ctx, error)`` (on_agent): the run failed

Returning None keeps the value.

Order: ``before_*`` run in middleware order (outermost first), ``after_*`` in reverse —
each is an onion layer. Errors: the first hook that raises short-circuits (what
it wraps never runs); then **every** lifecycle middleware's ``on_error`` is invoked once, inner
first, also those whose layers never started; the *original* error reaches the caller; an error
raised by ``on_error`` is logged and ignored. Cancellation (an interrupt, a consumer that left) is
not an error: ``on_error`` is not called for it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..._replies import ReplyBuilder, ToolResultCollector
from ...events import AgentResult, ModelCallEnd, TextBlockDelta, ThinkingBlockDelta, ToolCallDelta, ToolResultEnd
from ...extension.base import ActingInput, AgentInput, ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from ...message import Msg, ToolResultBlock, ToolUseBlock
from ...stream import EventStream, aclose

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...extension.base import AgentView

__all__ = ["LifecycleMiddleware"]

_log = logging.getLogger("agentscope_py.middleware.shapes_lifecycle")
_MODEL_DELTAS = (TextBlockDelta, ThinkingBlockDelta, ToolCallDelta)
_NOTIFIED = "agentscope.lifecycle.notified"  # ctx key: the errors every on_error has been told of
_HOOKS = {
    ExtensionPoint.ON_AGENT: ("before_agent", "after_agent", "on_error"),
    ExtensionPoint.ON_MODEL_CALL: ("before_model", "on_model_delta", "after_model"),
    ExtensionPoint.ON_ACTING: ("before_tool", "on_tool_delta", "after_tool"),
}


class LifecycleMiddleware(MiddlewareBase):
    """Lifecycle hooks (module docstring). Subclass and override what you need."""

    async def before_agent(self, agent: AgentView, ctx: RuntimeContext, input: AgentInput) -> AgentInput | None:
        return None

    async def after_agent(self, agent: AgentView, ctx: RuntimeContext, result: Msg) -> Msg | None:
        return None

    async def before_model(
        self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput
    ) -> ModelCallInput | None:
        return None

    async def on_model_delta(self, agent: AgentView, ctx: RuntimeContext, delta: Any) -> Any:
        """``delta``: a `TextBlockDelta`, `ThinkingBlockDelta` or `ToolCallDelta`; return a
        rewritten event (``delta.model_copy(update={"delta": ...})``) or None to keep it."""
        return None

    async def after_model(self, agent: AgentView, ctx: RuntimeContext, reply: Msg) -> None:
        return None

    async def before_tool(self, agent: AgentView, ctx: RuntimeContext, call: ToolUseBlock) -> ToolUseBlock | None:
        return None

    async def on_tool_delta(self, agent: AgentView, ctx: RuntimeContext, delta: Any) -> Any:
        return None

    async def after_tool(self, agent: AgentView, ctx: RuntimeContext, result: ToolResultBlock) -> None:
        return None

    async def on_error(self, agent: AgentView, ctx: RuntimeContext, error: BaseException) -> None:
        return None

    # -- the adapter -----------------------------------------------------------------------------

    def _overrides(self, hook: str) -> bool:
        return getattr(type(self), hook) is not getattr(LifecycleMiddleware, hook)

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset(p for p, hooks in _HOOKS.items() if any(self._overrides(h) for h in hooks))

    def on_agent(self, agent: AgentView, ctx: RuntimeContext, input: AgentInput, next: Next) -> Any:
        return EventStream(lambda: self._agent(agent, ctx, input, next))

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        return EventStream(lambda: self._model(agent, ctx, input, next))

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        return EventStream(lambda: self._acting(agent, ctx, input, next))

    async def _agent(self, agent: AgentView, ctx: RuntimeContext, input: AgentInput, next: Next
                     ) -> AsyncIterator[Any]:
        it: Any = None
        after = self._overrides("after_agent")
        try:
            if self._overrides("before_agent"):
                input = await self.before_agent(agent, ctx, input) or input
            it = next(input).__aiter__()
            async for ev in it:
                if after and type(ev) is AgentResult and ev.source is None:
                    result = await self.after_agent(agent, ctx, ev.result)
                    if result is not None:
                        ev = ev.model_copy(update={"result": result})
                yield ev
        except Exception as error:
            await _notify_all(agent, ctx, error)
            raise
        finally:
            if it is not None:
                await aclose(it)

    async def _model(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next
                     ) -> AsyncIterator[Any]:
        if self._overrides("before_model"):
            input = await self.before_model(agent, ctx, input) or input
        deltas = self._overrides("on_model_delta")
        builder = ReplyBuilder() if self._overrides("after_model") else None
        it = next(input).__aiter__()
        try:
            async for ev in it:
                top = ev.source is None
                if deltas and top and type(ev) in _MODEL_DELTAS:
                    ev = await self.on_model_delta(agent, ctx, ev) or ev
                if builder is not None and top:
                    builder.add(ev)
                    if type(ev) is ModelCallEnd and ev.error is None:
                        await self.after_model(agent, ctx, builder.build(ev.reply_id, agent.name))
                yield ev
        finally:
            await aclose(it)

    async def _acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next
                      ) -> AsyncIterator[Any]:
        if self._overrides("before_tool"):
            calls = [await self.before_tool(agent, ctx, call) or call for call in input.tool_calls]
            if any(new is not old for new, old in zip(calls, input.tool_calls, strict=True)):
                input = input.replace(tool_calls=calls)
        deltas = self._overrides("on_tool_delta")
        collector = ToolResultCollector() if self._overrides("after_tool") else None
        it = next(input).__aiter__()
        try:
            async for ev in it:
                top = ev.source is None
                if deltas and top and ev.type == "tool_result_text_delta":
                    ev = await self.on_tool_delta(agent, ctx, ev) or ev
                if collector is not None and top:
                    collector.add(ev)
                    if type(ev) is ToolResultEnd:
                        await self.after_tool(agent, ctx, collector.results[ev.tool_call_id])
                yield ev
        finally:
            await aclose(it)


async def _notify_all(agent: AgentView, ctx: RuntimeContext, error: BaseException) -> None:
    """Every lifecycle middleware's ``on_error``, once per error, inner first; their own errors
    are logged and dropped (they must not mask the original)."""
    notified: list[BaseException] = ctx.get(_NOTIFIED) or []
    if any(e is error for e in notified):
        return
    notified.append(error)
    ctx.put(_NOTIFIED, notified)
    lifecycle = [m for m in agent.middlewares_at(ExtensionPoint.ON_AGENT) if isinstance(m, LifecycleMiddleware)]
    for mw in reversed(lifecycle):
        if not mw._overrides("on_error"):
            continue
        try:
            await mw.on_error(agent, ctx, error)
        except Exception:
            _log.warning("%s.on_error raised; ignored (the original error goes on)", mw.name, exc_info=True)
