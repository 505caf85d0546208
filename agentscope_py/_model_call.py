"""The innermost model call, in the model call's own task.

`model_call_stream` is the model call as a stream: a prefetch whose producer, `model_events`,
streams the model (retrying and failing over before the first chunk) and hands each chunk to a
`PartsManager` (`_parts`), which puts ModelCallStart, the block Start/Delta/End events and
ModelCallEnd into the prefetch's channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from ._control import RunControl
from ._deadline import Deadline, DeadlineTimer
from ._parts import PartsManager
from .errors import AgentInterrupted
from .events import AgentEvent
from .model.base import ChatChunk, ChatModel, ModelError, ModelRequest
from .stream import Channel, EventStream, prefetched

__all__ = ["FailoverListener", "ModelExecutor", "RetryPolicy", "model_call_stream", "model_events"]

FailoverListener = Callable[[ChatModel, BaseException, ChatModel], Any]
ModelExecutor = Callable[
    [Sequence[ChatModel], ModelRequest, str, RunControl, Deadline | None], EventStream[AgentEvent]]
"""What runs a model call instead of `model_call_stream` (``models``, the request, the reply id,
the run's control, the deadline): `AgentRuntime.model_executor`."""


class RetryPolicy:
    """Retries of retryable errors that happen before the first chunk: exponential backoff with
    full jitter, honouring the provider's retry-after."""

    __slots__ = ("base_delay", "max_delay", "max_retries")

    def __init__(self, max_retries: int = 0, base_delay: float = 0.5, max_delay: float = 20.0) -> None:
        self.max_retries = max_retries
        self.base_delay = base_delay
        self.max_delay = max_delay

    def delay(self, attempt: int, error: BaseException) -> float:
        hint = getattr(error, "retry_after", None)
        if isinstance(hint, int | float) and hint >= 0:
            return min(float(hint), self.max_delay)
        return random.uniform(0, min(self.max_delay, self.base_delay * (2**attempt)))


def _retryable(error: BaseException) -> bool:
    return isinstance(error, ModelError) and error.retryable


async def _recover(
    models: Sequence[ChatModel],
    request: ModelRequest,
    policy: RetryPolicy,
    on_failover: FailoverListener | None,
    error: Exception,
) -> tuple[ChatModel, AsyncIterator[ChatChunk], ChatChunk | None]:
    """The first attempt (``models[0]``) failed with ``error``: retry retryable errors as the
    policy says, then fail over to the next model, until one produces a chunk (or ends cleanly)."""
    i, attempt = 0, 0
    while True:
        if _retryable(error) and attempt < policy.max_retries:
            await asyncio.sleep(policy.delay(attempt, error))
            attempt += 1
        elif i + 1 < len(models):
            if on_failover is not None:
                on_failover(models[i], error, models[i + 1])
            i, attempt = i + 1, 0
        else:
            raise error
        model = models[i]
        it: AsyncIterator[ChatChunk] | None = None
        try:
            it = model.stream(request).__aiter__()
            return model, it, await it.__anext__()
        except StopAsyncIteration:
            assert it is not None
            return model, it, None
        except Exception as exc:
            if it is not None:
                await _close(it)
            error = exc


async def _close(it: Any) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        with contextlib.suppress(Exception):
            await close()


def model_call_stream(
    models: Sequence[ChatModel],
    request: ModelRequest,
    reply_id: str,
    policy: RetryPolicy,
    on_failover: FailoverListener | None,
    control: RunControl | None,
    deadline: Deadline | None = None,
) -> EventStream[AgentEvent]:
    """The events of one model call (``models[0]``, then its fallbacks), produced in a task of
    their own that starts at each subscription, in the context current *now* (so a span opened
    around the innermost ``next()`` parents the model call). See `model_events`."""
    source = functools.partial(model_events, models, request, reply_id, policy, on_failover, control, deadline)
    return prefetched(source, push=True, deferred=True)


async def model_events(
    models: Sequence[ChatModel],
    request: ModelRequest,
    reply_id: str,
    policy: RetryPolicy,
    on_failover: FailoverListener | None,
    control: RunControl | None,
    deadline: Deadline | None,
    out: Channel,
) -> None:
    """Put the block events of one model call into ``out`` (the model call's prefetch buffer: this
    runs as the prefetch's producer, in the model call's own task). Nothing is emitted until the
    first chunk arrives, so a failure before it can be retried or failed over (here, or by a
    middleware) cleanly.

    The chunks become events in a `PartsManager` (`PartsManager.run`): the events of one chunk go
    in together, then the consumer is woken and, if the channel is full, this waits for room.

    With ``control`` (the run's interrupt switch), the task running this is registered for the
    call's lifetime, so an interrupt cancels it, and that cancellation surfaces as
    `AgentInterrupted`.

    With a ``deadline`` (`_deadline`), a timer in this task keeps it: when it passes, the task is
    cancelled (the provider's stream closes) and the call fails with `ModelTimeoutError`."""
    task = _register(control)
    timer = None if deadline is None else DeadlineTimer(deadline.total, deadline.first_event)
    model = models[0]
    try:
        if control is not None:
            control.check()
        it: Any = None
        try:
            it = model.stream(request).__aiter__()
            chunk: ChatChunk | None = await it.__anext__()
        except StopAsyncIteration:
            chunk = None
        except Exception as exc:  # retries and fallback live off the common path
            if it is not None:
                await _close(it)
            model, it, chunk = await _recover(models, request, policy, on_failover, exc)
    except asyncio.CancelledError:
        _unregister(control, task)
        timed_out = timer is not None and timer.stop()
        if control is not None and control.interrupted:
            raise AgentInterrupted("the model call was interrupted") from None
        if timed_out and timer is not None:
            raise timer.error(model) from None
        raise
    except BaseException:
        _unregister(control, task)
        if timer is not None:
            timer.stop()
        raise
    if timer is not None:
        timer.first_arrived()
    parts: PartsManager | None = None
    try:
        parts = PartsManager(reply_id, model.name, out)
        await parts.run(chunk, it, out)
    except BaseException as exc:
        error = exc
        cancelled = isinstance(exc, asyncio.CancelledError)
        interrupted = cancelled and control is not None and control.interrupted
        if interrupted:
            error = AgentInterrupted("the model call was interrupted")
        elif cancelled and timer is not None and timer.expired:
            error = timer.error(model)
        if parts is not None:
            # The closing guarantee (`_brackets`): this call's open blocks end, and ModelCallEnd
            # says why, before the error goes out.
            parts.fail(error, interrupted)
        if error is exc:
            raise
        raise error from None
    finally:
        if timer is not None:
            timer.stop()  # before the close awaits: a deadline passing now must not cancel it
        try:
            await _close(it)
        finally:
            _unregister(control, task)


def _register(control: RunControl | None) -> asyncio.Task[Any] | None:
    if control is None:
        return None
    task = asyncio.current_task()
    assert task is not None
    control.tasks.add(task)
    return task


def _unregister(control: RunControl | None, task: asyncio.Task[Any] | None) -> None:
    if control is not None and task is not None:
        control.tasks.discard(task)
