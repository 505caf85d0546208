"""Response and tool-result caches: a hit replays the recorded events without calling inward.

* `ResponseCacheMiddleware` (``on_model_call``): the key is a SHA-256 of the normalised request —
  the messages' roles, names and content, the tools, the options, the model's class and name (ids,
  timestamps and metadata left out; tool-call ids replaced by their order of appearance, so the
  pairing of calls and results still counts). A hit replays the recorded ModelCallStart, block
  Start/Delta/End and ModelCallEnd with fresh event, block and tool-call ids, the same content and
  the same delta boundaries, and never reaches the model (nor the middleware inside this one).
* `ToolResultCacheMiddleware` (``on_acting``): the same for calls of tools marked ``read_only``,
  keyed by tool name, arguments and user (``shared=`` tools: name and arguments only). In a
  batch, the calls that hit are answered from the cache (their ToolResultStart/Delta/End first,
  in call order) and only the others go inward.

What is stored: only complete, successful replies — a model call whose ModelCallEnd passed with
no ``error`` and not ``discarded`` (never one that raised, was cut short or closed early), a tool
result that ended with state ``success``. Misses are recorded by a fused ``map`` (one list append
and a class test or two per event, no stream layer of its own), and stored when the ModelCallEnd / ToolResultEnd passes
(the async stores: when the stream completes). In a ``call()`` that nothing observes, a model call's
miss with a store that answers at once is recorded from the parts its call hands to the loop
(`_parts_record.Missed`) and stored as that data, whose events are made when first read; a hit
there hands the recorded reply to the loop the same way (`_parts_record.Hit`), with no events.

How a hit shows: the replayed ModelCallStart and ModelCallEnd (ToolResultStart and ToolResultEnd)
carry ``metadata["cache"] == "hit"``; a replayed ModelCallEnd has ``usage=ChatUsage()`` (a hit costs
no tokens) and the recorded usage in ``metadata["cached_usage"]``; the recorded brackets' other
metadata described the recorded call and is not replayed. Store failures are logged and
the call goes on as a miss: a cache never breaks a run. So is an entry of a store that does not
answer at once (SQLite, Redis, one of your own) that is not one whole recorded reply — written by
another version, cut short, edited by hand: it must start with this kind's Start bracket and end
with its successful End, with no other bracket of the kind between (`whole_reply`,
`whole_result`); the miss's reply is then stored over it.

Waiting for a store that does not answer at once: through the run's wait (``ctx.wait``: an
interrupt ends a read or a write at once), and for no longer than the call's deadline lets its
model take to answer (``first_event`` or ``total``, whichever is earlier, on the record a
`TimeoutMiddleware` outside passes inward; a tool call's ``total``): the model call keeps its
deadline around its own reads only, so a store that hung would hold the call past it. A read
given up is a miss; a write given up stores nothing. The deadline holds across the read and the
model call after a miss: the call gets what the read left of it (`_deadline.spent`), and none
left is the call's `ModelTimeoutError`. So for tool calls: the reads of a batch share its
deadline, the calls that missed run with what the reads left of it, and with none left each gets
the error result of a tool that timed out (``Error: <tool> timed out after <total> s
(TimeoutMiddleware; its cache's store took <s> s).``, state ``error``), without running.

Reply ids: replayed events carry the run's ``reply_id`` (the loop binds it to the context before
any hook runs). A hook driven by hand, outside any run, uses the reply id a miss on that context
showed, else one fresh id its hits share.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from ..._deadline import earlier, spent, tool_spent, tool_timeout_text
from ..._replies import result_events
from ...errors import AgentInterrupted
from ...events import AgentEvent, ModelCallEnd, ModelCallStart, ToolResultEnd, ToolResultStart
from ...extension.base import ActingInput, ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from ...message import ToolResultState, ToolUseBlock, new_id
from ...stream import EventStream, aclosing
from ._cache_record import REPLY, ModelRecorder, ToolRecorder, replay
from ._parts_record import Hit, Missed
from .cache_keys import request_key, tool_call_key
from .cache_stores import CacheStore, InMemoryCacheStore, check_ttl

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...extension.base import AgentView

__all__ = ["ResponseCacheMiddleware", "ToolResultCacheMiddleware", "request_key", "tool_call_key"]

log = logging.getLogger("agentscope_py.middleware.cache")
T = TypeVar("T")



# -- recording and replaying ---------------------------------------------------------------------


def _reply_id(ctx: RuntimeContext) -> str:
    # In a run the context holds the execution's own reply id (the loop binds it before any hook
    # runs), so what a miss learned (REPLY) matters only to hooks driven by hand, outside any run:
    # no state-ready hook is needed to forget the last run's (it would cost every run a call).
    if ctx.reply_id is not None:
        return ctx.reply_id
    rid = ctx.get(REPLY)
    if not isinstance(rid, str):  # outside a run (a hook driven by hand): one fresh id, shared by its hits
        rid = new_id("reply_")
        ctx.put(REPLY, rid)
    return rid


def whole_reply(events: Sequence[AgentEvent]) -> str | None:
    """What keeps ``events`` from being one recorded model reply, or None: a ModelCallStart of
    this call, then its events, then its ModelCallEnd with no error and not discarded."""
    if not events:
        return "it holds no event"
    first, last = events[0], events[-1]
    if type(first) is not ModelCallStart or first.source is not None:
        return "it does not start with the call's ModelCallStart"
    if type(last) is not ModelCallEnd or last.source is not None or last.error is not None or last.discarded:
        return "it does not end with the call's successful ModelCallEnd"
    for ev in events[1:-1]:
        if (type(ev) is ModelCallStart or type(ev) is ModelCallEnd) and ev.source is None:
            return "it holds more than one model call"
    return None


def whole_result(events: Sequence[AgentEvent]) -> str | None:
    """What keeps ``events`` from being one recorded tool result, or None: a ToolResultStart, its
    events, and a ToolResultEnd of the same call with state success."""
    if not events:
        return "it holds no event"
    first, last = events[0], events[-1]
    if type(first) is not ToolResultStart or first.source is not None:
        return "it does not start with the call's ToolResultStart"
    if (type(last) is not ToolResultEnd or last.source is not None or last.state is not ToolResultState.SUCCESS
            or last.tool_call_id != first.tool_call_id):
        return "it does not end with the call's successful ToolResultEnd"
    for ev in events[1:-1]:
        if (type(ev) is ToolResultStart or type(ev) is ToolResultEnd) and ev.source is None:
            return "it holds more than one tool result"
    return None


class _CacheBase(MiddlewareBase):
    roles = frozenset({"cache"})  # a hit answers without calling next (the ordering lints)
    _whole: Callable[[Sequence[AgentEvent]], str | None]  # what is wrong with a read entry, or None

    def __init__(self, store: CacheStore | None, ttl: float | None, max_entries: int) -> None:
        self.ttl = check_ttl(ttl)
        if store is None:
            store = InMemoryCacheStore(max_entries)
        elif not isinstance(store, CacheStore):
            raise TypeError(f"store must be a CacheStore (get/set), got {type(store).__name__}")
        elif not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be an int >= 1, got {max_entries!r}")
        self.store = store
        self._sync = getattr(store, "sync", False) is True
        self.hits = 0
        self.misses = 0

    async def _get(self, ctx: RuntimeContext, key: str, within: float | None = None) -> Sequence[AgentEvent] | None:
        try:  # (the run's wait: an interrupt ends it at once, as a slow store's answer would be waited for)
            recorded = await _store_wait(ctx, self.store.get(key), within)
        except AgentInterrupted:
            raise
        except Exception as exc:  # a cache is an optimisation: a failing or stalled store is a miss
            log.warning("%s: reading the cache failed (%s: %s); calling inward", self.name, type(exc).__name__, exc)
            return None
        if recorded is None:
            return None
        problem = type(self)._whole(recorded)
        if problem is not None:  # never replay what was not recorded whole (the miss writes over it)
            log.warning("%s: the cache entry %s is not a whole recorded reply (%s); calling inward",
                        self.name, key, problem)
            return None
        return recorded

    async def _set(self, ctx: RuntimeContext, key: str, events: Sequence[AgentEvent], ttl: float | None,
                   within: float | None = None) -> None:
        try:  # (the run's wait too: the stream ends only after the write, so a stalled store holds the run)
            await _store_wait(ctx, self.store.set(key, events, ttl), within)
        except AgentInterrupted:
            raise
        except Exception as exc:
            log.warning("%s: writing the cache failed (%s: %s)", self.name, type(exc).__name__, exc)


async def _store_wait(ctx: RuntimeContext, answer: Awaitable[T], within: float | None) -> T:
    """``answer`` awaited through the run's wait, given up (a `TimeoutError`) after ``within``
    seconds when that is set."""
    if within is None:
        return await ctx.wait(answer)
    bound = asyncio.timeout(within)
    try:
        async with bound:
            return await ctx.wait(answer)
    except TimeoutError:
        if bound.expired():
            raise TimeoutError(f"no answer within {within:g} s, the call's deadline") from None
        raise


class ResponseCacheMiddleware(_CacheBase):
    """Replays recorded model replies for identical requests (see the module docstring).

    ``store``: a `CacheStore` (default: an `InMemoryCacheStore` of ``max_entries``); ``ttl``:
    seconds an entry lives (None: until evicted); ``key``: a function of the `ModelCallInput`
    giving the key (default `request_key`); return None to bypass the cache for that call."""

    _whole = staticmethod(whole_reply)

    def __init__(
        self,
        store: CacheStore | None = None,
        *,
        ttl: float | None = None,
        max_entries: int = 1024,
        key: Callable[[ModelCallInput], str | None] | None = None,
    ) -> None:
        super().__init__(store, ttl, max_entries)
        self.key = key or request_key

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_MODEL_CALL})

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        key = self.key(input)
        if key is None:
            return next(input)
        ttl = self.ttl
        if self._sync:
            store: Any = self.store
            recorded = store.get_nowait(key)
            if recorded is not None:
                self.hits += 1
                return EventStream(Hit(recorded, partial(_reply_id, ctx)))
            self.misses += 1
            if ctx.reply_id is not None:  # in a run: the lean recorder (the reply id is known)
                return EventStream(Missed(next(input), store, key, ttl, ctx.reply_id))
            return next(input).map(ModelRecorder(ctx, lambda events: store.set_nowait(key, events, ttl)))
        # The call is built in the hook's context (a span around it parents the call): here, or,
        # under a deadline, after the store's read, through a copy of that context.
        deadline = input.deadline
        inner = next(input) if deadline is None else None
        here = contextvars.copy_context() if deadline is not None else None
        # (as long as the call's deadline lets its model take to answer; with none, as the store takes)
        within = None if deadline is None else earlier(deadline.first_event, deadline.total)

        async def call() -> AsyncIterator[AgentEvent]:
            clock = asyncio.get_running_loop().time
            started = clock()
            recorded = await self._get(ctx, key, within)
            if recorded is not None:
                self.hits += 1
                for ev in replay(recorded, _reply_id(ctx)):
                    yield ev
                return
            self.misses += 1
            called = inner
            if called is None:  # the deadline holds across the read and the call: the call gets what is left
                assert deadline is not None and here is not None
                called = here.run(next, input.replace(deadline=spent(deadline, clock() - started, input.model)))
            done: list[list[AgentEvent]] = []
            async with aclosing(called.map(ModelRecorder(ctx, done.append)).__aiter__()) as it:
                async for ev in it:
                    yield ev
            if done:
                await self._set(ctx, key, done[-1], ttl, within)

        return EventStream(call)


class ToolResultCacheMiddleware(_CacheBase):
    """Replays recorded results of ``read_only`` tools for identical calls (module docstring).

    ``ttl``: the default lifetime; ``ttls``: per tool name (None there: no expiry for that tool);
    ``tools``: only these tool names (default: every read-only tool). A call is cacheable when its
    tool is ``read_only``, not external, has no ``check_permissions`` and the toolkit no
    ``policy`` (a hit must never skip a permission check), and its arguments parsed.

    Results are kept per user (``ctx.user_id`` is part of the key): a result recorded for one user
    is never served to another, since a read-only tool may still read who is asking (its
    `RuntimeContext`). ``shared``: names of tools whose results do not depend on the caller (a
    public lookup), shared by every user."""

    _whole = staticmethod(whole_result)

    def __init__(
        self,
        store: CacheStore | None = None,
        *,
        ttl: float | None = None,
        ttls: Mapping[str, float | None] | None = None,
        tools: Collection[str] | None = None,
        shared: Collection[str] = (),
        max_entries: int = 1024,
    ) -> None:
        super().__init__(store, ttl, max_entries)
        self.ttls = {name: check_ttl(t, f"ttls[{name!r}]") for name, t in (ttls or {}).items()}
        self.tools = frozenset(tools) if tools is not None else None
        if isinstance(shared, str) or not all(isinstance(name, str) for name in shared):
            raise ValueError(f"shared must be a collection of tool names, e.g. shared=[\"weather\"], got {shared!r}")
        self.shared = frozenset(shared)

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_ACTING})

    def _cacheable(self, agent: AgentView, ctx: RuntimeContext, calls: Sequence[ToolUseBlock]) -> dict[str, str]:
        toolkit = agent.toolkit
        if toolkit.policy is not None:
            return {}
        keys: dict[str, str] = {}
        for c in calls:
            tool = toolkit.get(c.name)
            if (tool is None or not tool.read_only or tool.external or tool.check_permissions is not None
                    or c.raw_input is not None or (self.tools is not None and c.name not in self.tools)):
                continue
            keys[c.id] = tool_call_key(c, None if c.name in self.shared else ctx.user_id)
        return keys

    def _ttl(self, name: str) -> float | None:
        return self.ttls.get(name, self.ttl)

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        calls = input.tool_calls
        keys = self._cacheable(agent, ctx, calls)
        if not keys:
            return next(input)  # nothing cacheable: a pure pass-through
        names = {c.id: c.name for c in calls}
        if not self._sync:
            return EventStream(lambda: self._async_acting(ctx, input, next, keys, names))
        store: Any = self.store
        hits = {cid: ev for cid, key in keys.items() if (ev := store.get_nowait(key)) is not None}
        self.hits += len(hits)
        self.misses += len(keys) - len(hits)

        def done(key: str, events: list[AgentEvent]) -> None:
            store.set_nowait(key, events, self._ttl(events[0].__dict__["tool_name"]))

        if not hits:
            return next(input).map(ToolRecorder(ctx, keys, done))
        misses = [c for c in calls if c.id not in hits]
        replayed = EventStream.defer(lambda: [ev for c in calls if c.id in hits
                                              for ev in replay(hits[c.id], _reply_id(ctx), c)])
        if not misses:
            return replayed
        rest = next(input.replace(tool_calls=misses))
        miss_keys = {cid: key for cid, key in keys.items() if cid not in hits}
        return EventStream.concat(replayed, rest.map(ToolRecorder(ctx, miss_keys, done)))

    async def _async_acting(
        self, ctx: RuntimeContext, input: ActingInput, next: Next, keys: dict[str, str], names: dict[str, str]
    ) -> AsyncIterator[AgentEvent]:
        calls = input.tool_calls
        hits: dict[str, Sequence[AgentEvent]] = {}
        deadline = input.deadline
        within = None if deadline is None else deadline.total
        clock = asyncio.get_running_loop().time
        started = clock()
        for cid, key in keys.items():
            # (the reads share the calls' deadline: each gets what the reads before it left)
            left = None if within is None else within - (clock() - started)
            if left is not None and left <= 0:
                break  # used up: the calls not read are misses, and time out below
            recorded = await self._get(ctx, key, left)
            if recorded is not None:
                hits[cid] = recorded
        self.hits += len(hits)
        self.misses += len(keys) - len(hits)
        for c in calls:
            if c.id in hits:
                for ev in replay(hits[c.id], _reply_id(ctx), c):
                    yield ev
        misses = [c for c in calls if c.id not in hits]
        if not misses:
            return
        if deadline is not None and within is not None:
            # The deadline holds across the reads and the calls after a miss: they get what is left.
            waited = clock() - started
            left_of = tool_spent(deadline, waited)
            if left_of is None:  # nothing left: each call times out before it starts, as a tool would
                reply_id = _reply_id(ctx)
                for c in misses:  # (the error result a tool that timed out gets: the call never ran)
                    text = tool_timeout_text(c.name, within, deadline.by, waited)
                    for ev in result_events(reply_id, c, text, ToolResultState.ERROR):
                        yield ev
                return
            input = input.replace(deadline=left_of)
        done: list[tuple[str, list[AgentEvent]]] = []
        miss_keys = {cid: key for cid, key in keys.items() if cid not in hits}
        rest = next(input if not hits else input.replace(tool_calls=misses))
        recorder = ToolRecorder(ctx, miss_keys, lambda key, events: done.append((key, events)))
        async with aclosing(rest.map(recorder).__aiter__()) as it:
            async for ev in it:
                yield ev
        for key, events in done:
            await self._set(ctx, key, events, self._ttl(events[0].__dict__["tool_name"]), within)
