"""`GuardrailMiddleware`: input, streaming and final output checks with a tripwire (``on_model_call``).

* **input** checks see the call's input messages before the model is first called (the input is
  captured at ``on_agent_state_ready``): a trip means the model is never called.
* **stream** checks run while the reply streams, on each text the caller receives (the answer,
  the reasoning, each tool call's arguments; ``GuardrailCheck.kind`` says which, ``covers``
  narrows them): once at least ``stream_every`` new characters of that text arrived (and at the
  end of the reply), on the text so far or its last ``stream_window`` characters. A synchronous
  check runs before the delta that triggered it is released.
* **output** checks see each whole text of the reply (and ``GuardrailCheck.reply``) before its
  ``ModelCallEnd`` is let through.

``blocking=True``: nothing reaches the caller before the checks covering it passed — deltas are
held until the stream check after them passes (async checks are awaited), and with output checks
the whole reply is held until they pass. ``blocking=False`` (default): deltas go out at once and
async stream checks run beside the stream; a trip is acted on as soon as the check answers (the
wait for the model's next chunk races the pending checks), but the deltas that arrived while the
check was running have gone out.

A trip (a check answered a reason): the model request is closed at once (its stream is closed,
so a provider's HTTP request ends), every block this layer let out is closed, the model call ends
with ``ModelCallEnd(error="GuardrailTripped: …")``, an optional ``refusal`` text block follows,
then the `GuardrailTripped` **event** (``guardrail``, ``reason``, ``stage``). Then, by
``exit_behavior``: ``"end"`` emits ``RequestStop`` (the run ends with MIDDLEWARE_STOP_REQUESTED,
its reason saying which guardrail tripped) or ``"error"`` raises the `GuardrailTripped`
**exception** (`agentscope_py.errors`, a `MiddlewareTermination`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from ..._bracket_kinds import OpenBrackets
from ...errors import GuardrailTripped
from ...events import GuardrailTripped as GuardrailTrippedEvent
from ...events import (
    ModelCallEnd,
    RequestStop,
    TextBlockDelta,
    TextBlockEnd,
    TextBlockStart,
    ThinkingBlockDelta,
    ToolCallDelta,
    ToolResultEnd,
    ToolResultStart,
    ToolResultTextDelta,
)
from ...extension.base import ActingInput, ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from ...message import Msg, new_id
from ...stream import EventStream, aclose, aclosing
from .guardrail_checks import (
    ALL_KINDS,
    KINDS,
    Guardrail,
    GuardrailCheck,
    GuardrailResult,
    Kind,
    Stage,
    as_guardrails,
    call_check,
    is_awaitable,
    verdict_of,
)

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ..._state import AgentState
    from ...extension.base import AgentView
    from ...message import ChatUsage

__all__ = ["Guardrail", "GuardrailCheck", "GuardrailMiddleware", "GuardrailResult"]


class _Trip(Exception):
    def __init__(self, guardrail: str, reason: str, stage: Stage) -> None:
        super().__init__(reason)
        self.guardrail, self.reason, self.stage = guardrail, reason, stage
        # The usage of the model's ModelCallEnd the trip held back: the model answered (the
        # provider billed it), so the End that closes the call carries it (the run's usage
        # counts it when no End goes out).
        self.usage: ChatUsage | None = None


class GuardrailMiddleware(MiddlewareBase):
    """Checks input, streamed output and whole replies; a trip ends the run (module docstring).

    ``input`` / ``stream`` / ``output``: a check, a `Guardrail`, or a sequence of them."""

    roles = frozenset({"guardrail"})

    def __init__(
        self,
        *,
        input: Any = None,
        stream: Any = None,
        output: Any = None,
        stream_window: int | None = None,
        stream_every: int = 1,
        blocking: bool = False,
        exit_behavior: Literal["end", "error"] = "end",
        refusal: str | None = None,
        covers: Iterable[Kind] = KINDS,
    ) -> None:
        self.input_checks = as_guardrails(input, "input")
        self.stream_checks = as_guardrails(stream, "stream")
        self.output_checks = as_guardrails(output, "output")
        if not (self.input_checks or self.stream_checks or self.output_checks):
            raise ValueError("GuardrailMiddleware needs at least one check: input=, stream= or output=")
        if stream_window is not None and (isinstance(stream_window, bool) or not isinstance(stream_window, int)
                                          or stream_window < 1):
            raise ValueError(f"stream_window must be an int >= 1 (characters) or None, not {stream_window!r}")
        if isinstance(stream_every, bool) or not isinstance(stream_every, int) or stream_every < 1:
            raise ValueError(f"stream_every must be an int >= 1 (characters), not {stream_every!r}")
        if exit_behavior not in ("end", "error"):
            raise ValueError(f"exit_behavior must be 'end' or 'error', not {exit_behavior!r}")
        if refusal is not None and not isinstance(refusal, str):
            raise TypeError("refusal must be a str (the reply's text after a trip) or None")
        self.covers: frozenset[str] = frozenset((covers,) if isinstance(covers, str) else covers)
        if not self.covers or not self.covers <= set(ALL_KINDS):
            raise ValueError(f"covers takes a non-empty collection of {ALL_KINDS}, not {sorted(self.covers)!r}")
        self.stream_window = stream_window
        self.stream_every = stream_every
        self.blocking = blocking
        self.exit_behavior = exit_behavior
        self.refusal = refusal
        self._input_key = object()  # ctx: the input messages still to check (once per execution)

    def active_points(self) -> frozenset[ExtensionPoint]:
        points = {ExtensionPoint.ON_MODEL_CALL}
        if self.input_checks:
            points.add(ExtensionPoint.ON_AGENT_STATE_READY)
        if "tool_result" in self.covers and (self.stream_checks or self.output_checks):
            points.add(ExtensionPoint.ON_ACTING)
        return frozenset(points)

    def on_agent_state_ready(
        self, agent: AgentView, ctx: RuntimeContext, state: AgentState, input_messages: list[Msg]
    ) -> None:
        ctx.put(self._input_key, tuple(input_messages))

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        return EventStream(lambda: self._guard(agent, ctx, input, next))

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        return EventStream(lambda: self._guard_results(agent, ctx, input, next))

    # -- the guarded model call ------------------------------------------------------------------

    async def _guard(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next
                     ) -> AsyncIterator[Any]:
        released = OpenBrackets(top_only=True)
        pending: set[asyncio.Future[Any]] = set()
        it: Any = None
        try:
            try:
                pending_input = ctx.get(self._input_key)
                if pending_input:
                    ctx.put(self._input_key, ())  # the first model call of the execution checks it
                    text = "\n".join(m.text for m in pending_input)
                    check = GuardrailCheck("input", text, pending_input, agent, ctx)
                    await self._run("input", self.input_checks, check)
                it = next(input).__aiter__()
                async with aclosing(self._checked(agent, ctx, input, it, pending, released)) as checked:
                    async for out in checked:
                        released.see(out)
                        yield out
            except _Trip as trip:
                if it is not None:
                    await aclose(it)  # the model request ends now
                for ev in self._trip_events(trip, released, ctx):
                    yield ev
                if self.exit_behavior == "error":
                    raise GuardrailTripped(trip.guardrail, trip.reason) from None
        finally:
            for task in pending:
                task.cancel()
            if it is not None:
                await aclose(it)

    async def _checked(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, it: Any,
                       pending: set[asyncio.Future[Any]], released: OpenBrackets) -> AsyncGenerator[Any, None]:
        """The inner events, checked; in blocking mode held until the checks covering them passed."""
        stream_checks, covers = self.stream_checks, self.covers
        blocking = self.blocking
        hold_all = blocking and bool(self.output_checks)  # the whole reply waits for the output check
        held: list[Any] = []
        texts: dict[str, _Seen] = {}  # "text", "thinking", or a tool call's id -> what it carried
        messages = tuple(input.messages)
        async with aclosing(_racing(it, pending)) as events:
            async for ev in events:
                cls = type(ev)
                top = ev.source is None
                kind = _KIND_OF.get(cls) if top else None
                if kind is not None and kind in covers:
                    key = ev.tool_call_id if cls is ToolCallDelta else kind
                    seen = texts.get(key)
                    if seen is None:
                        seen = texts[key] = _Seen(kind, ev.tool_name if cls is ToolCallDelta else None)
                    if await self._saw(agent, ctx, messages, seen, ev.delta, pending):
                        held.append(ev)  # unchecked text waits
                        continue
                elif blocking and stream_checks:  # nothing goes out past unchecked text
                    await self._check_unchecked(agent, ctx, messages, texts, pending)
                if cls is ModelCallEnd and top:
                    try:
                        if stream_checks:
                            await self._check_unchecked(agent, ctx, messages, texts, pending)
                        if pending:
                            await _settle(ctx, pending)
                        if self.output_checks:
                            await self._output_check(agent, ctx, messages, texts)
                    except _Trip as trip:
                        trip.usage = ev.usage
                        raise
                    hold_all = False
                if hold_all:
                    held.append(ev)
                    continue
                if held:
                    for out in held:
                        yield out
                    held.clear()
                yield ev
        await self._at_end(agent, ctx, messages, texts, pending)
        for out in held:  # (an inner layer that ended without a ModelCallEnd)
            yield out

    async def _saw(self, agent: AgentView, ctx: RuntimeContext, messages: tuple[Msg, ...], seen: _Seen,
                   delta: str, pending: set[asyncio.Future[Any]]) -> bool:
        """Counts ``delta`` into ``seen`` and runs the stream checks once they are due; True when
        the delta must wait for a later check (blocking mode)."""
        seen.parts.append(delta)
        seen.since += len(delta)
        if self.stream_checks and seen.since >= self.stream_every:
            await self._stream_check(agent, ctx, messages, seen, pending)
            return False
        return self.blocking

    async def _at_end(self, agent: AgentView, ctx: RuntimeContext, messages: tuple[Msg, ...],
                      texts: dict[str, _Seen], pending: set[asyncio.Future[Any]]) -> None:
        """The stream ended: the stream checks see what none saw yet, and the background checks
        are settled, before what was held goes out."""
        if self.stream_checks:
            await self._check_unchecked(agent, ctx, messages, texts, pending)
        if pending:
            await _settle(ctx, pending)

    async def _check_unchecked(self, agent: AgentView, ctx: RuntimeContext, messages: tuple[Msg, ...],
                               texts: dict[str, _Seen], pending: set[asyncio.Future[Any]]) -> None:
        for seen in texts.values():
            if seen.since:
                await self._stream_check(agent, ctx, messages, seen, pending)

    async def _stream_check(self, agent: AgentView, ctx: RuntimeContext, messages: tuple[Msg, ...],
                            seen: _Seen, pending: set[asyncio.Future[Any]]) -> None:
        window, since = self.stream_window, seen.since
        seen.since = 0
        text = seen.text()
        shown = text if window is None else text[-window:]
        check = GuardrailCheck("stream", shown, messages, agent, ctx, delta=text[-since:], kind=seen.kind,
                               tool_name=seen.tool_name)
        if self.blocking:
            await self._run("stream", self.stream_checks, check)
            return
        for guardrail in self.stream_checks:
            value = call_check(guardrail, check)
            if is_awaitable(value):
                pending.add(_judging(guardrail, value))
            else:
                _judge(guardrail, value, "stream")

    async def _output_check(self, agent: AgentView, ctx: RuntimeContext, messages: tuple[Msg, ...],
                            texts: dict[str, _Seen]) -> None:
        """The output checks on each whole text of the reply: its answer (also when empty, as a
        reply of tool calls alone), its reasoning and each tool call's arguments."""
        answer = texts["text"].text() if "text" in texts else ""
        reply = Msg.assistant(answer)
        await self._run("output", self.output_checks, GuardrailCheck("output", answer, messages, agent, ctx,
                                                                     reply=reply))
        for seen in texts.values():
            if seen.kind != "text":
                check = GuardrailCheck("output", seen.text(), messages, agent, ctx, reply=reply, kind=seen.kind,
                                       tool_name=seen.tool_name)
                await self._run("output", self.output_checks, check)

    # -- the guarded tool results (covers=("tool_result", ...)) ---------------------------------

    async def _guard_results(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next
                             ) -> AsyncIterator[Any]:
        released = OpenBrackets(top_only=True)
        pending: set[asyncio.Future[Any]] = set()
        it: Any = next(input).__aiter__()
        try:
            try:
                async with aclosing(self._checked_results(agent, ctx, it, pending)) as checked:
                    async for out in checked:
                        released.see(out)
                        yield out
            except _Trip as trip:
                await aclose(it)  # the tools still running are cancelled
                for ev in self._trip_events(trip, released, ctx, refuse=False):
                    yield ev
                if self.exit_behavior == "error":
                    raise GuardrailTripped(trip.guardrail, trip.reason) from None
        finally:
            for task in pending:
                task.cancel()
            await aclose(it)

    async def _checked_results(self, agent: AgentView, ctx: RuntimeContext, it: Any,
                               pending: set[asyncio.Future[Any]]) -> AsyncGenerator[Any, None]:
        """The acting events, each tool result's text checked as it streams and whole at its end;
        in blocking mode held until the checks covering them passed."""
        stream_checks, blocking = self.stream_checks, self.blocking
        hold_results = blocking and bool(self.output_checks)  # a result waits for its output check
        holding = False
        held: list[Any] = []
        texts: dict[str, _Seen] = {}  # tool call id -> its result's text
        async with aclosing(_racing(it, pending)) as events:
            async for ev in events:
                cls = type(ev)
                top = ev.source is None
                if cls is ToolResultTextDelta and top:
                    seen = texts.get(ev.tool_call_id)
                    if seen is None:
                        seen = texts[ev.tool_call_id] = _Seen("tool_result", ev.tool_name)
                    if await self._saw(agent, ctx, (), seen, ev.delta, pending):
                        held.append(ev)  # unchecked text waits
                        continue
                elif blocking and stream_checks:  # nothing goes out past unchecked text
                    await self._check_unchecked(agent, ctx, (), texts, pending)
                if cls is ToolResultStart and top:
                    holding = hold_results
                elif cls is ToolResultEnd and top:
                    done = texts.pop(ev.tool_call_id, None)
                    if done is not None:
                        if stream_checks and done.since:
                            await self._stream_check(agent, ctx, (), done, pending)
                        if pending:
                            await _settle(ctx, pending)
                        if self.output_checks:
                            check = GuardrailCheck("output", done.text(), (), agent, ctx, kind="tool_result",
                                                   tool_name=done.tool_name)
                            await self._run("output", self.output_checks, check)
                    holding = False
                if holding:
                    held.append(ev)
                    continue
                if held:
                    for out in held:
                        yield out
                    held.clear()
                yield ev
        await self._at_end(agent, ctx, (), texts, pending)
        for out in held:
            yield out

    async def _run(self, stage: Stage, guardrails: Sequence[Guardrail], check: GuardrailCheck) -> None:
        """Runs ``guardrails`` on ``check`` (the async ones together); raises `_Trip` on the first
        trip in their order."""
        waits: list[tuple[Guardrail, Any]] = []
        try:
            for guardrail in guardrails:
                value = call_check(guardrail, check)
                if is_awaitable(value):
                    waits.append((guardrail, value))
                else:
                    _judge(guardrail, value, stage)
        except BaseException:
            for _, value in waits:  # (started checks a synchronous trip made moot)
                close = getattr(value, "close", None)
                if close is not None:
                    close()
            raise
        if waits:
            # The run waits for the checks (a moderation service may take long): an interrupt ends
            # the wait at once (`RuntimeContext.wait`), and the checks are cancelled.
            values = await check.ctx.wait(asyncio.gather(*(v for _, v in waits)))
            for (guardrail, _), value in zip(waits, values, strict=True):
                _judge(guardrail, value, stage)

    def _trip_events(self, trip: _Trip, released: OpenBrackets, ctx: RuntimeContext, *, refuse: bool = True
                     ) -> list[Any]:
        why = f"GuardrailTripped: guardrail {trip.guardrail} tripped: {trip.reason}"
        # With a refusal, the partial text the caller saw is struck (its call ends discarded) and
        # the refusal is the reply; without one, what went out stays the reply.
        events = released.close(why, discarded=self.exit_behavior == "error" or bool(self.refusal), failed=True)
        if trip.usage is not None:
            if any(type(ev) is ModelCallEnd for ev in events):
                events = [ev.model_copy(update={"usage": trip.usage}) if type(ev) is ModelCallEnd else ev
                          for ev in events]
            else:  # (blocking: the whole call was held, and none of it goes out)
                ctx.add_usage(trip.usage)
        if self.refusal and refuse:
            reply_id = released.reply_id or ctx.reply_id or ""
            block = new_id("blk_")
            events += [TextBlockStart(reply_id=reply_id, block_id=block),
                       TextBlockDelta(reply_id=reply_id, block_id=block, delta=self.refusal),
                       TextBlockEnd(reply_id=reply_id, block_id=block)]
        events.append(GuardrailTrippedEvent(guardrail=trip.guardrail, reason=trip.reason, stage=trip.stage))
        if self.exit_behavior == "end":
            events.append(RequestStop(reason=f"guardrail {trip.guardrail} tripped: {trip.reason}"))
        return events


_KIND_OF: dict[type[Any], Kind] = {
    TextBlockDelta: "text", ThinkingBlockDelta: "thinking", ToolCallDelta: "tool_arguments",
}


class _Seen:
    """One text the caller receives (the answer, the reasoning, or one tool call's arguments):
    what it carried so far, and how much of it no stream check has seen yet."""

    __slots__ = ("kind", "parts", "since", "tool_name")

    def __init__(self, kind: Kind, tool_name: str | None) -> None:
        self.kind, self.tool_name = kind, tool_name
        self.parts: list[str] = []
        self.since = 0

    def text(self) -> str:
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""


def _judge(guardrail: Guardrail, value: Any, stage: Stage) -> None:
    reason = verdict_of(guardrail, value)
    if reason is not None:
        raise _Trip(guardrail.name, reason, stage)


async def _judged(guardrail: Guardrail, value: Any) -> None:
    _judge(guardrail, await value, "stream")


def _judging(guardrail: Guardrail, value: Any) -> asyncio.Future[None]:
    """A background check: a task judging ``value``, the check's answer to come. A task cancelled
    before its first step (the stream cut right after the check was due) never runs `_judged`,
    so a coroutine it was given is closed then, not left never awaited."""
    task = asyncio.ensure_future(_judged(guardrail, value))
    if inspect.iscoroutine(value):
        task.add_done_callback(lambda done: value.close() if done.cancelled() else None)
    return task


async def _step(it: Any) -> tuple[bool, Any]:
    try:
        return True, await it.__anext__()
    except StopAsyncIteration:
        return False, None


async def _racing(it: Any, pending: set[asyncio.Future[Any]]) -> AsyncGenerator[Any, None]:
    """``it``'s events; while background checks are pending, the wait for the next event races
    them, so a check that trips while the model is between chunks stops it at once (`_Trip`)."""
    step: asyncio.Future[tuple[bool, Any]] | None = None
    try:
        while True:
            if not pending:
                more, ev = await _step(it) if step is None else await step
                step = None
            else:
                if step is None:
                    step = asyncio.ensure_future(_step(it))
                await asyncio.wait({step, *pending}, return_when=asyncio.FIRST_COMPLETED)
                _raise_finished(pending)  # a trip (or a failed check) wins over the event
                if not step.done():
                    continue
                more, ev = step.result()
                step = None
            if not more:
                return
            yield ev
    finally:
        if step is not None and not step.done():
            step.cancel()  # (the inner stream is closed by the caller once this returns)
            await asyncio.gather(step, return_exceptions=True)


def _raise_finished(pending: set[asyncio.Future[Any]]) -> None:
    for task in [t for t in pending if t.done()]:
        pending.discard(task)
        task.result()  # a trip (or the check's own error) surfaces here


async def _settle(ctx: RuntimeContext, pending: set[asyncio.Future[Any]]) -> None:
    """Waits for the background checks, as a wait of the run (an interrupt ends it and cancels
    them); the first trip (or failure) cancels the others."""
    try:
        while pending:
            task = pending.pop()
            await ctx.wait(task)
    finally:
        for task in pending:
            task.cancel()
        pending.clear()
