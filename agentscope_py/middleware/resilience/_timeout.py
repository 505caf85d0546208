"""`TimeoutMiddleware`: deadlines for a model call, each tool call, and the whole run.

A model call's and a tool call's deadlines are not kept by a layer around their streams: the hook
passes a `Deadline` inward on the record (``input.with_deadline(…)``) and the innermost call
keeps it in the task it runs in (`_deadline`). So an installed timeout that never fires costs
about what a pass-through hook does, a consumer busy with an event is never interrupted, and a
call that finished in time never fails because its consumer was slow to read it.

* Model call: ``first_event_timeout`` bounds the wait for the call's first chunk,
  ``model_timeout`` its whole duration (both from when the model call starts; each attempt of a
  retry or fallback *outside* gets its own); either raises `ModelTimeoutError` (``retryable``: a
  `RetryMiddleware` outside retries it). The cancellation runs through the provider's stream,
  which closes. Events already out are closed by the runtime (``ModelCallEnd(error=…,
  discarded=True)``).
* Tool call: ``tool_timeout`` bounds each call from when it starts, in its own task (the tool's
  own ``timeout`` counts when it is shorter): the call gets an error result the model sees, and
  the other calls of the batch run as they would.
* Run: ``run_timeout`` bounds the whole execution (``on_agent``), as a layer around the run's
  stream: when the deadline passes while the layer waits for its inner stream, the wait is
  cancelled (as ``asyncio.timeout`` does) and the cancellation taken back; the run fails with
  `RunTimeoutError`, a `MiddlewareTermination` (its open brackets closed by the runtime).

Timeouts nest: a `Deadline` already on the record is tightened, never loosened (`Deadline.within`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial
from typing import TYPE_CHECKING, Any

from ..._deadline import Deadline, check_seconds
from ...errors import RunTimeoutError
from ...events import AgentEvent
from ...extension.base import ActingInput, AgentInput, ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from ...stream import EventStream

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...extension.base import AgentView

__all__ = ["TimeoutMiddleware"]


class TimeoutMiddleware(MiddlewareBase):
    """Deadlines, each optional (at least one): ``first_event_timeout`` and ``model_timeout`` per
    model call, ``tool_timeout`` per tool call, ``run_timeout`` per run. Active only at the points
    it has a deadline for. See the module docstring for what a timeout does at each point."""

    # No "timeout" role for the ordering lints: the model and tool deadlines travel inward on the
    # record and each attempt of a retry on either side keeps its own, and run_timeout bounds the
    # whole run by definition, so no order makes one deadline cover attempts unawares.

    def __init__(
        self,
        *,
        model_timeout: float | None = None,
        first_event_timeout: float | None = None,
        tool_timeout: float | None = None,
        run_timeout: float | None = None,
    ) -> None:
        self.model_timeout = check_seconds("model_timeout", model_timeout)
        self.first_event_timeout = check_seconds("first_event_timeout", first_event_timeout)
        self.tool_timeout = check_seconds("tool_timeout", tool_timeout)
        self.run_timeout = check_seconds("run_timeout", run_timeout)
        if not any((model_timeout, first_event_timeout, tool_timeout, run_timeout)):
            raise ValueError("TimeoutMiddleware needs at least one of model_timeout, first_event_timeout, "
                             "tool_timeout, run_timeout")
        self._model_deadline = Deadline(self.model_timeout, self.first_event_timeout)
        self._tool_deadline = Deadline(self.tool_timeout)

    def active_points(self) -> frozenset[ExtensionPoint]:
        points = set()
        if self.model_timeout or self.first_event_timeout:
            points.add(ExtensionPoint.ON_MODEL_CALL)
        if self.tool_timeout:
            points.add(ExtensionPoint.ON_ACTING)
        if self.run_timeout:
            points.add(ExtensionPoint.ON_AGENT)
        return frozenset(points)

    def on_agent(self, agent: AgentView, ctx: RuntimeContext, input: AgentInput, next: Next) -> Any:
        inner = next(input)
        limit = self.run_timeout
        assert limit is not None
        return EventStream(partial(_timed_stream, inner, limit))

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        return next(input.with_deadline(self._model_deadline))

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        return next(input.with_deadline(self._tool_deadline))


class _Watch:
    """The run's deadline for the timed stream ``agen``, read by ``task``: one loop timer. Whether
    the stream is waiting on its inner stream when the deadline passes is the generator's own
    state (``ag_await``: set while it awaits, None while the consumer holds an event), so nothing
    is marked per event."""

    __slots__ = ("agen", "cancelled", "fired", "handle", "task")

    agen: Any  # the timed generator (set by its factory)
    task: asyncio.Task[Any]

    def __init__(self) -> None:
        self.fired = self.cancelled = False
        self.handle: asyncio.TimerHandle | None = None

    def arm(self, seconds: float) -> None:
        """At the stream's first step, in the task that reads it."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None
        self.task = task
        self.handle = loop.call_later(seconds, self.fire)

    def disarm(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def fire(self) -> None:
        self.handle = None
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


def _timed_stream(inner: EventStream[AgentEvent], total: float) -> AsyncIterator[AgentEvent]:
    """The factory of a timed run: the generator, and the watch that knows it."""
    watch = _Watch()
    agen = watch.agen = _timed(inner, watch, total)
    return agen


async def _timed(inner: EventStream[AgentEvent], watch: _Watch, total: float) -> AsyncIterator[AgentEvent]:
    watch.arm(total)
    it = inner.__aiter__()
    # Per event: a test of ``fired`` after the read (a cancellation an inner layer swallowed) and
    # one after the consumer gave control back (it fired while the consumer held the event: the
    # next read fails at once).
    try:
        async for ev in it:
            if watch.fired:
                if watch.cancelled:
                    watch.took_back()
                raise _timed_out(total)
            yield ev
            if watch.fired:
                raise _timed_out(total)
    except asyncio.CancelledError:
        if watch.cancelled and watch.took_back():
            raise _timed_out(total) from None
        raise
    finally:
        watch.disarm()
        close = getattr(it, "aclose", None)
        if close is not None:
            await close()


def _timed_out(total: float) -> RunTimeoutError:
    return RunTimeoutError(f"the run did not finish within {total:g} s (TimeoutMiddleware)")
