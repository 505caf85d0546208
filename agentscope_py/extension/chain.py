"""Assembling the chains: one stable sort and one fold per agent, a binding per execution.

Per point, the participants are fixed at build (`Participants`). The first `compose` of a point
folds its hooks back to front into layers (`_Chain`, kept on the participants), so the first
participant is the outermost layer; every execution then binds those layers to its context and
core (`_Run`): a hook's ``next`` is the inner layer bound to the execution as a method, so
calling it is a plain Python call. Hooks that are not overridden are left out: they would only
pass through, and a point with no overriding participant gets no wrapper at all — calling it is
calling the core.

Each layer runs its hook inside a private copy of the current context, and subscribes the stream
the hook returned in that same copy: a contextvar (or an OpenTelemetry span, `OtelTracingMiddleware`)
a hook sets around ``next(input)`` reaches the layers inside it and the model call, and never
leaks into the hooks outside it or the consumer. A stream that runs in a context of its own
already is handed out as it is, with no wrapper: the inner stream a hook passed through or
added maps to (an inner layer's `InContext`, or the core's stream when the core is bound), a
retry's (`MapSource.context_free`). ``async def`` generator hooks are
driven step by step inside their copy for the same reason. Both ways are `_stream.context`'s
(`InContext`, `stepped`).

With ``trace`` (`ReActAgent(trace_middleware=True)`), the same fold makes each layer a bracketed
one: MiddlewareStarted before the hook runs, MiddlewareCompleted after its stream ends."""

from __future__ import annotations

import contextvars
import inspect
import time
from collections.abc import AsyncIterator, Callable, Sequence
from types import MappingProxyType, MethodType
from typing import TYPE_CHECKING, Any

from .._control import HOOK_CONTROL
from .._stream.context import InContext, stepped
from ..events import MiddlewareCompleted, MiddlewareStarted
from ..stream import EventStream, aclosing, to_stream
from .base import ONION_POINTS, ExtensionPoint, MiddlewareBase, overrides
from .ordering import resolve_order

if TYPE_CHECKING:
    from .._context import RuntimeContext

__all__ = ["Participants", "compose"]

Layer = Callable[[Any], EventStream[Any]]


class Participants:
    """The frozen per-point participant tuples of one agent."""

    __slots__ = ("by_point", "chains", "hooks")

    def __init__(self, middlewares: Sequence[MiddlewareBase]) -> None:
        # Larger order() first; the ordering hints among equal orders; then registration order.
        ordered = resolve_order(middlewares)
        declared = [(m, m.active_points()) for m in ordered]
        by_point: dict[ExtensionPoint, tuple[MiddlewareBase, ...]] = {}
        for point in ExtensionPoint:
            by_point[point] = tuple(m for m, pts in declared if pts is None or point in frozenset(pts))
        self.by_point = MappingProxyType(by_point)
        # Only overriding participants do anything: the others pass through.
        self.hooks = MappingProxyType(
            {point: tuple(m for m in mws if overrides(m, point)) for point, mws in by_point.items()}
        )
        self.chains: dict[tuple[ExtensionPoint, bool, bool], _Chain] = {}  # built on first use (compose)

    def at(self, point: ExtensionPoint) -> tuple[MiddlewareBase, ...]:
        return self.by_point[point]


def compose(
    point: ExtensionPoint,
    participants: Participants,
    agent: Any,
    ctx: RuntimeContext,
    core: Layer,
    trace: bool = False,
    core_bound: bool = False,
) -> Layer:
    """Fold the overriding hooks of ``point`` around ``core``; the first one ends up outermost.

    ``core_bound``: the core's stream captures the context it is built in and runs there (the
    model call's reads do), so it needs no context of its own at subscription."""
    key = (point, core_bound, trace)
    chain = participants.chains.get(key)
    if chain is None or chain.agent is not agent:  # (a point's hooks are fixed at build: a chain has some)
        assert point in ONION_POINTS
        hooks = participants.hooks[point]
        if not hooks:
            return core
        chain = participants.chains[key] = _Chain(hooks, point, agent, core_bound, trace)
    return MethodType(chain.entry, _Run(ctx, core))


def _not_subscribed() -> AsyncIterator[Any]:
    raise AssertionError("the placeholder for the core's stream is never subscribed")


_NO_CORE_STREAM: EventStream[Any] = EventStream(_not_subscribed)
"""A run's ``core_stream`` while its core has returned none: no hook returns it, and its factory
is no other stream's."""


class _Run:
    """What one execution's layers of a point share: its context, its core and, while an
    invocation builds its layers, the stream the core returned, then the one each inner layer
    handed out (``core_stream``: when the core is bound, the layers hand that stream, or one of
    its factory's, out unchanged if their hooks pass it through) and whether the outermost hook
    is running (``in_hooks``)."""

    __slots__ = ("core", "core_stream", "ctx", "in_hooks")

    def __init__(self, ctx: RuntimeContext, core: Layer) -> None:
        self.ctx = ctx
        self.core = core
        self.core_stream = _NO_CORE_STREAM
        # True while the outermost layer's hook runs: a layer called then is called by the hook
        # outside it, inside that hook's context (`_layer`).
        self.in_hooks = False


LayerFunction = Callable[[_Run, Any], EventStream[Any]]
"""``layer(run, input)``, bound to an execution's run as a method: the hook's ``next``."""


class _Chain:
    """The layers of one point, built once per agent from the inside out. A hook's ``next`` is
    the inner layer bound to the execution's `_Run` as a method (a plain Python call, as in any web
    framework's middleware stack). ``trace``: every layer is bracketed (`_bracketed`)."""

    __slots__ = ("agent", "entry")

    def __init__(
        self, hooks: tuple[MiddlewareBase, ...], point: ExtensionPoint, agent: Any, core_bound: bool, trace: bool,
    ) -> None:
        self.agent = agent
        layer: LayerFunction = _bound_core if core_bound else _core
        inner_bound = core_bound
        for i in range(len(hooks) - 1, -1, -1):
            if trace:
                layer = _bracketed(hooks[i], point, agent, layer)
            else:
                layer = _layer(hooks[i], point, agent, layer, inner_bound, outermost=i == 0)
            inner_bound = True  # a layer's stream runs in the context of the layer that made it
        self.entry = layer


def _core(run: _Run, input: Any) -> EventStream[Any]:
    return run.core(input)


def _bound_core(run: _Run, input: Any) -> EventStream[Any]:
    """The core, its stream kept for the layers: its factory runs in the context it captured,
    so a layer whose hook passes the stream through needs no context wrapper."""
    stream = run.core(input)
    run.core_stream = stream
    return stream


def _layer(
    mw: MiddlewareBase, point: ExtensionPoint, agent: Any, inner: LayerFunction, inner_bound: bool, outermost: bool,
) -> LayerFunction:
    """Hook ``mw`` as a layer around ``inner``: the hook runs in a private copy of the context,
    and so does the stream it returns, unless that stream runs in a context of its own already.
    ``inner_bound``: what ``inner`` returns runs in the context it was built in.

    A layer is one Python call per hook an invocation passes, so the outermost layer and the
    others are two functions, each with only its own steps. Each hands out as it is a stream
    that runs in a context of its own already, to which a copy of the hook's would add nothing
    (when ``inner`` is bound): the inner stream (passed through, or with fused maps added, the
    caches' and budgets' way: the maps run in the consumer's context either way), or a factory
    that holds its context or only subscribes streams built inside the hook
    (`MapSource.context_free`: an inner layer's `InContext`, a retry's, a cache's, a budget's).
    The layer tests that itself, where most built-ins' streams pass (no call to `_layer_stream`,
    which subscribes any other stream inside the hook's context)."""
    hook = getattr(mw, point.value)
    # The run's control, for what the hooks build (`HOOK_CONTROL`): set in the outermost layer's
    # context, which every layer its hook calls while it runs copies (``run.in_hooks``: nothing to
    # look up or set there). A layer called at another time — a retry's next attempt, from the
    # consumer's context; an ``async def`` hook's ``next``, called as it is iterated; a task a
    # hook started — sets it in its own context as the outermost does.
    in_run = point is not ExtensionPoint.ON_AGENT
    set_control = HOOK_CONTROL.set
    copy_context = contextvars.copy_context

    def outer_layer(run: _Run, input: Any) -> EventStream[Any]:
        c = copy_context()
        if in_run:
            c.run(set_control, run.ctx.control)
        run.in_hooks = True
        try:
            stream = c.run(hook, agent, run.ctx, input, MethodType(inner, run))
        finally:
            run.in_hooks = False
        core, run.core_stream = run.core_stream, _NO_CORE_STREAM  # the run goes on without it
        if stream is core or (inner_bound and type(stream) is EventStream and (
                stream._factory is core._factory or getattr(stream._factory, "context_free", False) is True)):
            return stream  # runs in a context of its own already (see above)
        return _layer_stream(stream, c, mw, point)

    def inner_layer(run: _Run, input: Any) -> EventStream[Any]:
        c = copy_context()
        if in_run and not run.in_hooks:
            c.run(set_control, run.ctx.control)
        stream = c.run(hook, agent, run.ctx, input, MethodType(inner, run))
        core = run.core_stream
        if stream is core:
            return stream
        if not (inner_bound and type(stream) is EventStream and (
                stream._factory is core._factory or getattr(stream._factory, "context_free", False) is True)):
            stream = _layer_stream(stream, c, mw, point)
        # What this layer hands out runs in a context of its own: the layers outside treat it as
        # they treat the core's stream, and one whose hook passes it through is done at once.
        run.core_stream = stream
        return stream

    return outer_layer if outermost else inner_layer


def _layer_stream(stream: Any, c: contextvars.Context, mw: MiddlewareBase, point: ExtensionPoint) -> EventStream[Any]:
    """What a layer hands out for the stream its hook returned in ``c`` when that stream does not
    run in a context of its own already (`_layer` tests that first): the stream subscribed inside
    ``c``."""
    if type(stream) is not EventStream:
        stream = c.run(_normalise, stream, mw, point)
    # The inner factory runs in the copy; its fused operators are carried out to this
    # layer's stream, so the maps of stacked hooks stay fused in one loop (one async layer
    # in all). They run in the consumer's context either way: a generator runs where it
    # is iterated.
    return EventStream(InContext(c, stream._factory), stream._steps)


def _bracketed(mw: MiddlewareBase, point: ExtensionPoint, agent: Any, inner: LayerFunction) -> LayerFunction:
    """Hook ``mw`` as a bracketed layer around ``inner``: its hook runs when the layer is
    subscribed, inside MiddlewareStarted/MiddlewareCompleted (`_traced`)."""
    hook = getattr(mw, point.value)
    in_run = point is not ExtensionPoint.ON_AGENT  # (the run's control as in `_layer`)

    def layer(run: _Run, input: Any) -> EventStream[Any]:
        def invoke(input: Any) -> EventStream[Any]:
            if in_run and HOOK_CONTROL.get() is not run.ctx.control:
                HOOK_CONTROL.set(run.ctx.control)
            return _normalise(hook(agent, run.ctx, input, MethodType(inner, run)), mw, point)

        return _traced(mw, point, invoke)(input)

    return layer


def _normalise(result: Any, mw: MiddlewareBase, point: ExtensionPoint) -> EventStream[Any]:
    """What a hook returned, as an EventStream (run in the hook's context copy)."""
    if inspect.isasyncgen(result):
        return EventStream(lambda: stepped(result, contextvars.copy_context()))
    try:
        return to_stream(result)
    except TypeError as exc:
        raise TypeError(f"{mw.name}.{point.value} must return a stream: {exc}. {_fix_for(result)}") from None


def _fix_for(result: Any) -> str:
    """What to write instead, for the two mistakes a hook is most often written with."""
    if result is None:
        return "Did the hook forget `return`? Write `return next(input)` (or return the rewritten stream)."
    if inspect.iscoroutine(result):
        result.close()  # never awaited: closing it keeps Python from warning about it later
        return (
            "The hook is an `async def` that returns: an onion hook is a plain `def` returning "
            "`next(input)` (or a stream built from it), or an `async def` generator that yields "
            "events (`async for event in next(input): yield event`)."
        )
    return "Return `next(input)`, a stream built from it, or an `async def` generator of events."


def _traced(mw: MiddlewareBase, point: ExtensionPoint, invoke: Layer) -> Layer:
    """Bracket each invocation with MiddlewareStarted/Completed; Completed is emitted on error
    too (then the error goes on). The hook runs when the layer is subscribed."""

    def layer(input: Any) -> EventStream[Any]:
        c = contextvars.copy_context()

        async def gen() -> AsyncIterator[Any]:
            started = time.perf_counter()
            yield MiddlewareStarted(middleware=mw.name, point=point.name)
            # Brackets opened inside this layer and not closed yet: a hook that cuts its inner
            # stream short (take_while…) closes those layers before they can emit Completed.
            inner: list[MiddlewareStarted] = []
            try:
                stream = c.run(invoke, input)
                async with aclosing(c.run(stream.__aiter__)) as it:
                    async for event in it:
                        if event.__class__ is MiddlewareStarted and event.source is None:
                            inner.append(event)
                        elif event.__class__ is MiddlewareCompleted and event.source is None and inner:
                            inner.pop()
                        yield event
            except Exception as exc:
                for ev in _cut_short(inner):
                    yield ev
                yield completed_event(mw, point, started, exc)
                raise
            for ev in _cut_short(inner):
                yield ev
            yield completed_event(mw, point, started, None)

        return EventStream(gen)

    return layer


def _cut_short(open_brackets: list[MiddlewareStarted]) -> list[MiddlewareCompleted]:
    """Completed events (``error="cancelled"``) for inner brackets that were closed early,
    innermost first, so the stream stays balanced."""
    now = time.time()
    return [
        MiddlewareCompleted(middleware=s.middleware, point=s.point,
                            duration_ms=max(0.0, (now - s.created_at) * 1000.0), error="cancelled")
        for s in reversed(open_brackets)
    ]


def completed_event(
    mw: MiddlewareBase, point: ExtensionPoint, started: float, error: BaseException | None
) -> MiddlewareCompleted:
    return MiddlewareCompleted(
        middleware=mw.name,
        point=point.name,
        duration_ms=(time.perf_counter() - started) * 1000.0,
        error=None if error is None else f"{type(error).__name__}: {error}",
    )
