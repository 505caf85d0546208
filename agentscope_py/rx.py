"""reactivex and aioreactive interop for `EventStream`.

Our own adapters, not the libraries':
aioreactive 0.20's ``from_async_iterable`` loses producer errors and its ``take``/``catch``/``retry``
leak or hang; reactivex's ``retry`` shares its counter between subscriptions. Every adapter here
closes its producer when the consumer stops and carries errors both ways.

Built in a hook inside a run (`HOOK_CONTROL`), an adapter waits for what its pipeline pushes
through the run's control (`RunControl.wait`): what a time operator holds (a ``sample`` period, a
``delay``, a buffer's window) is a wait of the run, and an interrupt ends it at once, as it ends
the model call's read, instead of after the operator's timer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import reactivex
from reactivex.disposable import Disposable
from reactivex.scheduler.eventloop import AsyncIOScheduler

from ._control import HOOK_CONTROL, RunControl
from .stream import Channel, EventStream, aclose, aclosing

__all__ = [
    "from_async_observable",
    "from_observable",
    "pipe_operators",
    "to_async_observable",
    "to_observable",
]


T = TypeVar("T")


class _TrackingScheduler(AsyncIOScheduler):
    """An AsyncIOScheduler that notes whether the pipeline ever deferred work to the loop.

    A pipeline of synchronous operators (map, filter, scan, take…) never schedules, so `pipe` can
    pull the upstream inline; once an operator schedules (delay, debounce, catch's resubscribe),
    items can arrive between pulls and `pipe` races the upstream against them."""

    used = False

    def schedule(self, action: Any, state: Any = None) -> Any:
        self.used = True
        return super().schedule(action, state)

    def schedule_relative(self, duetime: Any, action: Any, state: Any = None) -> Any:
        self.used = True
        return super().schedule_relative(duetime, action, state)

    def schedule_absolute(self, duetime: Any, action: Any, state: Any = None) -> Any:
        self.used = True
        return super().schedule_absolute(duetime, action, state)


class _Sink(Channel):
    """A `Channel` that a reactivex pipeline pushes into (an observer): reactivex calls back
    synchronously, so items are appended without waiting for room (the pulling coroutine takes
    them before it pulls the upstream again, which bounds them)."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(1 << 30)

    def on_next(self, item: Any) -> None:
        self.push(item)

    def on_error(self, error: BaseException) -> None:
        self.finish(error)

    def on_completed(self) -> None:
        self.finish(None)


def pipe_operators(upstream: AsyncIterator[Any], operators: Sequence[Any]) -> AsyncIterator[Any]:
    """The upstream is pulled once: an operator that re-subscribes (rx ``retry``, ``repeat``)
    sees the remaining items, not a restart — and once the upstream has ended, its end (its
    completion or its error) again, so a ``retry`` after the upstream failed fails too instead
    of waiting for items that never come. Use `EventStream.retry` to re-run a stream.

    Called inside a run's hook (`HOOK_CONTROL`), a wait for items the operators push is cut by
    the run's interrupt (it raises `AgentInterrupted`)."""
    return _piped(upstream, operators, HOOK_CONTROL.get())


async def _piped(
    upstream: AsyncIterator[Any], operators: Sequence[Any], control: RunControl | None,
) -> AsyncIterator[Any]:
    loop = asyncio.get_running_loop()
    scheduler = _TrackingScheduler(loop)
    observers: list[Any] = []
    ended: list[Exception | None] = []  # the upstream's end once it came: None, or its error

    sink = _Sink()

    def subscribe(observer: Any, _scheduler: Any = None) -> Disposable:
        if ended:
            # After the upstream's end, nothing remains but that end.
            observer.on_completed() if ended[0] is None else observer.on_error(ended[0])
            return Disposable()
        # Operators such as catch subscribe through the scheduler, i.e. later: wake the puller.
        observers.append(observer)
        sink.wake()
        return Disposable(lambda: observers.remove(observer) if observer in observers else None)

    def end(error: Exception | None) -> None:
        ended.append(error)
        if observers:  # (none while an operator re-subscribes: it sees the end when it does)
            observers[0].on_completed() if error is None else observers[0].on_error(error)

    subscription = reactivex.create(subscribe).pipe(*operators).subscribe(
        on_next=sink.on_next, on_error=sink.on_error, on_completed=sink.on_completed, scheduler=scheduler
    )
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            while sink.items:
                yield sink.take()
            if sink.done:
                sink.end()
                return
            if ended or not observers:
                await (sink.wait() if control is None else control.wait(sink.arrival()))
                continue
            if scheduler.used:
                # Items may arrive from the loop while the upstream is quiet: race the two.
                if pending is None:
                    pending = asyncio.ensure_future(upstream.__anext__())
                either = asyncio.wait((pending, sink.arrival()), return_when=asyncio.FIRST_COMPLETED)
                await (either if control is None else control.wait(either))
                if not pending.done():
                    continue
                step, pending = pending, None
                try:
                    item = step.result()
                except StopAsyncIteration:
                    end(None)
                    continue
                except Exception as exc:
                    end(exc)
                    continue
            else:
                try:
                    item = await upstream.__anext__()
                except StopAsyncIteration:
                    end(None)
                    continue
                except Exception as exc:
                    end(exc)
                    continue
            if observers:
                observers[0].on_next(item)
    finally:
        subscription.dispose()
        if pending is not None:
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            elif not pending.cancelled():
                # The pull ended as the consumer left (an interrupt cuts both at once): its
                # outcome is taken here, the consumer leaves with its own.
                pending.exception()
        await aclose(upstream)


def to_observable(stream: EventStream[T]) -> reactivex.Observable[T]:
    """A cold reactivex Observable: each subscription iterates the stream in a task (subscribe
    inside a running loop); disposing cancels the task and closes the producer."""

    def subscribe(observer: Any, _scheduler: Any = None) -> Disposable:
        async def run() -> None:
            try:
                async with aclosing(stream.__aiter__()) as it:
                    async for item in it:
                        observer.on_next(item)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                observer.on_error(exc)
                return
            observer.on_completed()

        task = asyncio.get_running_loop().create_task(run())
        def dispose() -> None:
            task.cancel()

        return Disposable(dispose)

    return reactivex.create(subscribe)


def from_observable(observable: reactivex.Observable[T]) -> EventStream[T]:
    """Subscribe at each iteration (on the AsyncIOScheduler); closing the iteration disposes.

    reactivex pushes without backpressure, so items wait in an unbounded buffer. Built inside a
    run's hook (`HOOK_CONTROL`), a wait for the next item is cut by the run's interrupt."""
    control = HOOK_CONTROL.get()

    async def gen() -> AsyncIterator[T]:
        sink = _Sink()
        sub = observable.subscribe(
            on_next=sink.on_next,
            on_error=sink.on_error,
            on_completed=sink.on_completed,
            scheduler=AsyncIOScheduler(sink.loop),
        )
        try:
            async for item in _drain(sink, control):
                yield item
        finally:
            sub.dispose()

    return EventStream(gen)


def _drain(channel: Channel, control: RunControl | None) -> AsyncIterator[Any]:
    """`Channel.drain`, its waits through ``control`` when there is one."""
    return channel.drain(None if control is None else control.wait)


def to_async_observable(stream: EventStream[Any]) -> Any:
    """An aioreactive ``AsyncObservable``: each subscription iterates the stream in a task,
    awaiting the observer per item (backpressure); ``dispose_async()`` closes the producer."""
    from aioreactive import AsyncObservable
    from expression.system import AsyncDisposable

    class _Observable(AsyncObservable[Any]):
        async def subscribe_async(
            self,
            send: Any = None,
            throw: Callable[[Exception], Any] | None = None,
            close: Callable[[], Any] | None = None,
        ) -> Any:
            observer = _as_observer(send, throw, close)

            async def run() -> None:
                try:
                    async with aclosing(stream.__aiter__()) as it:
                        async for item in it:
                            await observer.asend(item)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    await observer.athrow(exc)
                    return
                await observer.aclose()

            task = asyncio.get_running_loop().create_task(run())

            async def dispose() -> None:
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task

            return AsyncDisposable.create(dispose)

    return _Observable()


def _as_observer(send: Any, throw: Any, close: Any) -> Any:
    from aioreactive import AsyncAnonymousObserver

    if send is not None and hasattr(send, "asend"):
        return send
    return AsyncAnonymousObserver(send, throw, close)


def from_async_observable(observable: Any, buffer: int = 64) -> EventStream[Any]:
    """Subscribe at each iteration with an observer that awaits room in a bounded buffer (so a
    fast producer waits for a slow consumer); closing the iteration disposes the subscription.
    Built inside a run's hook (`HOOK_CONTROL`), a wait for the next item is cut by the run's
    interrupt."""
    from aioreactive import AsyncAnonymousObserver

    control = HOOK_CONTROL.get()

    async def gen() -> AsyncIterator[Any]:
        channel = Channel(buffer)

        async def athrow(exc: Exception) -> None:
            channel.finish(exc)

        async def aclose_() -> None:
            channel.finish(None)

        observer = AsyncAnonymousObserver(channel.put, athrow, aclose_)
        disposable = await observable.subscribe_async(observer)
        try:
            async for item in _drain(channel, control):
                yield item
        finally:
            await disposable.dispose_async()

    return EventStream(gen)
