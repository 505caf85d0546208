"""What the resilience built-ins share: validated backoff, error matching, and `Attempts`, the
async iterator that re-runs a failed model call without costing the happy path anything.

`Attempts` has three ways to treat a failure, the streaming contract of `RetryMiddleware` and
`ModelFallbackMiddleware`:

* ``"first"`` (the default): only a failure before the attempt's first event starts another one.
  Until then ``__anext__`` runs a coroutine; after the first event it hands back the inner
  iterator's own awaitable (one method call per event, no frame of its own), so a call that
  streams costs nothing more than the layer's iterator;
* ``"buffer"``: the attempt's events are held until it completes; a failed attempt is dropped
  whole, so the layers outside never see it (they see its events only once it succeeded). The
  usage of a ``ModelCallEnd`` dropped so, or held when the call is cut (the consumer leaves, an
  interrupt, a layer outside stops reading), goes to the run's usage (``count``, the context's
  ``add_usage``), as the provider billed it;
* ``"always"``: a failure after events went out starts another attempt too. Those events cannot
  be taken back: the runtime has closed the failed attempt (its open blocks end, then
  ``ModelCallEnd(discarded=True)``) before the error reaches this layer, and memory keeps only the
  attempt that completed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from ..._stream.operators import Maps, MapSource, Recovery, apply_maps, maps_of
from ...errors import AgentInterrupted, MiddlewareError, MiddlewareTermination, ModelError
from ...events import AgentEvent, MiddlewareCompleted, MiddlewareStarted, ModelCallEnd
from ...stream import EventStream, aclose

if TYPE_CHECKING:
    from ..._replies import ReplyParts
    from ...message import ChatUsage

__all__ = [
    "Attempts",
    "Backoff",
    "ErrorFilter",
    "FirstFailure",
    "Mode",
    "Sleep",
    "describe",
    "matcher",
    "mode_of",
    "note_earlier",
]

Sleep: TypeAlias = Callable[[float], Awaitable[Any]]
ErrorFilter: TypeAlias = "type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool]"
Mode = Literal["first", "buffer", "always"]


def describe(error: BaseException) -> str:
    """``"Type: message"``, the form of ``ModelCallEnd.error``."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def mode_of(buffer: bool, after_first_event: bool) -> Mode:
    if buffer and after_first_event:
        raise ValueError("buffer=True already retries any failure unseen; drop after_first_event")
    return "buffer" if buffer else "always" if after_first_event else "first"


def retryable_model_error(error: BaseException) -> bool:
    """The default of `RetryMiddleware`: a `ModelError` that says trying again may help."""
    return isinstance(error, ModelError) and error.retryable


def any_failure(error: BaseException) -> bool:
    """The default of `ModelFallbackMiddleware`: any error but a middleware's deliberate stop
    (a guardrail, a rate limit, a budget) or a broken hook contract: another model cannot help."""
    return not isinstance(error, MiddlewareTermination | MiddlewareError)


def matcher(spec: Any, default: Callable[[BaseException], bool], name: str) -> Callable[[BaseException], bool]:
    """``spec``: None (the default), an exception type, a tuple of types, or a predicate. An
    interrupt never matches: the user stopped the run, and no retry or other model may go on."""
    match = _match(spec, default, name)
    return lambda error: not isinstance(error, AgentInterrupted) and match(error)


def _match(spec: Any, default: Callable[[BaseException], bool], name: str) -> Callable[[BaseException], bool]:
    if spec is None:
        return default
    if isinstance(spec, type) and issubclass(spec, BaseException):
        return lambda error: isinstance(error, spec)
    if isinstance(spec, tuple) and spec and all(isinstance(t, type) and issubclass(t, BaseException) for t in spec):
        return lambda error: isinstance(error, spec)
    if callable(spec) and not isinstance(spec, type | tuple):  # (a class that is no exception is not a predicate)
        predicate: Callable[[BaseException], bool] = spec
        return predicate
    raise ValueError(f"{name} must be an exception type, a tuple of them, or a predicate; got {spec!r}")


class Backoff:
    """Exponential backoff: the wait before retry ``n`` (0-based) is ``initial_delay *
    backoff_factor ** n``, at most ``max_delay``, spread by ``±jitter`` (a fraction; ``True`` is
    ±25 %, LangChain's). A provider's ``retry_after`` hint is a floor (waiting less would fail
    again); ``max_delay`` caps every wait, the hint included."""

    __slots__ = ("backoff_factor", "initial_delay", "jitter", "max_delay", "max_retries", "rng", "sleep")

    def __init__(
        self, max_retries: int, initial_delay: float, backoff_factor: float, max_delay: float,
        jitter: bool | float, sleep: Sleep | None, rng: random.Random | None,
    ) -> None:
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if not initial_delay > 0:
            raise ValueError(f"initial_delay must be > 0 seconds, got {initial_delay!r}")
        if not backoff_factor >= 1:
            raise ValueError(f"backoff_factor must be >= 1 (1 keeps the delay constant), got {backoff_factor!r}")
        if not max_delay >= initial_delay:
            raise ValueError(f"max_delay must be >= initial_delay ({initial_delay}), got {max_delay!r}")
        spread = 0.25 if jitter is True else 0.0 if jitter is False else float(jitter)
        if not 0 <= spread < 1:
            raise ValueError(f"jitter must be a bool or a fraction in [0, 1), got {jitter!r}")
        self.max_retries = max_retries
        self.initial_delay = float(initial_delay)
        self.backoff_factor = float(backoff_factor)
        self.max_delay = float(max_delay)
        self.jitter = spread
        self.sleep: Sleep = sleep or asyncio.sleep
        self.rng = rng or random.Random()

    def delay(self, retry: int, error: BaseException | None = None) -> float:
        """The wait before retry number ``retry`` (0 for the first retry)."""
        base = min(self.max_delay, self.initial_delay * self.backoff_factor**retry)
        if self.jitter:
            base *= 1 + self.rng.uniform(-self.jitter, self.jitter)
        hint = getattr(error, "retry_after", None)
        if isinstance(hint, int | float) and not isinstance(hint, bool) and hint > base:
            base = float(hint)
        return min(base, self.max_delay)


def note_earlier(error: BaseException, earlier: list[tuple[str, BaseException]]) -> BaseException:
    """Attach the earlier attempts' errors to the last one, which is re-raised as it is (its type
    is what callers catch): one ``__notes__`` line each, and the errors themselves, oldest first,
    in ``error.earlier_errors``."""
    if earlier:
        for label, exc in earlier:
            error.add_note(f"earlier attempt {label} failed: {describe(exc)}")
        # (an exception class with __slots__ refuses the attribute: the notes still say it)
        with contextlib.suppress(AttributeError):
            error.earlier_errors = tuple(exc for _, exc in earlier)  # type: ignore[attr-defined]
    return error


# Hook tracing's brackets (``trace_middleware``) come before an inner layer's first real event; they
# are balanced on failure too, so they pass without making the attempt "started".
_BOOKKEEPING = (MiddlewareStarted, MiddlewareCompleted)

Again: TypeAlias = Callable[[list[tuple[str, BaseException]], BaseException, bool],
                            Awaitable["EventStream[AgentEvent] | None"]]
"""``again(earlier, error, emitted)``: the next attempt's stream (after any wait), or None to give
up (then the error goes on). ``earlier``: this subscription's failed attempts so far (``again``
appends to it); ``emitted``: events of the failed attempt went out."""


class Attempts:
    """The events of the first attempt that does not fail (see the module docstring)."""

    # (``__weakref__``: the stream keeps a weak reference to its last iterator, for its
    # ``aclose``; without the slot every subscription would raise and catch a TypeError.)
    __slots__ = ("__weakref__", "_again", "_buffer", "_count", "_done", "_earlier", "_it", "_live", "_mode")

    def __init__(self, first: EventStream[AgentEvent], again: Again, mode: Mode,
                 earlier: list[tuple[str, BaseException]] | None = None,
                 count: Callable[[ChatUsage | None], None] | None = None) -> None:
        self._it: AsyncIterator[AgentEvent] | None = first.__aiter__()
        self._again = again
        self._mode = mode
        self._live = False  # "first": the first event is out; forward from now on
        # The failed attempts so far: made at the first failure (or handed on by `FirstFailure`).
        self._earlier: list[tuple[str, BaseException]] | None = earlier
        if mode == "buffer":
            self._buffer: list[AgentEvent] = []
            self._done = False
            self._count = count

    def __aiter__(self) -> Attempts:
        return self

    def __anext__(self) -> Awaitable[AgentEvent]:
        if self._live:
            return self._it.__anext__()  # type: ignore[union-attr]  # the happy path: no frame here
        if self._mode == "buffer":
            return self._buffered()
        if self._mode == "always":
            return self._guarded()
        return self._first()

    async def _first(self) -> AgentEvent:
        while True:
            it = self._it
            if it is None:
                raise StopAsyncIteration
            try:
                item = await it.__anext__()
            except StopAsyncIteration:
                self._live = True
                raise
            except Exception as exc:
                await self._next_attempt(exc, False)
                continue
            if type(item) not in _BOOKKEEPING:
                self._live = True
            return item

    async def _guarded(self) -> AgentEvent:
        while True:
            it = self._it
            if it is None:
                raise StopAsyncIteration
            try:
                return await it.__anext__()
            except StopAsyncIteration:
                self._it = None
                raise
            except Exception as exc:
                await self._next_attempt(exc, True)

    async def _buffered(self) -> AgentEvent:
        buffer = self._buffer
        while not self._done:
            if self._it is None:
                raise StopAsyncIteration
            try:
                async for item in self._it:
                    buffer.append(item)
            except Exception as exc:
                self._drop()  # its events were never seen
                await self._next_attempt(exc, False)
                continue
            self._done = True
            buffer.reverse()  # popped from the end
        if not buffer:
            raise StopAsyncIteration
        return buffer.pop()

    def _drop(self) -> None:
        """Drops the held events that did not go out (a failed attempt's, or what a cut call still
        held), counting the usage a model reported in them into the run's: the provider billed it,
        and no ModelCallEnd that goes out carries it."""
        count = self._count
        if count is not None:
            for item in self._buffer:
                if type(item) is ModelCallEnd:
                    count(item.usage)
        self._buffer.clear()

    async def _next_attempt(self, error: Exception, emitted: bool) -> None:
        it, self._it = self._it, None
        await aclose(it)
        if self._earlier is None:
            self._earlier = []
        stream = await self._again(self._earlier, error, emitted)
        if stream is None:
            raise error
        self._it = stream.__aiter__()

    async def aclose(self) -> None:
        self._live = False  # (a read after closing ends at once, in _first)
        if self._mode == "buffer":
            self._drop()
        it, self._it = self._it, None
        if it is not None:
            await aclose(it)


class FirstFailure(MapSource):
    """The stream factory of the default mode (``"first"``: only a failure before the attempt's
    first event starts another one), at no cost to a call that does not fail.

    Where the inner stream can take the failure itself (`MapSource.recovering`: the model call's
    prefetch, under any number of hooks that only add maps), the subscription is that stream's
    own iterator, and the next attempts (`Attempts`) are only made after a failure: a call that
    does not fail passes through no iterator of ours. Elsewhere (a hook inside that wraps the
    stream, hook tracing) `Attempts` does it, as it does the other modes. For a consumer that
    only hands the events to a reply builder (`building`), the attempts make none while that
    consumer is their only reader: a failure before anything reached the builder is a failure
    before the first event.

    Each middleware's subclass keeps what its next attempt needs (the hook's context, input and
    ``next``) and makes that attempt in `again`: the one object made per call, nothing else until
    a failure."""

    __slots__ = ("first",)

    # Subscribing reads no context: ``first`` was built by next() inside the hook (it carries its
    # own), and the next attempts are made where the consumer reads (as `Attempts` makes them).
    context_free = True

    def __init__(self, first: EventStream[AgentEvent]) -> None:
        self.first = first

    def again(self, earlier: list[tuple[str, BaseException]], error: BaseException,
              emitted: bool) -> Awaitable[EventStream[AgentEvent] | None]:
        """The next attempt's stream, or None to give up (`Again`)."""
        raise NotImplementedError

    def with_maps(self, maps: Maps = ()) -> AsyncIterator[AgentEvent]:
        first = self.first
        factory, steps = first._factory, first._steps
        own = maps_of(steps) if steps else ()
        if own is not None and isinstance(factory, MapSource):
            # (The maps of the layers outside, when there are any, go to the resumed attempts.)
            resume = partial(self._resume, maps=maps) if maps else self._resume
            recovery: Recovery = (len(own), _BOOKKEEPING, resume)
            it = factory.recovering(own + maps, recovery)
            if it is not None:
                return it
        attempts = Attempts(first, self.again, "first")
        return apply_maps(attempts, maps) if maps else attempts

    __call__ = with_maps  # (a subscription with no maps, the usual one: `MapSource.__call__` in one call)

    def building(
        self, reply: ReplyParts, alone: Callable[[], bool], recovery: Recovery | None = None,
    ) -> AsyncIterator[AgentEvent] | None:
        """The first attempt read with no events (`MapSource.building`), when the stream it
        comes in can be: a failure before anything reached ``reply`` starts the next attempt
        (`_resume_building`) as a failure before the first event would. ``recovery``: a retry or
        fallback around this one, which takes a failure this one gives up on."""
        source = _building_source(self.first)
        if source is None:
            return None
        # (a partial of positional arguments: no keyword dict made per call, nor merged on use)
        resume = partial(self._resume_building, reply, alone, recovery, [])
        return source.building(reply, alone, (0, _BOOKKEEPING, resume))

    async def _resume(self, error: Exception, maps: Maps = ()) -> AsyncIterator[AgentEvent]:
        """The first attempt failed before its first event: the next attempts, as `Attempts` makes
        them (with the maps of the layers outside)."""
        earlier: list[tuple[str, BaseException]] = []
        stream = await self.again(earlier, error, False)
        if stream is None:
            raise error
        attempts = Attempts(stream, self.again, "first", earlier)
        it = apply_maps(attempts, maps) if maps else attempts
        try:
            async for ev in it:
                yield ev
        finally:
            await aclose(it)

    async def _resume_building(
        self, reply: ReplyParts, alone: Callable[[], bool], outer: Recovery | None,
        earlier: list[tuple[str, BaseException]], error: Exception,
    ) -> AsyncIterator[AgentEvent]:
        """An attempt read with no events failed before anything reached ``reply``: the next
        attempt, read the same way while the consumer is still the only reader (its own failure
        before the first part comes back here), else as events (`Attempts`), which the consumer
        hands to ``reply`` (an ``on_failure`` reply always is). A failure this layer gives up on
        before any event goes to ``outer``, as it would seen from outside."""
        stream = await self.again(earlier, error, False)
        it: AsyncIterator[AgentEvent] | None
        if stream is None:
            if outer is None:
                raise error
            it = outer[2](error)
        else:
            it = None
            source = _building_source(stream) if alone() else None
            if source is not None:
                it = source.building(reply, alone, (0, _BOOKKEEPING, partial(
                    self._resume_building, reply, alone, outer, earlier)))
            if it is None:
                it = Attempts(stream, self.again, "first", earlier)
                if outer is not None:
                    it = _handing_on(it, outer)
        try:
            async for ev in it:
                yield ev
        finally:
            await aclose(it)


def _building_source(stream: EventStream[AgentEvent]) -> MapSource | None:
    """The source to ask for ``stream`` read with no events (`MapSource.building`); None when it
    has steps of its own (they read the events) or a source that cannot be asked."""
    factory = stream._factory
    if stream._steps or not isinstance(factory, MapSource):
        return None
    return factory


async def _handing_on(it: AsyncIterator[AgentEvent], outer: Recovery) -> AsyncIterator[AgentEvent]:
    """``it``'s events, and a failure before the first of them (hook tracing's brackets aside)
    handed to ``outer`` instead: what a retry or fallback around ``it`` would take."""
    started = False
    try:
        async for ev in it:
            if not started and type(ev) not in _BOOKKEEPING:
                started = True
            yield ev
        return
    except Exception as exc:
        if started:
            raise
        error = exc
    finally:
        await aclose(it)
    resumed = outer[2](error)
    try:
        async for ev in resumed:
            yield ev
    finally:
        await aclose(resumed)
