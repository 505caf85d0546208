"""`ObserverMiddleware`: read-only notifications beside the call path.

Override any of these (each may be sync or ``async``; an async one is awaited in place, so the
order of notifications is the order of things):

| hook | when |
|---|---|
| ``on_turn_start(agent, ctx, input_messages)`` | an execution starts |
| ``on_turn_end(agent, ctx, run)`` | it ended (`AgentRun`: the result or error, reason, usage, counters) |
| ``on_model_start(agent, ctx, request)`` | a model call starts (`ModelCallInput`) |
| ``on_model_end(agent, ctx, reply, end)`` | it ended: the reply `Msg`, its `ModelCallEnd` (``end.error``: failed) |
| ``on_tool_start(agent, ctx, call)`` | a tool call of the batch is about to run (`ToolUseBlock`) |
| ``on_tool_end(agent, ctx, result)`` | its result ended (`ToolResultBlock`) |
| ``on_event(agent, ctx, event)`` | every event the caller's stream carries (at ``on_agent``) |
| ``on_error(agent, ctx, error)`` | the run failed (not for cancellation) |

Every ``on_turn_start`` gets one ``on_turn_end``, also for a turn that never ran (refused, failed
in a layer inside before it, or left at its AgentStart): its `AgentRun` then holds only the
error, else the reason ``INTERRUPTED``.

An observer can change nothing: it is given immutable values, what it returns is ignored, and an
exception it raises is logged (``agentscope_py.middleware.shapes_observer``, with the traceback)
and swallowed — the run never notices. Use a middleware to influence behaviour; use an observer
for metrics and logging that must never affect the run.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..._bracket_kinds import describe
from ..._replies import ReplyBuilder, ToolResultCollector
from ...events import AgentEnd, AgentStart, ModelCallEnd, ToolResultEnd
from ...extension.base import ActingInput, AgentInput, AgentRun, ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from ...message import GenerateReason, Msg, ToolResultBlock, ToolUseBlock
from ...stream import EventStream, aclose

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...extension.base import AgentView

__all__ = ["ObserverMiddleware"]

_log = logging.getLogger("agentscope_py.middleware.shapes_observer")
_HOOKS = {
    ExtensionPoint.ON_AGENT: ("on_turn_start", "on_event", "on_error"),
    ExtensionPoint.ON_AGENT_FINISH: ("on_turn_end",),
    ExtensionPoint.ON_MODEL_CALL: ("on_model_start", "on_model_end"),
    ExtensionPoint.ON_ACTING: ("on_tool_start", "on_tool_end"),
}


class ObserverMiddleware(MiddlewareBase):
    """Read-only notifications (module docstring). Subclass and override what you observe."""

    _turns: set[str | None]

    def order(self) -> int:
        return 1000  # outermost: an observer sees what the caller sees

    def on_turn_start(self, agent: AgentView, ctx: RuntimeContext, input_messages: tuple[Msg, ...]) -> Any: ...
    def on_turn_end(self, agent: AgentView, ctx: RuntimeContext, run: AgentRun) -> Any: ...
    def on_model_start(self, agent: AgentView, ctx: RuntimeContext, request: ModelCallInput) -> Any: ...
    def on_model_end(self, agent: AgentView, ctx: RuntimeContext, reply: Msg, end: ModelCallEnd) -> Any: ...
    def on_tool_start(self, agent: AgentView, ctx: RuntimeContext, call: ToolUseBlock) -> Any: ...
    def on_tool_end(self, agent: AgentView, ctx: RuntimeContext, result: ToolResultBlock) -> Any: ...
    def on_event(self, agent: AgentView, ctx: RuntimeContext, event: Any) -> Any: ...
    def on_error(self, agent: AgentView, ctx: RuntimeContext, error: BaseException) -> Any: ...

    # -- the adapter -----------------------------------------------------------------------------

    def _overrides(self, hook: str) -> bool:
        return getattr(type(self), hook) is not getattr(ObserverMiddleware, hook)

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset(p for p, hooks in _HOOKS.items() if any(self._overrides(h) for h in hooks))

    async def _tell(self, hook: str, *args: Any) -> None:
        try:
            value = getattr(self, hook)(*args)
            if inspect.isawaitable(value):
                await value
        except Exception:
            _log.warning("observer %s.%s raised; ignored", self.name, hook, exc_info=True)

    def on_agent(self, agent: AgentView, ctx: RuntimeContext, input: AgentInput, next: Next) -> Any:
        return EventStream(lambda: self._agent(agent, ctx, input, next))

    async def _agent(self, agent: AgentView, ctx: RuntimeContext, input: AgentInput, next: Next
                     ) -> AsyncIterator[Any]:
        reply_id = ctx.reply_id
        events = self._overrides("on_event")
        running: str | None = None  # the run's own AgentStart passed, and not its AgentEnd: its reply id
        it: Any = None
        try:
            if self._overrides("on_turn_start"):
                if self._overrides("on_turn_end"):
                    self._open_turns().add(reply_id)
                await self._tell("on_turn_start", agent, ctx, tuple(input.msgs))
            it = next(input).__aiter__()
            async for ev in it:
                if events:
                    if isinstance(ev, AgentStart | AgentEnd) and ev.source is None:
                        running = ev.reply_id if isinstance(ev, AgentStart) else None
                    await self._tell("on_event", agent, ctx, ev)
                yield ev
        except Exception as error:
            if running is not None:
                # A layer inside failed with the run's bracket open: the runtime ends the caller's
                # stream with the AgentEnd naming the error, and this is told it as well.
                await self._tell("on_event", agent, ctx, AgentEnd(reply_id=running, error=describe(error)))
            await self._end_unfinished(agent, ctx, reply_id, error)
            if self._overrides("on_error"):
                await self._tell("on_error", agent, ctx, error)
            raise
        finally:
            try:
                if it is not None:
                    await aclose(it)
            finally:  # (also when cancelled while telling on_turn_start, or while closing)
                await self._end_unfinished(agent, ctx, reply_id, None)

    def _open_turns(self) -> set[str | None]:
        """The runs told ``on_turn_start`` and not yet ``on_turn_end`` (by reply id)."""
        turns = getattr(self, "_turns", None)  # (made here: a subclass's __init__ need not call ours)
        if turns is None:
            turns = self._turns = set()
        return turns

    async def _end_unfinished(self, agent: AgentView, ctx: RuntimeContext, reply_id: str | None,
                              error: BaseException | None) -> None:
        """``on_turn_end`` for a turn that started here and never reached ``on_agent_finish``:
        the runtime refused it (a busy session, an answer it cannot take), a layer inside failed
        before it, or its consumer left before it took the session's turn. Every started turn
        ends once: with the error, else as an interrupted run that did nothing."""
        turns = self._open_turns()
        if reply_id in turns:
            turns.discard(reply_id)
            reason = None if error is not None else GenerateReason.INTERRUPTED
            await self._tell("on_turn_end", agent, ctx, AgentRun(error=error, reason=reason))

    async def on_agent_finish(self, agent: AgentView, ctx: RuntimeContext, run: AgentRun) -> None:
        self._open_turns().discard(ctx.reply_id)
        await self._tell("on_turn_end", agent, ctx, run)

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        return EventStream(lambda: self._model(agent, ctx, input, next))

    async def _model(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next
                     ) -> AsyncIterator[Any]:
        if self._overrides("on_model_start"):
            await self._tell("on_model_start", agent, ctx, input)
        builder = ReplyBuilder() if self._overrides("on_model_end") else None
        it = next(input).__aiter__()
        try:
            async for ev in it:
                if builder is not None and ev.source is None:
                    builder.add(ev)
                    if type(ev) is ModelCallEnd:
                        await self._tell("on_model_end", agent, ctx, builder.build(ev.reply_id, agent.name), ev)
                yield ev
        finally:
            await aclose(it)

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        return EventStream(lambda: self._acting(agent, ctx, input, next))

    async def _acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next
                      ) -> AsyncIterator[Any]:
        if self._overrides("on_tool_start"):
            for call in input.tool_calls:
                await self._tell("on_tool_start", agent, ctx, call)
        collector = ToolResultCollector() if self._overrides("on_tool_end") else None
        it = next(input).__aiter__()
        try:
            async for ev in it:
                if collector is not None and ev.source is None:
                    collector.add(ev)
                    if type(ev) is ToolResultEnd:
                        await self._tell("on_tool_end", agent, ctx, collector.results[ev.tool_call_id])
                yield ev
        finally:
            await aclose(it)
