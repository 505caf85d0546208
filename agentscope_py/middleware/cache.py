"""Response and tool-result caches: a hit replays the recorded events without calling inward.

* `ResponseCacheMiddleware` (``on_model_call``): the key is a SHA-256 of the normalised request —
  the messages' roles, names and content, the tools, the options, the model's class and name (ids,
  timestamps and metadata left out; tool-call ids replaced by their order of appearance, so the
  pairing of calls and results still counts). A hit replays the recorded ModelCallStart, block
  Start/Delta/End and ModelCallEnd with fresh event, block and tool-call ids, the same content and
  the same delta boundaries, and never reaches the model (nor the middleware inside this one).
* `ToolResultCacheMiddleware` (``on_acting``): the same for calls of tools marked ``read_only``,
  keyed by tool name, arguments and user (``shared=`` tools: by name and arguments only). In a batch, the calls that hit are answered from the cache
  (their ToolResultStart/Delta/End first, in call order) and only the others go inward.

What is stored: only complete, successful replies — a model call whose ModelCallEnd passed with
no ``error`` and not ``discarded`` (never one that raised, was cut short or closed early), a tool
result that ended with state ``success``. Misses are recorded by a fused ``map`` (one list append
and one class test per event, no stream layer of its own), and stored when the ModelCallEnd / ToolResultEnd passes
(the async stores: when the stream completes).

How a hit shows: the replayed ModelCallStart and ModelCallEnd (ToolResultStart and ToolResultEnd)
carry ``metadata["cache"] == "hit"``; a replayed ModelCallEnd has ``usage=ChatUsage()`` (a hit costs
no tokens) and the recorded usage in ``metadata["cached_usage"]``; the recorded brackets' other
metadata described the recorded call and is not replayed. Store failures are logged and
the call goes on as a miss: a cache never breaks a run.

Reply ids: replayed events carry the run's ``reply_id`` once this run's events have shown it (a
miss earlier in the run); a hit on the run's first model call gets a fresh reply id, since hooks
at ``on_model_call``/``on_acting`` are not told the run's (learning it at ``on_agent`` would put a
layer on every event of every run).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..events import (
    AgentEvent,
    ModelCallEnd,
    ModelCallStart,
    ToolResultEnd,
    ToolResultStart,
)
from ..message import ChatUsage, Msg, ToolResultState, ToolUseBlock, new_id
from ..stream import EventStream
from .base import ActingInput, ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from .cache_keys import request_key, tool_call_key
from .cache_stores import CacheStore, InMemoryCacheStore, check_ttl

if TYPE_CHECKING:
    from ..agent.context import RuntimeContext
    from ..agent.react import ReActAgent
    from ..agent.state import AgentState

__all__ = ["ResponseCacheMiddleware", "ToolResultCacheMiddleware", "request_key", "tool_call_key"]

log = logging.getLogger(__name__)

_REPLY = "agentscope.cache.reply_id"  # ctx key: the run's reply id, once its events showed it
HIT = "hit"


# -- recording and replaying ---------------------------------------------------------------------


def _reply_id(ctx: RuntimeContext) -> str:
    if ctx.reply_id is not None:  # the running execution's (the loop sets it)
        return ctx.reply_id
    rid = ctx.get(_REPLY)
    if not isinstance(rid, str):  # outside a run (a hook driven by hand): one fresh id, shared by its hits
        rid = new_id("reply_")
        ctx.put(_REPLY, rid)
    return rid


_new_object = object.__new__
_set_attr = object.__setattr__
# A plan per recorded tuple: what each replayed event copies, and which ids it renews. The memory
# store hands out the same tuple on every hit, so the plan is made once (identity-checked).
_PLANS: dict[int, tuple[Sequence[AgentEvent], list[tuple[Any, ...]]]] = {}


def _plan(events: Sequence[AgentEvent]) -> list[tuple[Any, ...]]:
    entry = _PLANS.get(id(events))
    if entry is not None and entry[0] is events:
        return entry[1]
    plan: list[tuple[Any, ...]] = []
    for ev in events:
        fields = dict(ev.__dict__)
        cls = type(ev)
        # The brackets' metadata described the recorded call (an inner budget's totals, say), not
        # this one: a replayed bracket carries only the hit marks.
        if cls is ModelCallEnd:
            usage = fields["usage"]
            fields["usage"] = ChatUsage()
            fields["metadata"] = {"cache": HIT, "cached_usage": None if usage is None else usage.model_dump()}
        elif cls is ModelCallStart or cls is ToolResultStart or cls is ToolResultEnd:
            fields["metadata"] = {"cache": HIT}
        changed = {"id", "created_at", "metadata", "usage"} & fields.keys()
        plan.append((cls, fields, ev.__pydantic_fields_set__ | changed, "reply_id" in fields,
                     fields.get("block_id"), fields.get("tool_call_id")))
    if len(_PLANS) >= 256:
        _PLANS.clear()
    _PLANS[id(events)] = (events, plan)
    return plan


def _replay(events: Sequence[AgentEvent], reply_id: str, call: ToolUseBlock | None = None) -> list[AgentEvent]:
    """Fresh copies of ``events``: new event, block and tool-call ids (a tool result takes
    ``call``'s id and name), the run's reply id, the same content; the brackets marked as hits.
    Built without validation: every value is one the recorded event already held."""
    ids: dict[str, str] = {}
    now = time.time()
    out: list[AgentEvent] = []
    append = out.append
    for cls, template, fields_set, has_reply, block_id, call_id in _plan(events):
        fields = template.copy()
        fields["id"] = new_id("ev_")
        fields["created_at"] = now
        if has_reply:
            fields["reply_id"] = reply_id
        if block_id is not None:
            fields["block_id"] = ids.get(block_id) or ids.setdefault(block_id, new_id("blk_"))
        if call_id is not None:
            if call is not None:
                fields["tool_call_id"], fields["tool_name"] = call.id, call.name
            else:
                fields["tool_call_id"] = ids.get(call_id) or ids.setdefault(call_id, new_id("call_"))
        metadata = fields["metadata"]
        fields["metadata"] = dict(metadata) if metadata else {}  # each event its own (mutable) dict
        ev = _new_object(cls)
        _set_attr(ev, "__dict__", fields)
        _set_attr(ev, "__pydantic_fields_set__", set(fields_set))
        _set_attr(ev, "__pydantic_extra__", None)
        _set_attr(ev, "__pydantic_private__", None)
        append(ev)
    return out


class _ModelRecorder:
    """A fused map over a miss's events: collects one model call's events, from its
    ModelCallStart to a successful ModelCallEnd, then hands them to ``done``. A new
    ModelCallStart (an inner retry's next attempt) starts over; a failed end drops them."""

    __slots__ = ("buf", "ctx", "done")

    def __init__(self, ctx: RuntimeContext, done: Callable[[list[AgentEvent]], None]) -> None:
        self.ctx = ctx
        self.done = done
        self.buf: list[AgentEvent] | None = None

    def __call__(self, ev: Any) -> Any:
        cls = ev.__class__
        if cls is ModelCallStart and ev.source is None:
            self.buf = [ev]
            self.ctx.put(_REPLY, ev.reply_id)
            return ev
        buf = self.buf
        if buf is not None:
            buf.append(ev)
            if cls is ModelCallEnd and ev.source is None:
                self.buf = None
                if ev.error is None and not ev.discarded:
                    self.done(buf)
        return ev


def _model_tap(store: Any, key: str, ttl: float | None) -> Callable[[Any], Any]:
    """`_ModelRecorder`'s work in a run (``ctx.reply_id`` known: nothing to learn from the events),
    for a store that answers at once: a fused map that only appends each event; at a ModelCallEnd
    of this call it takes the events from the last ModelCallStart (an inner retry's earlier
    attempts fall away) and stores them when the call succeeded. One append and one class test
    per event."""
    buf: list[AgentEvent] = []
    append = buf.append
    end_cls = ModelCallEnd

    def record(ev: Any) -> Any:
        append(ev)
        if ev.__class__ is end_cls and ev.source is None:
            events = _take_call(buf)
            if events is not None:
                store.set_nowait(key, events, ttl)
        return ev

    return record


def _take_call(buf: list[AgentEvent]) -> list[AgentEvent] | None:
    """At a ModelCallEnd (the last of ``buf``): this call's events if it succeeded; ``buf`` is
    emptied."""
    end: Any = buf[-1]
    # The call's ModelCallStart is nearly always the first event recorded; else the last start
    # before the end.
    first: Any = buf[0]
    if first.__class__ is ModelCallStart and first.source is None and ModelCallStart not in map(type, buf[1:]):
        i = 0
    else:
        i = _last_start(buf)
    events = buf[i:] if i >= 0 else None
    del buf[:]
    return events if end.error is None and not end.discarded else None


def _last_start(buf: list[AgentEvent]) -> int:
    """The index of the last ModelCallStart of this call (not a sub-agent's) in ``buf``, or -1."""
    for i in range(len(buf) - 2, -1, -1):
        ev: Any = buf[i]
        if ev.__class__ is ModelCallStart and ev.source is None:
            return i
    return -1


class _ToolRecorder:
    """A fused map over the misses of an acting batch: per cacheable call, its result events,
    handed to ``done`` when the result ends with state success."""

    __slots__ = ("bufs", "ctx", "done", "keys")

    def __init__(self, ctx: RuntimeContext, keys: Mapping[str, str], done: Callable[[str, list[AgentEvent]], None]):
        self.ctx = ctx
        self.keys = keys  # tool call id -> cache key, of the cacheable misses
        self.done = done
        self.bufs: dict[str, list[AgentEvent]] = {}

    def __call__(self, ev: Any) -> Any:
        cls = ev.__class__
        if cls is ToolResultStart:
            if ev.source is None:
                self.ctx.put(_REPLY, ev.reply_id)
                if ev.tool_call_id in self.keys:
                    self.bufs[ev.tool_call_id] = [ev]
            return ev
        if self.bufs and ev.source is None:
            buf = self.bufs.get(getattr(ev, "tool_call_id", ""))
            if buf is not None:
                buf.append(ev)
                if cls is ToolResultEnd:
                    del self.bufs[ev.tool_call_id]
                    if ev.state is ToolResultState.SUCCESS:
                        self.done(self.keys[ev.tool_call_id], buf)
        return ev


class _CacheBase(MiddlewareBase):
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

    def on_agent_state_ready(
        self, agent: ReActAgent, ctx: RuntimeContext, state: AgentState, input_messages: list[Msg]
    ) -> None:
        ctx.put(_REPLY, None)  # a new execution: a reply id learned by the last one is not this one's

    async def _get(self, key: str) -> tuple[AgentEvent, ...] | None:
        try:
            return await self.store.get(key)
        except Exception as exc:  # a cache is an optimisation: a failing store is a miss
            log.warning("%s: reading the cache failed (%s: %s); calling inward", self.name, type(exc).__name__, exc)
            return None

    async def _set(self, key: str, events: Sequence[AgentEvent], ttl: float | None) -> None:
        try:
            await self.store.set(key, events, ttl)
        except Exception as exc:
            log.warning("%s: writing the cache failed (%s: %s)", self.name, type(exc).__name__, exc)


class ResponseCacheMiddleware(_CacheBase):
    """Replays recorded model replies for identical requests (see the module docstring).

    ``store``: a `CacheStore` (default: an `InMemoryCacheStore` of ``max_entries``); ``ttl``:
    seconds an entry lives (None: until evicted); ``key``: a function of the `ModelCallInput`
    giving the key (default `request_key`); return None to bypass the cache for that call."""

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
        return frozenset({ExtensionPoint.ON_MODEL_CALL, ExtensionPoint.ON_AGENT_STATE_READY})

    def on_model_call(self, agent: ReActAgent, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        key = self.key(input)
        if key is None:
            return next(input)
        ttl = self.ttl
        if self._sync:
            store: Any = self.store
            recorded = store.get_nowait(key)
            if recorded is not None:
                self.hits += 1
                return EventStream.defer(lambda: _replay(recorded, _reply_id(ctx)))
            self.misses += 1
            if ctx.reply_id is not None:  # in a run: the lean recorder (the reply id is known)
                return next(input).map(_model_tap(store, key, ttl))
            return next(input).map(_ModelRecorder(ctx, lambda events: store.set_nowait(key, events, ttl)))
        inner = next(input)  # built here, in the hook's context (a span around it parents the call)

        async def call() -> AsyncIterator[AgentEvent]:
            recorded = await self._get(key)
            if recorded is not None:
                self.hits += 1
                for ev in _replay(recorded, _reply_id(ctx)):
                    yield ev
                return
            self.misses += 1
            done: list[list[AgentEvent]] = []
            async with contextlib.aclosing(inner.map(_ModelRecorder(ctx, done.append)).__aiter__()) as it:  # type: ignore[type-var]
                async for ev in it:
                    yield ev
            if done:
                await self._set(key, done[-1], ttl)

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
        return frozenset({ExtensionPoint.ON_ACTING, ExtensionPoint.ON_AGENT_STATE_READY})

    def _cacheable(self, agent: ReActAgent, ctx: RuntimeContext, calls: Sequence[ToolUseBlock]) -> dict[str, str]:
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

    def on_acting(self, agent: ReActAgent, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
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
            return next(input).map(_ToolRecorder(ctx, keys, done))
        misses = [c for c in calls if c.id not in hits]
        replayed = EventStream.defer(lambda: [ev for c in calls if c.id in hits
                                              for ev in _replay(hits[c.id], _reply_id(ctx), c)])
        if not misses:
            return replayed
        rest = next(input.replace(tool_calls=misses))
        miss_keys = {cid: key for cid, key in keys.items() if cid not in hits}
        return EventStream.concat(replayed, rest.map(_ToolRecorder(ctx, miss_keys, done)))

    async def _async_acting(
        self, ctx: RuntimeContext, input: ActingInput, next: Next, keys: dict[str, str], names: dict[str, str]
    ) -> AsyncIterator[AgentEvent]:
        calls = input.tool_calls
        hits: dict[str, tuple[AgentEvent, ...]] = {}
        for cid, key in keys.items():
            recorded = await self._get(key)
            if recorded is not None:
                hits[cid] = recorded
        self.hits += len(hits)
        self.misses += len(keys) - len(hits)
        for c in calls:
            if c.id in hits:
                for ev in _replay(hits[c.id], _reply_id(ctx), c):
                    yield ev
        misses = [c for c in calls if c.id not in hits]
        if not misses:
            return
        done: list[tuple[str, list[AgentEvent]]] = []
        miss_keys = {cid: key for cid, key in keys.items() if cid not in hits}
        rest = next(input if not hits else input.replace(tool_calls=misses))
        recorder = _ToolRecorder(ctx, miss_keys, lambda key, events: done.append((key, events)))
        async with contextlib.aclosing(rest.map(recorder).__aiter__()) as it:  # type: ignore[type-var]
            async for ev in it:
                yield ev
        for key, events in done:
            await self._set(key, events, self._ttl(events[0].__dict__["tool_name"]))
