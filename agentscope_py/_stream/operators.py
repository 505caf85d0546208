"""The fused steps (``map``, ``filter``, ``do``) and the operators that wrap one iterator.

Every operator closes what it opened, on completion, error and early exit. None of these knows
`EventStream`: a source here is anything with ``__aiter__`` (a stream is re-subscribed by calling
it again, which is how ``retry`` re-runs its source).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from operator import itemgetter
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

if TYPE_CHECKING:
    from .._replies import ReplyParts

__all__ = [
    "DO",
    "FILTER",
    "MAP",
    "MapSource",
    "Maps",
    "Recovery",
    "Step",
    "aclose",
    "aclosing",
    "apply_maps",
    "finally_",
    "fused",
    "iterate",
    "maps_of",
    "maybe_await",
    "retry",
    "take",
    "take_while",
]

MAP, FILTER, DO = 0, 1, 2  # (MAP must stay 0: `maps_of` tests the kinds for truth)
Step = tuple[int, Callable[[Any], Any]]
Maps = tuple[Callable[[Any], Any], ...]


class MapSource:
    """A stream factory that applies the stream's fused maps itself (internal API).

    A stream whose fused steps are all maps subscribes such a factory with
    ``factory.with_maps(maps)`` instead of wrapping ``factory()`` in the async layer `fused`
    would add: where items are already handled one by one (the drain of a prefetch buffer), the
    maps run there, one generator step less per item. ``with_maps`` must apply them in order, to
    every item, in the consumer's task (where `fused` would). Subclasses: `concurrent.Prefetch`,
    `context.InContext`, and the model call's stream (`_model_call`)."""

    __slots__ = ()

    context_free: ClassVar[bool] = False
    """True for a factory that reads no context of its own when subscribed: it only subscribes
    streams that were built elsewhere and carry their own (`middleware.resilience._common.FirstFailure`),
    or it runs in the context it holds (`context.InContext`). A middleware layer then returns the
    hook's stream as it is, with no context wrapper (`chain`)."""

    def __call__(self) -> AsyncIterator[Any]:
        return self.with_maps(())

    def with_maps(self, maps: Maps) -> AsyncIterator[Any]:
        raise NotImplementedError

    def recovering(self, maps: Maps, recovery: Recovery) -> AsyncIterator[Any] | None:
        """`with_maps`, and a failure before the first item handed to ``recovery`` (see there);
        None when this source cannot (the caller then wraps the stream instead). Only sources
        that handle each item themselves can, at no cost per item: the model call's stream
        (`_model_call.ModelCall`), and `context.InContext` around one."""
        return None

    def building(
        self, reply: ReplyParts, alone: Callable[[], bool], recovery: Recovery | None = None,
    ) -> AsyncIterator[Any] | None:
        """A subscription that makes no items: it hands its reply to ``reply`` itself, for a
        consumer that is the only reader of the items and would only hand them to that builder
        (the agent loop in a ``call()``: `_model_call.read_alone`); None when this source cannot
        (the consumer then subscribes it as usual). Items it still yields (a stream it cannot read
        so, subscribed later) go to the consumer, which hands them to the builder with ``add``.
        ``alone()``: whether that consumer is still the only reader, asked before each stream
        this source subscribes later (a retry's next attempt runs hooks that may add an
        observer). ``recovery``: as in `recovering`, a failure before anything reached
        ``reply``. Only the model call's stream can (`_model_call.ModelCall`), a retry's or a
        fallback's around one (`middleware.resilience._common.FirstFailure`), a budget's around
        one (`middleware.limits.budget`: it hands on a ``reply`` of its own that meters the
        parts on their way to this one, a `_replies.ReplyParts`), and `context.InContext`
        around those."""
        return None

    def quiet_building(self) -> bool:
        """Whether the subscription `building` makes yields nothing of its own: only what its
        ``recovery`` resumes with, and, after a budget's refusal, that refusal (no reply of a
        model call). A layer that records the reply its builder is handed (a cache's miss) then
        records the resumed items in its ``recovery`` and needs no layer around the
        subscription. The model call's own source is quiet (`_model_call.ModelCall`), and so
        are a budget's and `context.InContext` around one."""
        return False


Recovery = tuple[int, tuple[type, ...], Callable[[Exception], AsyncIterator[Any]]]
"""``(inner, passes, resume)``: what a stream subscribed with `MapSource.recovering` does when it
fails before its first item — the retry of a failure before the first event (`RetryMiddleware`),
without a layer of its own around a call that does not fail. (A tuple: one is made per model call.)

The first ``inner`` maps are the stream's own (an error they raise on the first item counts as a
failure of the stream, as it would seen from outside it); the rest are the maps of the layers
outside, applied to every item, the resumed ones too (``resume`` applies them). Items of a type
in ``passes`` (hook tracing's brackets) do not count as the first item. ``resume(error)``: the
items that follow instead of the error (an async iterator, which may raise it after all); it is
called once the failed stream's producer has stopped."""


async def aclose(it: object) -> None:
    """Close an async iterator if it can be closed."""
    close = getattr(it, "aclose", None)
    if close is not None:
        await close()


IterT = TypeVar("IterT", bound=AsyncIterator[Any])


class aclosing(Generic[IterT]):  # (lower case: it stands for ``contextlib.aclosing``)
    """``async with aclosing(it) as it:`` closes ``it`` on the way out, however the block ends.

    ``contextlib.aclosing`` does the same but is typed for objects that declare ``aclose``, which
    ``AsyncIterator`` does not (``__aiter__()`` of a stream, a hook's result): this one takes any
    async iterator, gives it back with its own type, and closes it when it can be closed."""

    __slots__ = ("_it",)

    def __init__(self, it: IterT) -> None:
        self._it = it

    async def __aenter__(self) -> IterT:
        return self._it

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await aclose(self._it)


async def maybe_await(value: Any) -> None:
    if isinstance(value, Awaitable):
        await value


async def iterate(items: Iterable[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


def maps_of(steps: tuple[Step, ...]) -> Maps | None:
    """The functions of ``steps`` when all are maps, else None. In C, with no Python frame per
    step: every subscription of a mapped stream asks (``MAP`` is the only kind that is 0)."""
    if any(map(_kind, steps)):
        return None
    return tuple(map(_fn, steps))


_kind, _fn = itemgetter(0), itemgetter(1)


def fused(it: AsyncIterator[Any], steps: tuple[Step, ...]) -> AsyncIterator[Any]:
    """The one async layer that applies ``steps``; maps only (the common case) take a loop
    without per-step dispatch."""
    fns = maps_of(steps)
    if fns is not None:
        return apply_maps(it, fns)
    return _apply_steps(it, steps)


def apply_maps(it: AsyncIterator[Any], fns: Maps) -> AsyncIterator[Any]:
    """The one async layer that applies the maps ``fns`` in order."""
    if len(fns) == 1:
        return _apply_map(it, fns[0])
    return _apply_maps(it, fns)


async def _apply_map(it: AsyncIterator[Any], fn: Callable[[Any], Any]) -> AsyncIterator[Any]:
    try:
        async for item in it:
            yield fn(item)
    finally:
        await aclose(it)


async def _apply_maps(it: AsyncIterator[Any], fns: Maps) -> AsyncIterator[Any]:
    try:
        async for item in it:
            for fn in fns:
                item = fn(item)
            yield item
    finally:
        await aclose(it)


async def _apply_steps(it: AsyncIterator[Any], steps: tuple[Step, ...]) -> AsyncIterator[Any]:
    _map, _filter = MAP, FILTER
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


async def retry(source: AsyncIterable[Any], retries: int) -> AsyncIterator[Any]:
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


async def take(source: AsyncIterable[Any], count: int) -> AsyncIterator[Any]:
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


async def take_while(source: AsyncIterable[Any], predicate: Callable[[Any], bool]) -> AsyncIterator[Any]:
    it = source.__aiter__()
    try:
        async for item in it:
            if not predicate(item):
                return
            yield item
    finally:
        await aclose(it)


async def finally_(source: AsyncIterable[Any], fn: Callable[[], Any]) -> AsyncIterator[Any]:
    it = source.__aiter__()
    try:
        async for item in it:
            yield item
    finally:
        try:
            await aclose(it)
        finally:
            await maybe_await(fn())
