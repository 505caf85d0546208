"""Running stream code inside a given ``contextvars.Context`` (internal API).

A contextvar set by async code lands in the context of whoever runs that code: a generator runs
where it is iterated, a coroutine where it is awaited. Middleware layers and the tracing spans
need code of theirs (a hook's generator, the inner layers a hook builds, a span made current
around ``next()``) to run in a private copy of the context instead, so that what it sets reaches
the code inside it and never leaks out into the consumer. Two granularities, one module (the model
call's reads of its provider are stepped the same way by `_model_call.ModelRead`):

* `InContext`: a stream factory called inside ``ctx`` (what a hook builds when it is
  subscribed); the items are then stepped in the consumer's context, at no cost per item.
* `stepped`: an async iterator every step of which (``__anext__``, ``aclose``) runs inside
  ``ctx``, as a Task runs its coroutine, without a task: ~1 µs per item.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any

from .operators import Maps, MapSource, Recovery, apply_maps

if TYPE_CHECKING:
    from .._replies import ReplyParts

__all__ = ["InContext", "stepped"]


class InContext(MapSource):
    """A stream factory run inside ``ctx``; the stream's maps are handed on to ``factory`` when it
    applies maps itself (a `MapSource`), in the same context. Another context around it would
    change nothing its factory sees: it is `context_free`."""

    __slots__ = ("ctx", "factory")

    context_free = True

    def __init__(self, ctx: contextvars.Context, factory: Callable[[], AsyncIterator[Any]]) -> None:
        self.ctx = ctx
        self.factory = factory

    def __call__(self) -> AsyncIterator[Any]:
        return self.ctx.run(self.factory)

    def with_maps(self, maps: Maps) -> AsyncIterator[Any]:
        factory = self.factory
        if isinstance(factory, MapSource):
            return self.ctx.run(factory.with_maps, maps)
        return apply_maps(self.ctx.run(factory), maps)

    def recovering(self, maps: Maps, recovery: Recovery) -> AsyncIterator[Any] | None:
        factory = self.factory
        if isinstance(factory, MapSource):
            return self.ctx.run(factory.recovering, maps, recovery)
        return None

    def building(
        self, reply: ReplyParts, alone: Callable[[], bool], recovery: Recovery | None = None,
    ) -> AsyncIterator[Any] | None:
        factory = self.factory
        if isinstance(factory, MapSource):
            return self.ctx.run(factory.building, reply, alone, recovery)
        return None

    def quiet_building(self) -> bool:
        factory = self.factory
        return isinstance(factory, MapSource) and factory.quiet_building()


def stepped(it: AsyncIterator[Any], ctx: contextvars.Context) -> AsyncIterator[Any]:
    """``it`` with every step run inside ``ctx``: a contextvar ``it`` sets stays in ``ctx``."""
    return _Stepped(it, ctx)


class _Stepped:
    __slots__ = ("_ctx", "_it")

    def __init__(self, it: Any, ctx: contextvars.Context) -> None:
        self._it = it
        self._ctx = ctx

    def __aiter__(self) -> _Stepped:
        return self

    def __anext__(self) -> _Step:
        return _Step(self._ctx, self._ctx.run(self._it.__anext__))

    def aclose(self) -> _Step:
        return _Step(self._ctx, self._ctx.run(self._it.aclose))


class _Step:
    """One awaited step of a coroutine, each of whose sends and throws runs inside ``ctx``."""

    __slots__ = ("_coro", "_ctx")

    def __init__(self, ctx: contextvars.Context, coro: Coroutine[Any, Any, Any]) -> None:
        self._ctx = ctx
        self._coro = coro

    def __await__(self) -> Generator[Any, Any, Any]:
        ctx, coro = self._ctx, self._coro
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = ctx.run(coro.send, value) if error is None else ctx.run(coro.throw, error)
            except StopIteration as stop:
                return stop.value
            try:
                value = yield step
                error = None
            except BaseException as exc:
                error = exc
