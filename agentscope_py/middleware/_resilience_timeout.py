"""`TimeoutMiddleware`: deadlines for a model call, each tool call, and the whole run.

How a deadline is kept without a timer per event: one `_Watch` per timed stream holds one
deadline, kept by its loop's `_Clock` (one loop timer for all of them). The layer marks when it is
waiting on the inner stream; when the deadline passes while it waits, it cancels the waiting
task (as ``asyncio.timeout`` does), the cancellation runs through
the inner layers, which close what they opened (the model call's own task is cancelled and the
provider's stream closed, so its connection goes), and the layer takes the cancellation back and
raises its typed error. A timer that fires while the consumer is busy elsewhere only marks the
watch: the next read fails at once. Per event that costs two attribute stores and a test.

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
import heapq
import math
import weakref
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from ..errors import ModelTimeoutError, RunTimeoutError
from ..events import AgentEvent, ToolResultEnd, ToolResultStart, ToolResultTextDelta
from ..message import ToolResultState
from ..stream import EventStream, aclose
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
        return EventStream(partial(_timed, inner, None, limit, partial(_run_timed_out, limit)))

    def on_model_call(self, agent: ReActAgent, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        inner = next(input)
        first, total = self.first_event_timeout, self.model_timeout
        model = input.model
        # C partials, no closures: the errors are made only when a deadline passes.
        timed_out = partial(_model_timed_out, model.name, getattr(model, "provider", None), first, total)
        return EventStream(partial(_timed, inner, first, total, timed_out))

    def on_acting(self, agent: ReActAgent, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        inner = next(input)
        limit = self.tool_timeout
        assert limit is not None
        return EventStream(partial(_timed_tools, inner, input, next, limit))


def _run_timed_out(limit: float, first: bool) -> BaseException:
    return RunTimeoutError(f"the run did not finish within {limit:g} s (TimeoutMiddleware)")


def _model_timed_out(name: str, provider: Any, first: float | None, total: float | None,
                     before_first: bool) -> BaseException:
    if before_first:
        return ModelTimeoutError(f"model {name} sent nothing within {first:g} s", provider=provider)
    return ModelTimeoutError(f"model {name} did not finish within {total:g} s", provider=provider)


class _Clock:
    """The deadlines of a loop's watches behind one loop timer, armed for the earliest of them.

    Arming a watch is a heap push (tuples: the comparisons are C's, where the loop's own heap of
    `TimerHandle` compares in Python) and at most one loop timer; disarming is a store. A deadline
    left behind (its stream ended first, as nearly all do) is dropped when it reaches the top of
    the heap, or when the stale ones are half the heap (so it stays small however long the
    deadlines). Watches fire in the order of their deadlines, as their own timers would."""

    __slots__ = ("armed", "handle", "heap", "loop", "seq", "stale")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.heap: list[tuple[float, int, _Watch]] = []
        self.handle: asyncio.TimerHandle | None = None
        self.armed = math.inf  # when the loop timer fires
        self.seq = 0
        self.stale = 0

    def add(self, watch: _Watch, when: float) -> int:
        self.seq = seq = self.seq + 1
        heapq.heappush(self.heap, (when, seq, watch))
        if when < self.armed:
            self._arm(when)
        return seq

    def drop(self) -> None:
        """A deadline was disarmed (its entry stays in the heap until it is dropped)."""
        self.stale = stale = self.stale + 1
        heap = self.heap
        if stale > 32 and stale * 2 > len(heap):
            self.heap = [e for e in heap if e[2].seq == e[1]]
            heapq.heapify(self.heap)
            self.stale = 0

    def _arm(self, when: float) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.armed = when
        self.handle = self.loop.call_at(when, self._tick)

    def _tick(self) -> None:
        self.handle = None
        due = max(self.armed, self.loop.time())
        self.armed = math.inf
        heap = self.heap
        while heap:
            when, seq, watch = heap[0]
            if watch.seq != seq:  # disarmed or armed again since: stale
                heapq.heappop(heap)
                self.stale = max(0, self.stale - 1)
                continue
            if when > due:
                self._arm(when)
                return
            heapq.heappop(heap)
            watch.seq = 0
            watch.fire()
        self.stale = 0  # (the heap is empty)


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
    """One deadline for a stream read by ``task`` (module docstring), kept by its loop's `_Clock`."""

    __slots__ = ("cancelled", "clock", "fired", "loop", "seq", "task", "waiting")

    def __init__(self) -> None:
        self.loop = loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)  # (given the loop: it is not looked up twice)
        assert task is not None
        self.task = task
        self.clock = _clock_of(loop)
        self.waiting = False
        self.fired = False
        self.cancelled = False
        self.seq = 0  # the clock's entry of the armed deadline (0: none)

    def arm(self, when: float | None) -> None:
        self.disarm()
        self.fired = False
        if when is not None:
            self.seq = self.clock.add(self, when)

    def disarm(self) -> None:
        if self.seq:
            self.seq = 0
            self.clock.drop()

    def fire(self) -> None:
        self.fired = True
        if self.waiting and not self.cancelled:
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


async def _timed(
    inner: EventStream[AgentEvent], first: float | None, total: float | None,
    timed_out: Callable[[bool], BaseException],
) -> AsyncIterator[AgentEvent]:
    """``timed_out(before_first)``: the error of the deadline that passed (the first event's, or
    the whole stream's)."""
    watch = _Watch()
    now = watch.loop.time()
    end = None if total is None else now + total
    first_end = None if first is None else now + first
    # Until the first event, the earlier deadline is the one that counts.
    waiting_first = first_end is not None and (end is None or first_end < end)
    watch.arm(first_end if waiting_first else end)
    it = inner.__aiter__()
    anext = it.__anext__  # (bound once, not per event)
    # Per event: a test of ``fired``, two stores of ``waiting`` and a test of ``cancelled`` (what
    # ``took_back`` tests first, inlined: a method call per event was a fifth of this loop).
    try:
        while True:
            if watch.fired:
                raise timed_out(waiting_first)
            watch.waiting = True
            try:
                ev = await anext()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if watch.cancelled and watch.took_back():
                    raise timed_out(waiting_first) from None
                raise
            finally:
                watch.waiting = False
            if watch.cancelled and watch.took_back():  # an inner layer swallowed the cancellation
                raise timed_out(waiting_first)
            if waiting_first:
                waiting_first = False
                watch.arm(end)
            yield ev
    finally:
        watch.disarm()
        await aclose(it)


async def _timed_tools(
    inner: EventStream[AgentEvent], input: ActingInput, next: Next, limit: float,
) -> AsyncIterator[AgentEvent]:
    watch = _Watch()
    ids = {c.id for c in input.tool_calls}
    started: set[str] = set()
    open_call: ToolResultStart | None = None
    it: AsyncIterator[Any] = inner.__aiter__()
    anext = it.__anext__
    try:
        while True:
            if watch.fired and open_call is not None:
                break  # it fired while the consumer was busy: the open call timed out
            watch.waiting = True
            try:
                ev = await anext()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not (watch.cancelled and watch.took_back()):
                    raise
                break  # the open call timed out
            finally:
                watch.waiting = False
            if watch.cancelled and watch.took_back():  # an inner layer swallowed the cancellation
                break
            cls = type(ev)
            if cls is ToolResultStart:
                if ev.source is None and ev.tool_call_id in ids:
                    open_call = ev
                    started.add(ev.tool_call_id)
                    watch.arm(watch.loop.time() + limit)
            elif cls is ToolResultEnd and open_call is not None and ev.tool_call_id == open_call.tool_call_id:
                open_call = None
                watch.arm(None)
            yield ev
    finally:
        watch.disarm()
        await aclose(it)
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
        async for ev in _timed_tools(next(again), again, next, limit):
            yield ev
