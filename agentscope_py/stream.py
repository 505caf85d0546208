"""`EventStream`: a small cold stream over async iterators.

Why our own type (measured in ``shared/notes/stream-core-measurements.md``): fused synchronous
operators over plain async generators ran ~2x faster than reactivex and 5-80x faster than
aioreactive, keep backpressure, work with ``async for``, and can close what they open.

The contract:

* **Cold.** A stream holds a factory; every ``async for`` (or ``subscribe``) runs it anew. This is
  how ``retry`` re-runs a model call and how one composed stream can be iterated twice.
* **Fused operators** (``map``, ``filter``, ``do``) add no async layer: they are applied inside
  one loop. Structural operators (``concat_map``, ``flat_map``, ``catch``, ``retry``, ``take``,
  ``take_while``, ``finally_``, ``prefetch``, ``pipe``) add one layer each.
* **Everything closes what it opened**, on completion, error and early exit: breaking out of a
  consumer ends the producer (at once with ``contextlib.aclosing``, within two loop ticks on a
  bare ``break``).
* Works on any values, not only events.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Generic, TypeAlias, TypeVar, cast

if TYPE_CHECKING:
    import reactivex

__all__ = ["Channel", "EventStream", "StreamLike", "Subscription", "to_stream"]

T = TypeVar("T")
U = TypeVar("U")

StreamLike: TypeAlias = "EventStream[T] | AsyncIterable[T] | Iterable[T] | Any"
"""What a hook or an operator callback may return: an EventStream, any async iterable (an
``async def`` generator included), a list/tuple, a reactivex ``Observable`` or an aioreactive
``AsyncObservable``. `to_stream` normalises it."""

_MAP, _FILTER, _DO = 0, 1, 2
Step = tuple[int, Callable[[Any], Any]]


async def aclose(it: object) -> None:
    """Close an async iterator if it can be closed."""
    close = getattr(it, "aclose", None)
    if close is not None:
        await close()


class EventStream(Generic[T]):
    """A cold, re-iterable async stream. See the module docstring for the contract."""

    __slots__ = ("__weakref__", "_factory", "_last", "_steps")

    def __init__(self, factory: Callable[[], AsyncIterator[Any]], _steps: tuple[Step, ...] = ()) -> None:
        self._factory = factory
        self._steps = _steps
        self._last: weakref.ref[Any] | None = None

    # -- iteration -------------------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[T]:
        steps = self._steps
        if steps:
            # A factory that can apply the steps itself (a prefetch drain) saves a layer per item.
            with_steps = getattr(self._factory, "with_steps", None)
            it = with_steps(steps) if with_steps is not None else _fused(self._factory(), steps)
        else:
            it = self._factory()
        try:  # noqa: SIM105 - cheaper than contextlib.suppress on this per-subscription path
            self._last = weakref.ref(it)
        except TypeError:  # some iterators do not take weak references
            pass
        return it  # type: ignore[no-any-return]  # (typing.cast is a call, on every subscription)

    async def aclose(self) -> None:
        """Close the most recent iteration of this stream (for ``contextlib.aclosing``)."""
        if self._last is None:
            return
        it = self._last()
        if it is not None:
            await aclose(it)
            return
        # The iterator is already gone (a ``break`` dropped it): asyncio's async-generator
        # finaliser has scheduled its aclose(); let that run before returning.
        for _ in range(3):
            await asyncio.sleep(0)

    async def to_list(self) -> list[T]:
        """Run the stream to completion and collect its items."""
        out: list[T] = []
        async with contextlib.aclosing(self.__aiter__()) as it:  # type: ignore[type-var]
            async for item in it:
                out.append(item)
        return out

    async def last(self) -> T:
        """Run the stream to completion and return its last item (`LookupError` if empty)."""
        sentinel: Any = _NOTHING
        item: Any = sentinel
        async with contextlib.aclosing(self.__aiter__()) as it:  # type: ignore[type-var]
            async for item in it:  # noqa: B007
                pass
        if item is sentinel:
            raise LookupError("the stream completed without items")
        return cast(T, item)

    def subscribe(
        self,
        on_next: Callable[[T], Any] | None = None,
        on_error: Callable[[BaseException], Any] | None = None,
        on_completed: Callable[[], Any] | None = None,
    ) -> Subscription:
        """Rx-style push consumption in a task; ``dispose()`` cancels it and closes the producer.

        Callbacks may be plain functions or coroutine functions."""

        async def run() -> None:
            try:
                async with contextlib.aclosing(self.__aiter__()) as it:  # type: ignore[type-var]
                    async for item in it:
                        if on_next is not None:
                            await _maybe_await(on_next(item))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                if on_error is None:
                    raise
                await _maybe_await(on_error(exc))
                return
            if on_completed is not None:
                await _maybe_await(on_completed())

        return Subscription(asyncio.get_running_loop().create_task(run()))

    # -- constructors ----------------------------------------------------------------------------

    @staticmethod
    def of(*items: U) -> EventStream[U]:
        return EventStream(lambda: _iterate(items))

    @staticmethod
    def from_iterable(iterable: Iterable[U]) -> EventStream[U]:
        return EventStream(lambda: _iterate(iterable))

    @staticmethod
    def from_async_iterable(
        source: AsyncIterable[U] | Callable[[], AsyncIterable[U]],
    ) -> EventStream[U]:
        """From a factory (an ``async def`` generator function, or any callable returning an async
        iterable), which keeps the stream cold, or from an async iterable instance (which is
        iterated as it is: a one-shot generator can only be consumed once)."""
        if callable(source) and not hasattr(source, "__aiter__"):
            factory = source
            return EventStream(lambda: factory().__aiter__())
        iterable = cast(AsyncIterable[U], source)
        return EventStream(lambda: iterable.__aiter__())

    @staticmethod
    def defer(factory: Callable[[], Any]) -> EventStream[Any]:
        """Call ``factory`` at each subscription and stream what it returns (any `StreamLike`)."""
        return EventStream(lambda: to_stream(factory()).__aiter__())

    @staticmethod
    def empty() -> EventStream[Any]:
        return EventStream(lambda: _iterate(()))

    @staticmethod
    def error(exc: BaseException) -> EventStream[Any]:
        async def gen() -> AsyncIterator[Any]:
            raise exc
            yield  # pragma: no cover

        return EventStream(gen)

    @staticmethod
    def concat(*sources: Any) -> EventStream[Any]:
        """The sources one after another (each subscribed only when the previous completed)."""
        streams = [to_stream(s) for s in sources]

        async def gen() -> AsyncIterator[Any]:
            for s in streams:
                async with contextlib.aclosing(s.__aiter__()) as it:  # type: ignore[type-var]
                    async for item in it:
                        yield item

        return EventStream(gen)

    @staticmethod
    def merge(*sources: Any, max_buffer: int = 64) -> EventStream[Any]:
        """The sources concurrently, items in arrival order; an error in one ends all."""
        streams = [to_stream(s) for s in sources]
        return EventStream(lambda: _merge(_iterate(streams), None, max_buffer))

    # -- fused operators -------------------------------------------------------------------------

    def map(self, fn: Callable[[T], U]) -> EventStream[U]:
        return EventStream(self._factory, (*self._steps, (_MAP, fn)))

    def filter(self, predicate: Callable[[T], bool]) -> EventStream[T]:
        return EventStream(self._factory, (*self._steps, (_FILTER, predicate)))

    def do(self, fn: Callable[[T], Any]) -> EventStream[T]:
        """Call ``fn`` for its side effect on each item; the item passes unchanged."""
        return EventStream(self._factory, (*self._steps, (_DO, fn)))

    # -- structural operators --------------------------------------------------------------------

    def concat_map(self, fn: Callable[[T], Any]) -> EventStream[Any]:
        """Replace each item by the items of ``fn(item)`` (a StreamLike; a tuple is cheapest),
        in order. This is how a middleware inserts or drops events."""
        return EventStream(lambda: _concat_map(self.__aiter__(), fn))

    def flat_map(self, fn: Callable[[T], Any], max_concurrent: int | None = None) -> EventStream[Any]:
        """Like `concat_map` but the inner streams run concurrently (items in arrival order)."""
        return EventStream(lambda: _merge(self.__aiter__(), fn, 64, max_concurrent))

    def catch(self, handler: Callable[[Exception], Any]) -> EventStream[Any]:
        """On an error, continue with ``handler(exc)`` (a StreamLike). Cancellation is not caught.
        Items already emitted stay emitted."""
        return EventStream(lambda: _catch(self, handler))

    def retry(self, retries: int) -> EventStream[T]:
        """On an error, subscribe again, at most ``retries`` times after the first attempt.
        The attempt counter is per subscription. Items already emitted stay emitted."""
        return EventStream(lambda: _retry(self, retries))

    def take(self, count: int) -> EventStream[T]:
        return EventStream(lambda: _take(self, count))

    def take_while(self, predicate: Callable[[T], bool]) -> EventStream[T]:
        return EventStream(lambda: _take_while(self, predicate))

    def finally_(self, fn: Callable[[], Any]) -> EventStream[T]:
        """Run ``fn()`` exactly once when an iteration completes, fails or is closed."""
        return EventStream(lambda: _finally(self, fn))

    def prefetch(self, size: int = 64, *, context: contextvars.Context | None = None) -> EventStream[T]:
        """Run the upstream in its own task, ahead of the consumer by at most ``size`` items.

        The task runs in ``context``, by default the context current *now* (when the stream is
        built), so a span a middleware made current around ``next()`` parents the producer and
        nothing the producer sets leaks into the consumer."""
        return prefetched(self.__aiter__, size, context)

    def pipe(self, *operators: Callable[[Any], Any]) -> EventStream[Any]:
        """Apply reactivex operators. Synchronous ones run inline in the consuming coroutine (no
        thread, no task, backpressure kept); time-based ones run on the ``AsyncIOScheduler``."""
        from .rx import pipe_operators

        return EventStream(lambda: pipe_operators(self.__aiter__(), operators))

    # -- interop ---------------------------------------------------------------------------------

    def to_observable(self) -> reactivex.Observable[T]:
        from .rx import to_observable

        return to_observable(self)

    @staticmethod
    def from_observable(observable: reactivex.Observable[U]) -> EventStream[U]:
        from .rx import from_observable

        return from_observable(observable)

    def to_async_observable(self) -> Any:
        from .rx import to_async_observable

        return to_async_observable(self)

    @staticmethod
    def from_async_observable(observable: Any) -> EventStream[Any]:
        from .rx import from_async_observable

        return from_async_observable(observable)


class Subscription:
    """A running `EventStream.subscribe`; ``dispose()`` cancels it, ``await sub`` waits for it."""

    __slots__ = ("task",)

    def __init__(self, task: asyncio.Task[None]) -> None:
        self.task = task

    def dispose(self) -> None:
        self.task.cancel()

    @property
    def disposed(self) -> bool:
        return self.task.done()

    def __await__(self) -> Any:
        return asyncio.shield(self.task).__await__()


_NOTHING: Any = object()


def to_stream(value: Any) -> EventStream[Any]:
    """Normalise a StreamLike into an `EventStream`; anything else is a `TypeError`."""
    if isinstance(value, EventStream):
        return value
    if hasattr(value, "__aiter__"):
        return EventStream.from_async_iterable(value)
    if isinstance(value, list | tuple):
        return EventStream.from_iterable(value)
    try:
        import reactivex

        if isinstance(value, reactivex.Observable):
            return EventStream.from_observable(value)
    except ImportError:  # pragma: no cover - reactivex is a dependency
        pass
    if hasattr(value, "subscribe_async"):
        return EventStream.from_async_observable(value)
    raise TypeError(
        f"expected a stream (EventStream, async iterable, reactivex Observable, aioreactive "
        f"AsyncObservable, list or tuple), got {type(value).__name__}: {value!r}"
    )


async def _maybe_await(value: Any) -> None:
    if isinstance(value, Awaitable):
        await value


# -- operator implementations: each one closes what it opened -----------------------------------


async def _iterate(items: Iterable[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


def _maps_of(steps: tuple[Step, ...]) -> tuple[Callable[[Any], Any], ...] | None:
    """The functions of ``steps`` when all are maps, else None. (A plain loop: the generator
    expressions this replaces cost a frame each, at every subscription of a mapped stream.)"""
    fns = []
    for kind, fn in steps:
        if kind != _MAP:
            return None
        fns.append(fn)
    return tuple(fns)


def _fused(it: AsyncIterator[Any], steps: tuple[Step, ...]) -> AsyncIterator[Any]:
    """The one async layer that applies ``steps``; maps only (the common case) take a loop
    without per-step dispatch."""
    fns = _maps_of(steps)
    if fns is not None:
        if len(fns) == 1:
            return _apply_map(it, fns[0])
        return _apply_maps(it, fns)
    return _apply_steps(it, steps)


async def _apply_map(it: AsyncIterator[Any], fn: Callable[[Any], Any]) -> AsyncIterator[Any]:
    try:
        async for item in it:
            yield fn(item)
    finally:
        await aclose(it)


async def _apply_maps(it: AsyncIterator[Any], fns: tuple[Callable[[Any], Any], ...]) -> AsyncIterator[Any]:
    try:
        async for item in it:
            for fn in fns:
                item = fn(item)
            yield item
    finally:
        await aclose(it)


async def _apply_steps(it: AsyncIterator[Any], steps: tuple[Step, ...]) -> AsyncIterator[Any]:
    _map, _filter = _MAP, _FILTER
    try:
        async for item in it:
            for kind, fn in steps:
                if kind == _map:
                    item = fn(item)
                elif kind == _filter:
                    if not fn(item):
                        break
                else:
                    fn(item)
            else:
                yield item
    finally:
        await aclose(it)


async def _concat_map(it: AsyncIterator[Any], fn: Callable[[Any], Any]) -> AsyncIterator[Any]:
    try:
        async for item in it:
            inner = fn(item)
            if isinstance(inner, tuple | list):  # the cheap, common case: no inner iterator
                for x in inner:
                    yield x
                continue
            inner_it = to_stream(inner).__aiter__()
            try:
                async for x in inner_it:
                    yield x
            finally:
                await aclose(inner_it)
    finally:
        await aclose(it)


async def _catch(source: EventStream[Any], handler: Callable[[Exception], Any]) -> AsyncIterator[Any]:
    it = source.__aiter__()
    try:
        async for item in it:
            yield item
        return
    except Exception as exc:
        fallback = handler(exc)
    finally:
        await aclose(it)
    async with contextlib.aclosing(to_stream(fallback).__aiter__()) as fit:  # type: ignore[type-var]
        async for item in fit:
            yield item


async def _retry(source: EventStream[Any], retries: int) -> AsyncIterator[Any]:
    attempt = 0
    while True:
        it = source.__aiter__()
        try:
            async for item in it:
                yield item
            return
        except Exception:
            if attempt >= retries:
                raise
            attempt += 1
        finally:
            await aclose(it)


async def _take(source: EventStream[Any], count: int) -> AsyncIterator[Any]:
    if count <= 0:
        return
    it = source.__aiter__()
    try:
        n = 0
        async for item in it:
            yield item
            n += 1
            if n >= count:
                return
    finally:
        await aclose(it)


async def _take_while(source: EventStream[Any], predicate: Callable[[Any], bool]) -> AsyncIterator[Any]:
    it = source.__aiter__()
    try:
        async for item in it:
            if not predicate(item):
                return
            yield item
    finally:
        await aclose(it)


async def _finally(source: EventStream[Any], fn: Callable[[], Any]) -> AsyncIterator[Any]:
    it = source.__aiter__()
    try:
        async for item in it:
            yield item
    finally:
        try:
            await aclose(it)
        finally:
            await _maybe_await(fn())


class Channel:
    """A bounded buffer between producer task(s) and one consumer: the one buffer type of the
    runtime (the model call's prefetch, parallel tool calls, merges, the reactivex bridge).

    Internal API, used across the package: a producer appends to ``items`` (or awaits `put`,
    which waits for room), calls `wake` after appending, awaits `room` when ``len(items) >= size``,
    and ends with `finish(error)`; the consumer takes with `take` (or iterates `drain`), waiting
    on ``waiter`` when empty. One consumer only."""

    __slots__ = ("done", "error", "items", "loop", "size", "spaces", "waiter")

    def __init__(self, size: int) -> None:
        self.items: list[Any] = []  # a list: 56 B when empty, a deque 624 B (few items wait here)
        self.size = max(1, size)
        self.loop = asyncio.get_running_loop()
        self.waiter: asyncio.Future[None] | None = None  # the consumer waiting for an item
        self.spaces: list[asyncio.Future[None]] = []  # producers waiting for room
        self.done = False
        self.error: BaseException | None = None

    def wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    async def put(self, item: Any) -> None:
        if len(self.items) >= self.size:
            await self.room()
        self.items.append(item)
        self.wake()

    async def room(self) -> None:
        """Wait until there is room for one more item."""
        while len(self.items) >= self.size:
            room = self.loop.create_future()
            self.spaces.append(room)
            await room

    def finish(self, error: BaseException | None) -> None:
        if not self.done:
            self.done = True
            self.error = error
        self.wake()

    def take(self) -> Any:
        """The next item (making room for a waiting producer), or `_EMPTY`."""
        items = self.items
        if not items:
            return _EMPTY
        item = items.pop(0)
        spaces = self.spaces
        if spaces:
            room = spaces.pop(0)
            if not room.done():
                room.set_result(None)
        return item

    async def drain(self) -> AsyncIterator[Any]:
        take = self.take
        while True:
            item = take()
            if item is not _EMPTY:
                yield item
            elif self.done:
                if self.error is not None:
                    raise self.error
                return
            else:
                self.waiter = self.loop.create_future()
                await self.waiter


_EMPTY: Any = object()


def prefetched(
    source: Callable[[], AsyncIterator[Any]] | Callable[[Channel], Awaitable[None]],
    size: int = 64,
    context: contextvars.Context | None = None,
    make: Callable[[Any], Callable[[str], T]] | None = None,
    push: bool = False,
) -> EventStream[T]:
    """`EventStream.prefetch` of what ``source()`` returns (internal: no stream in between).

    With ``push``, ``source(channel)`` is the producer itself: a coroutine, run as the task, that
    puts items into the channel's ``items`` (waking its waiter, waiting for ``room()`` when full),
    saving the generator step per item that a pump over an iterator takes.

    With ``make``, the source may hand over a ``str`` in place of an item: the drain, in the
    consumer's task, replaces it with ``maker(text)``, where ``maker = make(last)`` was made for
    ``last``, the latest item that was not a ``str`` (one maker serves the run of strings after
    it). A buffer that a slow consumer lets fill then holds strings, and the items are made just
    before they are used (and die young)."""
    ctx = context if context is not None else contextvars.copy_context()
    return EventStream(_Prefetch(source, size, ctx, make, push))


class _Prefetch:
    """The factory of a prefetched stream; ``with_steps`` applies fused maps in the drain (the
    consumer's side, as `_fused` would, without a layer of its own)."""

    __slots__ = ("ctx", "make", "push", "size", "source")

    def __init__(
        self, source: Callable[..., Any], size: int, ctx: contextvars.Context,
        make: Callable[[Any], Callable[[str], Any]] | None = None, push: bool = False,
    ) -> None:
        self.source = source
        self.size = size
        self.ctx = ctx
        self.make = make
        self.push = push

    def __call__(self) -> AsyncIterator[Any]:
        return _prefetch(self.source, self.size, self.ctx, (), self.make, self.push)

    def with_steps(self, steps: tuple[Step, ...]) -> AsyncIterator[Any]:
        fns = _maps_of(steps)
        if fns is not None:  # maps: applied by the drain
            return _prefetch(self.source, self.size, self.ctx, fns, self.make, self.push)
        return _fused(self(), steps)


class InContext:
    """A factory run inside ``ctx`` (a chain layer's); passes ``with_steps`` through to one that
    has it, in the same context."""

    __slots__ = ("ctx", "factory")

    def __init__(self, ctx: contextvars.Context, factory: Callable[[], AsyncIterator[Any]]) -> None:
        self.ctx = ctx
        self.factory = factory

    def __call__(self) -> AsyncIterator[Any]:
        return self.ctx.run(self.factory)

    def with_steps(self, steps: tuple[Step, ...]) -> AsyncIterator[Any]:
        inner = getattr(self.factory, "with_steps", None)
        if inner is None:
            return _fused(self.ctx.run(self.factory), steps)
        return self.ctx.run(inner, steps)  # type: ignore[no-any-return]


async def _pump(channel: Channel, source: Callable[..., Any], push: bool) -> None:
    """The producer task of `_prefetch`: runs ``source`` into ``channel`` (a function, not a
    closure: a closure's cells are objects each model call would keep alive)."""
    error: BaseException | None = None
    try:
        if push:
            await source(channel)
            return
        items, size = channel.items, channel.size
        it = source()
        try:
            async for item in it:
                if len(items) < size:  # put() without the coroutine when there is room
                    items.append(item)
                    if channel.waiter is not None:
                        channel.wake()
                else:
                    await channel.put(item)
        finally:
            await aclose(it)
    except BaseException as exc:  # handed to the consumer, which re-raises it
        error = exc
    finally:
        channel.finish(error)


async def _prefetch(
    source: Callable[..., Any], size: int, ctx: contextvars.Context,
    maps: tuple[Callable[[Any], Any], ...], make: Callable[[Any], Callable[[str], Any]] | None = None,
    push: bool = False,
) -> AsyncIterator[Any]:
    channel = Channel(size)
    items = channel.items
    task = channel.loop.create_task(_pump(channel, source, push), context=ctx)
    take, spaces, empty = channel.take, channel.spaces, _EMPTY
    try:
        # Give the task its first step in this same loop turn: a source that is ready at once (a
        # cache, an in-process model) has filled the channel by then, so no waiter is needed.
        await asyncio.sleep(0)
        last: Any = None
        maker: Callable[[str], Any] | None = None
        while True:  # channel.drain(), inlined: one async layer less per item
            # take(), inlined when no producer waits for room
            item = items.pop(0) if items and not spaces else take()
            if item is not empty:
                if make is not None and type(item) is str:
                    if maker is None:
                        maker = make(last)
                    item = maker(item)
                else:
                    last, maker = item, None
                for fn in maps:
                    item = fn(item)
                yield item
            elif channel.done:
                if channel.error is not None:
                    raise channel.error
                return
            else:
                channel.waiter = channel.loop.create_future()
                await channel.waiter
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def _merge(
    sources: AsyncIterator[Any],
    fn: Callable[[Any], Any] | None,
    buffer: int,
    max_concurrent: int | None = None,
) -> AsyncIterator[Any]:
    """Run inner streams concurrently into one channel; an error anywhere cancels the rest."""
    channel = Channel(buffer)
    tasks: set[asyncio.Task[None]] = set()
    limit = asyncio.Semaphore(max_concurrent) if max_concurrent else None
    outer_done = False

    async def run_inner(stream: EventStream[Any]) -> None:
        try:
            async with contextlib.aclosing(stream.__aiter__()) as it:  # type: ignore[type-var]
                async for item in it:
                    await channel.put(item)
        finally:
            if limit is not None:
                limit.release()

    def inner_done(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and not channel.done:
            channel.finish(task.exception())
        elif outer_done and not tasks and not channel.done:
            channel.finish(None)

    async def pump() -> None:
        nonlocal outer_done
        try:
            async for item in sources:
                inner = to_stream(fn(item) if fn is not None else item)
                if limit is not None:
                    await limit.acquire()
                t = channel.loop.create_task(run_inner(inner))
                tasks.add(t)
                t.add_done_callback(inner_done)
        except BaseException as exc:
            channel.finish(exc)
            raise
        finally:
            await aclose(sources)
        outer_done = True
        if not tasks and not channel.done:
            channel.finish(None)

    pump_task = channel.loop.create_task(pump())
    try:
        async for item in channel.drain():
            yield item
    finally:
        pending = [t for t in (pump_task, *tasks) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
