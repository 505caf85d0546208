"""`TimeoutMiddleware`: deadlines for a model call, each tool call, and the whole run.

How a deadline is kept without a timer per event: one `_Watch` per timed stream holds one
deadline, kept by its loop's `_Clock` (one loop timer for all of them). When the deadline passes
while the layer's generator waits on the inner stream (its ``ag_await`` is set: nothing is marked
per event), the watch cancels the waiting task (as ``asyncio.timeout`` does), the cancellation
runs through the inner layers, which close what they opened (the model call's own task is
cancelled and the provider's stream closed, so its connection goes), and the layer takes the
cancellation back and raises its typed error. A timer that fires while the consumer holds an
event only marks the watch: the next read fails at once. Per event that costs two tests.

* Model call: ``first_event_timeout`` bounds the wait for the call's first event,
  ``model_timeout`` its whole duration (both from the subscription); either raises
  `ModelTimeoutError` (``retryable``: a `RetryMiddleware` outside retries it). Events already out
  are closed by the runtime (``ModelCallEnd(error=…, discarded=True)``).
* Tool call: ``tool_timeout`` runs from the call's ``ToolResultStart`` leaving the acting stream
  to its End (for calls of a parallel group, from when its turn in the output comes). The call
  gets an error result the model sees; the calls of the batch that had not started to stream are
  then run (again, for a parallel sibling the timeout cut short).
* Run: ``run_timeout`` bounds the whole execution (``on_agent``); the run fails with
  `MiddlewareTermination` (its open brackets closed by the runtime).
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import AsyncIterator
from functools import partial
from typing import TYPE_CHECKING, Any

from ..errors import ModelTimeoutError, RunTimeoutError
from ..events import AgentEvent, ToolResultEnd, ToolResultStart, ToolResultTextDelta
from ..message import ToolResultState
from ..model.base import ChatModel
from ..stream import EventStream
from .base import ActingInput, AgentInput, ExtensionPoint, MiddlewareBase, ModelCallInput, Next

if TYPE_CHECKING:
    from ..agent.context import RuntimeContext
    from ..agent.react import ReActAgent

__all__ = ["TimeoutMiddleware"]


def _seconds(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0 (or None), got {value!r}")
    return float(value)


class TimeoutMiddleware(MiddlewareBase):
    """Deadlines, each optional (at least one): ``first_event_timeout`` and ``model_timeout`` per
    model call, ``tool_timeout`` per tool call, ``run_timeout`` per run. Active only at the points
    it has a deadline for. See the module docstring for what a timeout does at each point."""

    def __init__(
        self,
        *,
        model_timeout: float | None = None,
        first_event_timeout: float | None = None,
        tool_timeout: float | None = None,
        run_timeout: float | None = None,
    ) -> None:
        self.model_timeout = _seconds("model_timeout", model_timeout)
        self.first_event_timeout = _seconds("first_event_timeout", first_event_timeout)
        self.tool_timeout = _seconds("tool_timeout", tool_timeout)
        self.run_timeout = _seconds("run_timeout", run_timeout)
        if not any((model_timeout, first_event_timeout, tool_timeout, run_timeout)):
            raise ValueError("TimeoutMiddleware needs at least one of model_timeout, first_event_timeout, "
                             "tool_timeout, run_timeout")

    def active_points(self) -> frozenset[ExtensionPoint]:
        points = set()
        if self.model_timeout or self.first_event_timeout:
            points.add(ExtensionPoint.ON_MODEL_CALL)
        if self.tool_timeout:
            points.add(ExtensionPoint.ON_ACTING)
        if self.run_timeout:
            points.add(ExtensionPoint.ON_AGENT)
        return frozenset(points)

    def on_agent(self, agent: ReActAgent, ctx: RuntimeContext, input: AgentInput, next: Next) -> Any:
        inner = next(input)
        limit = self.run_timeout
        assert limit is not None
        return EventStream(partial(_timed_stream, inner, None, limit, None))

    def on_model_call(self, agent: ReActAgent, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        # A C partial, no closure: the error is made only when a deadline passes.
        return EventStream(partial(_timed_stream, next(input), self.first_event_timeout, self.model_timeout,
                                   input.model))

    def on_acting(self, agent: ReActAgent, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        inner = next(input)
        limit = self.tool_timeout
        assert limit is not None
        return EventStream(partial(_timed_tools_stream, inner, input, next, limit))


def _timed_out(model: ChatModel | None, first: float | None, total: float | None,
               before_first: bool) -> BaseException:
    """The error of the deadline that passed: a model call's (``model``), else the run's."""
    if model is None:
        return RunTimeoutError(f"the run did not finish within {total:g} s (TimeoutMiddleware)")
    name, provider = model.name, getattr(model, "provider", None)
    if before_first:
        return ModelTimeoutError(f"model {name} sent nothing within {first:g} s", provider=provider)
    return ModelTimeoutError(f"model {name} did not finish within {total:g} s", provider=provider)


class _Clock:
    """The deadlines of a loop's watches behind one loop timer, armed for the earliest of them.

    Arming a watch is a dict store (and a loop timer only when its deadline is the earliest);
    disarming is a dict delete: no timer is made or cancelled per stream. When the timer fires,
    the live watches are scanned once: the due ones fire (in the order of their deadlines, as their
    own timers would), and the timer is armed again for the earliest of the rest. A stream that
    ends first (as nearly all do) leaves nothing behind."""

    __slots__ = ("armed", "handle", "live", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.live: dict[_Watch, float] = {}  # watch -> its deadline
        self.handle: asyncio.TimerHandle | None = None
        self.armed = math.inf  # when the loop timer fires

    def _arm(self, when: float) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.armed = when
        self.handle = self.loop.call_at(when, self._tick)

    def _tick(self) -> None:
        self.handle = None
        due = max(self.armed, self.loop.time())
        self.armed = math.inf
        live = self.live
        fired = sorted((when, i, w) for i, (w, when) in enumerate(live.items()) if when <= due)
        for _, _, watch in fired:
            del live[watch]
        for _, _, watch in fired:
            watch.fire()
        if live and self.handle is None:
            self._arm(min(live.values()))


_clocks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Clock] = weakref.WeakKeyDictionary()
# [loop, clock] of the last watch, so the weak dictionary is read only when the loop changes (it
# keeps that one loop alive until a watch on another loop is made).
_last_clock: list[Any] = [None, None]


def _clock_of(loop: asyncio.AbstractEventLoop) -> _Clock:
    if _last_clock[0] is loop:
        return _last_clock[1]  # type: ignore[no-any-return]
    try:
        clock = _clocks.get(loop)
        if clock is None:
            clock = _clocks[loop] = _Clock(loop)
    except TypeError:  # a loop without weak references: a clock of the watch's own
        return _Clock(loop)
    _last_clock[0], _last_clock[1] = loop, clock
    return clock


class _Watch:
    """One deadline for the timed stream ``agen``, read by ``task`` (module docstring), kept by its
    loop's `_Clock`. Whether the stream is waiting on its inner stream when the deadline passes is
    the generator's own state (``ag_await``: set while it awaits, None while the consumer holds
    an event), so the happy path marks nothing per event."""

    __slots__ = ("agen", "cancelled", "clock", "fired", "task")

    agen: Any  # the timed generator (set by its factory)
    task: asyncio.Task[Any]
    clock: _Clock

    def __init__(self) -> None:
        self.fired = self.cancelled = False

    def start(self) -> float:
        """At the stream's first step, in the task that reads it: the loop's time."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)  # (given the loop: it is not looked up twice)
        assert task is not None
        self.task = task
        # The clock of the last watch's loop, else the loop's (the weak dictionary read only then).
        self.clock = _last_clock[1] if _last_clock[0] is loop else _clock_of(loop)
        return loop.time()

    def arm(self, when: float) -> None:
        clock = self.clock
        self.fired = False
        clock.live[self] = when
        if when < clock.armed:
            clock._arm(when)

    def disarm(self) -> None:
        self.clock.live.pop(self, None)

    def fire(self) -> None:
        self.fired = True
        if self.agen.ag_await is not None and not self.cancelled:  # waiting on the inner stream
            self.cancelled = True
            self.task.cancel()

    def took_back(self) -> bool:
        """After the read ended: whether this watch's cancellation is what ended it (then it is
        taken back)."""
        if not self.cancelled:
            return False
        self.cancelled = False
        self.task.uncancel()
        return True


def _timed_stream(
    inner: EventStream[AgentEvent], first: float | None, total: float | None, model: ChatModel | None,
) -> AsyncIterator[AgentEvent]:
    """The factory of a timed model call (``model``) or run (None): the generator, and the watch
    that knows it."""
    watch = _Watch()
    agen = watch.agen = _timed(inner, watch, first, total, model)
    return agen


async def _timed(
    inner: EventStream[AgentEvent], watch: _Watch, first: float | None, total: float | None,
    model: ChatModel | None,
) -> AsyncIterator[AgentEvent]:
    now = watch.start()
    end = None if total is None else now + total
    first_end = None if first is None else now + first
    # Until the first event, the earlier deadline is the one that counts.
    waiting_first = first_end is not None and (end is None or first_end < end)
    when = first_end if waiting_first else end
    if when is not None:
        watch.arm(when)
    it = inner.__aiter__()
    # Per event: a test of ``fired`` after the read (a cancellation an inner layer swallowed) and
    # one after the consumer gave control back (it fired while the consumer held the event: the
    # next read fails at once).
    try:
        if waiting_first:
            async for ev in it:
                if watch.fired:
                    _swallowed(watch)
                    raise _timed_out(model, first, total, True)
                waiting_first = False
                if end is None:
                    watch.disarm()
                else:
                    watch.arm(end)
                yield ev
                break
            else:
                return
        if watch.fired:
            raise _timed_out(model, first, total, False)
        async for ev in it:
            if watch.fired:
                _swallowed(watch)
                raise _timed_out(model, first, total, False)
            yield ev
            if watch.fired:
                raise _timed_out(model, first, total, False)
    except asyncio.CancelledError:
        if watch.cancelled and watch.took_back():
            raise _timed_out(model, first, total, waiting_first) from None
        raise
    finally:
        watch.disarm()
        close = getattr(it, "aclose", None)
        if close is not None:
            await close()


def _swallowed(watch: _Watch) -> None:
    """The watch fired during a read that returned anyway: an inner layer swallowed its
    cancellation (take it back), or it fired just as the event came."""
    if watch.cancelled:
        watch.took_back()


def _timed_tools_stream(inner: EventStream[AgentEvent], input: ActingInput, next: Next,
                        limit: float) -> AsyncIterator[AgentEvent]:
    watch = _Watch()
    agen = watch.agen = _timed_tools(inner, watch, input, next, limit)
    return agen


async def _timed_tools(
    inner: EventStream[AgentEvent], watch: _Watch, input: ActingInput, next: Next, limit: float,
) -> AsyncIterator[AgentEvent]:
    watch.start()
    loop_time = watch.clock.loop.time
    calls = input.tool_calls
    ids = {c.id for c in calls} if len(calls) > 1 else None  # (one call: compared directly)
    only = calls[0].id if calls else None
    started: list[str] = []
    open_call: ToolResultStart | None = None
    it: AsyncIterator[Any] = inner.__aiter__()
    # Per event: a test of ``fired`` after the read (a cancellation an inner layer swallowed) and
    # one after the consumer gave control back (it fired while the consumer held the event).
    try:
        async for ev in it:
            if watch.fired:
                if watch.cancelled:
                    watch.took_back()
                break  # the open call timed out
            cls = type(ev)
            if cls is ToolResultStart:
                call_id = ev.tool_call_id
                if ev.source is None and (call_id == only if ids is None else call_id in ids):
                    open_call = ev
                    started.append(call_id)
                    watch.arm(loop_time() + limit)
            elif cls is ToolResultEnd and open_call is not None and ev.tool_call_id == open_call.tool_call_id:
                open_call = None
                watch.disarm()
            yield ev
            if watch.fired:
                break  # the open call timed out
        else:
            return
    except asyncio.CancelledError:
        if not (watch.cancelled and watch.took_back()):
            raise
        # the open call timed out
    finally:
        watch.disarm()
        close = getattr(it, "aclose", None)
        if close is not None:
            await close()
    # A call timed out: the acting stream was cut. Give it its error result, then run the rest.
    assert open_call is not None
    cut = open_call
    yield ToolResultTextDelta(reply_id=cut.reply_id, tool_call_id=cut.tool_call_id, tool_name=cut.tool_name,
                              delta=f"Error: {cut.tool_name} timed out after {limit:g} s (TimeoutMiddleware).")
    yield ToolResultEnd(reply_id=cut.reply_id, tool_call_id=cut.tool_call_id, tool_name=cut.tool_name,
                        state=ToolResultState.ERROR)
    rest = [c for c in input.tool_calls if c.id not in started]
    if rest:
        again = input.replace(tool_calls=rest)
        async for ev in _timed_tools_stream(next(again), again, next, limit):
            yield ev
