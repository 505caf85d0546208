"""Recording a miss and replaying a hit, for `cache`'s middleware (see its docstring).

A miss is recorded from its events as they pass (`model_tap`, `ModelRecorder`), or, in a run
whose events nobody reads, from the parts its model call hands to the loop's builder
(`PartsRecording`, through `Missed.building`): no event is made while the call streams, and the
events a complete reply would have made are made once, at its end, for the store."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from ..._stream.operators import Maps, MapSource, Recovery, apply_maps, maps_of
from ..._trusted import Shape, shape
from ...events import (
    AgentEvent,
    ModelCallEnd,
    ModelCallStart,
    TextBlockDelta,
    TextBlockEnd,
    TextBlockStart,
    ThinkingBlockDelta,
    ThinkingBlockEnd,
    ThinkingBlockStart,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolResultEnd,
    ToolResultStart,
)
from ...message import ChatUsage, ToolResultState, ToolUseBlock, new_id

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from ..._context import RuntimeContext
    from ..._replies import ReplyParts
    from ...stream import EventStream

__all__ = ["HIT", "REPLY", "Missed", "ModelRecorder", "PartsRecording", "ToolRecorder", "model_tap", "replay"]

REPLY = "agentscope.cache.reply_id"  # ctx key: the run's reply id, once its events showed it
HIT = "hit"

def _marks(ev: AgentEvent) -> dict[str, Any]:
    """What a replayed bracket carries instead of the recorded one's metadata (which described the
    recorded call — an inner budget's totals, say — not this one): the hit marks."""
    cls = type(ev)
    if cls is ModelCallEnd:
        usage = cast(ModelCallEnd, ev).usage
        return {"usage": ChatUsage(),
                "metadata": {"cache": HIT, "cached_usage": None if usage is None else usage.model_dump()}}
    if cls is ModelCallStart or cls is ToolResultStart or cls is ToolResultEnd:
        return {"metadata": {"cache": HIT}}
    return {"metadata": dict(ev.metadata)}  # each event its own dict


def replay(events: Sequence[AgentEvent], reply_id: str, call: ToolUseBlock | None = None) -> list[AgentEvent]:
    """Fresh copies of ``events``: new event, block and tool-call ids (a tool result takes
    ``call``'s id and name), the run's reply id, the same content; the brackets marked as hits.
    Each a `_copy`: every value is one the recorded event already held, or a new id."""
    ids: dict[str, str] = {}
    now = time.time()
    out: list[AgentEvent] = []
    for ev in events:
        fields = ev.__dict__
        update = _marks(ev)
        update["id"] = new_id("ev_")
        update["created_at"] = now
        if "reply_id" in fields:
            update["reply_id"] = reply_id
        block_id = fields.get("block_id")
        if block_id is not None:
            update["block_id"] = ids.get(block_id) or ids.setdefault(block_id, new_id("blk_"))
        call_id = fields.get("tool_call_id")
        if call_id is not None:
            if call is not None:
                update["tool_call_id"], update["tool_name"] = call.id, call.name
            else:
                update["tool_call_id"] = ids.get(call_id) or ids.setdefault(call_id, new_id("call_"))
        out.append(_copy(ev, update))
    return out


# Per event class, its builder from every field (`_trusted`), or None for a class that needs its
# validators (a subclass of one's own): model_copy copies those.
_SHAPES: dict[type[AgentEvent], Shape[Any] | None] = {}


def _copy(ev: AgentEvent, update: dict[str, Any]) -> AgentEvent:
    """``ev.model_copy(update=update)``, built from every field by the class's shape: the values
    are the recorded event's own and the replay's new ids and marks, each of its field's type.
    model_copy's generic way (each of pydantic's slots copied through the ``copy`` module, the
    fields set copied and updated) is most of what replaying a long reply costs. The copy's
    ``model_fields_set`` is every field, as for a hit read back from SQLite or Redis."""
    cls = type(ev)
    try:
        built = _SHAPES[cls]
    except KeyError:
        built = _SHAPES[cls] = _shape_of(cls)
    if built is not None:
        try:
            return cast(AgentEvent, built.build(**{**ev.__dict__, **update}))
        except TypeError:  # not every field in its __dict__ (one a middleware made by model_construct)
            pass
    return ev.model_copy(update=update)


def _shape_of(cls: type[AgentEvent]) -> Shape[Any] | None:
    try:
        return shape(cls, *cls.model_fields)
    except TypeError:  # it has validators (or another reason to validate it): model_copy
        return None


class ModelRecorder:
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
            self.ctx.put(REPLY, ev.reply_id)
            return ev
        buf = self.buf
        if buf is not None:
            buf.append(ev)
            if cls is ModelCallEnd and ev.source is None:
                self.buf = None
                if ev.error is None and not ev.discarded:
                    self.done(buf)
        return ev


def model_tap(store: Any, key: str, ttl: float | None) -> Callable[[Any], Any]:
    """`ModelRecorder`'s work in a run (``ctx.reply_id`` known: nothing to learn from the events),
    for a store that answers at once: a fused map that appends each event; a ModelCallStart of
    this call starts the recording over (an inner retry's earlier attempts, and what an inner
    middleware emitted before the start, fall away), and at a ModelCallEnd of this call the
    events since that start are stored when the call succeeded. Two class tests and one append
    per event: the recording holds this call's events only, so the end has nothing to search."""
    buf: list[AgentEvent] = []
    append, clear = buf.append, buf.clear
    start_cls, end_cls = ModelCallStart, ModelCallEnd

    def record(ev: Any) -> Any:
        cls = ev.__class__
        if cls is start_cls:
            if ev.source is None:
                clear()
        elif cls is end_cls and ev.source is None:
            append(ev)
            first = buf[0]
            if ev.error is None and not ev.discarded and first.__class__ is start_cls and first.source is None:
                store.set_nowait(key, tuple(buf), ttl)  # (the store keeps the tuple: no second copy)
            clear()
            return ev
        append(ev)
        return ev

    return record


class Missed(MapSource):
    """A miss's stream factory in a run, for a store that answers at once: subscribed, the inner
    stream with `model_tap` fused (each subscription records its own); read with no events
    (`building`), a `PartsRecording` is the reply the inner call hands its parts to. It only
    subscribes the stream built inside the hook (``inner``): `context_free`."""

    __slots__ = ("inner", "key", "reply_id", "store", "ttl")

    context_free = True

    def __init__(self, inner: EventStream[AgentEvent], store: Any, key: str, ttl: float | None,
                 reply_id: str) -> None:
        self.inner = inner
        self.store = store
        self.key = key
        self.ttl = ttl
        self.reply_id = reply_id

    def with_maps(self, maps: Maps) -> AsyncIterator[Any]:
        # ``inner.map(tap)`` and ``maps`` subscribed: a `MapSource` with only maps of its own (the
        # model call's) takes them all at once, as `EventStream.__aiter__` would give them.
        tap = model_tap(self.store, self.key, self.ttl)
        inner = self.inner
        factory, own = inner._factory, maps_of(inner._steps)
        if own is not None and isinstance(factory, MapSource):
            return factory.with_maps((*own, tap, *maps))
        stream = inner.map(tap)
        for fn in maps:
            stream = stream.map(fn)
        return stream.__aiter__()

    def recovering(self, maps: Maps, recovery: Recovery) -> AsyncIterator[Any] | None:
        inner = self.inner
        factory, own = inner._factory, maps_of(inner._steps)
        if own is None or not isinstance(factory, MapSource):
            return None
        n, passes, resume = recovery
        return factory.recovering((*own, model_tap(self.store, self.key, self.ttl), *maps),
                                  (len(own) + 1 + n, passes, resume))

    def building(
        self, reply: ReplyParts, alone: Callable[[], bool], recovery: Recovery | None = None,
    ) -> AsyncIterator[Any] | None:
        inner = self.inner
        factory = inner._factory
        if inner._steps or not isinstance(factory, MapSource):
            return None
        it = factory.building(PartsRecording(reply, self.reply_id, self.store, self.key, self.ttl), alone, recovery)
        if it is None:
            return None
        # What it still yields (an attempt of a retry inside that is read as events) is recorded
        # as `with_maps` records it.
        return apply_maps(it, (model_tap(self.store, self.key, self.ttl),))


# The events of a model call's reply, built from the parts `PartsManager` hands on: values it made
# itself or validated (exact ``str`` ids and text, a `ChatUsage`), as it builds them.
_START = shape(ModelCallStart, "reply_id", "model")
_END = shape(ModelCallEnd, "reply_id", "usage", "finish_reason", "model")
_TEXT_START = shape(TextBlockStart, "reply_id", "block_id")
_TEXT = shape(TextBlockDelta, "reply_id", "block_id", "delta")
_TEXT_END = shape(TextBlockEnd, "reply_id", "block_id")
_THINKING_START = shape(ThinkingBlockStart, "reply_id", "block_id")
_THINKING = shape(ThinkingBlockDelta, "reply_id", "block_id", "delta")
_THINKING_END = shape(ThinkingBlockEnd, "reply_id", "block_id", "signature")
_CALL_START = shape(ToolCallStart, "reply_id", "tool_call_id", "tool_name")
_CALL = shape(ToolCallDelta, "reply_id", "tool_call_id", "tool_name", "delta")
_CALL_END = shape(ToolCallEnd, "reply_id", "tool_call_id", "tool_name")
_TEXT_PART, _THINKING_PART, _SIGNED_PART, _CALL_PART = 0, 1, 2, 3


class PartsRecording:
    """A miss read with no events (`Missed.building`): the reply the model call hands its parts
    to (`_replies.ReplyParts`), each handed on to ``reply`` and kept as a tuple; at the end of a
    complete call (no ``error``, not ``discarded``), the events that call would have made are
    built from them and stored, as `model_tap` stores a miss read as events — so a hit replays
    the same events, whichever way its miss was read.

    Those events, in the order `PartsManager` makes them: a block's Start before its first part;
    a text block ends at the next part that is not its own (thinking, a tool call) or at the
    end; a thinking block at its signature (its End's part, a block of a signature alone
    included); the tool calls, all at the end (a call a provider ended early by reusing its
    index for the next one is recorded as ending there too: the parts do not carry the index)."""

    __slots__ = ("key", "model", "parts", "reply", "reply_id", "store", "ttl")

    def __init__(self, reply: ReplyParts, reply_id: str, store: Any, key: str, ttl: float | None) -> None:
        self.reply = reply
        self.reply_id = reply_id
        self.store = store
        self.key = key
        self.ttl = ttl
        self.model = ""
        self.parts: list[tuple[Any, ...]] = []

    def begin(self, model: str) -> None:
        self.model = model
        self.parts = []  # (a retry's next attempt inside: its own reply only)
        self.reply.begin(model)

    def text(self, block_id: str, delta: str) -> None:
        self.parts.append((_TEXT_PART, block_id, delta))
        self.reply.text(block_id, delta)

    def thinking(self, block_id: str, delta: str) -> None:
        self.parts.append((_THINKING_PART, block_id, delta))
        self.reply.thinking(block_id, delta)

    def signed(self, block_id: str, signature: str | None) -> None:
        self.parts.append((_SIGNED_PART, block_id, signature))
        self.reply.signed(block_id, signature)

    def tool_call(self, call_id: str, name: str, delta: str | None = None) -> None:
        self.parts.append((_CALL_PART, call_id, name, delta))
        self.reply.tool_call(call_id, name, delta)

    def end(self, usage: ChatUsage | None, finish_reason: str | None, discarded: bool,
            error: str | None = None) -> None:
        if error is None and not discarded:
            self.store.set_nowait(self.key, self._events(usage, finish_reason), self.ttl)
        self.parts = []
        self.reply.end(usage, finish_reason, discarded, error)

    def _events(self, usage: ChatUsage | None, finish_reason: str | None) -> tuple[AgentEvent, ...]:
        rid = self.reply_id
        out: list[AgentEvent] = [_START.build(reply_id=rid, model=self.model)]
        put = out.append
        text: str | None = None  # the open text block
        thinking: str | None = None  # the open thinking block
        calls: dict[str, str] = {}  # the tool calls opened: id -> name, in order
        for part in self.parts:
            kind, block = part[0], part[1]
            if kind == _TEXT_PART:
                if block != text:
                    text = block
                    put(_TEXT_START.build(reply_id=rid, block_id=block))
                put(_TEXT.build(reply_id=rid, block_id=block, delta=part[2]))
                continue
            if text is not None:  # anything else ends the text block
                put(_TEXT_END.build(reply_id=rid, block_id=text))
                text = None
            if kind in (_THINKING_PART, _SIGNED_PART):
                if block != thinking:
                    thinking = block
                    put(_THINKING_START.build(reply_id=rid, block_id=block))
                if kind == _THINKING_PART:
                    put(_THINKING.build(reply_id=rid, block_id=block, delta=part[2]))
                else:
                    put(_THINKING_END.build(reply_id=rid, block_id=block, signature=part[2]))
                    thinking = None
            elif part[3] is None:
                calls[block] = part[2]
                put(_CALL_START.build(reply_id=rid, tool_call_id=block, tool_name=part[2]))
            else:
                put(_CALL.build(reply_id=rid, tool_call_id=block, tool_name=part[2], delta=part[3]))
        if text is not None:
            put(_TEXT_END.build(reply_id=rid, block_id=text))
        for call_id, name in calls.items():
            put(_CALL_END.build(reply_id=rid, tool_call_id=call_id, tool_name=name))
        put(_END.build(reply_id=rid, usage=usage, finish_reason=finish_reason, model=self.model))
        return tuple(out)


class ToolRecorder:
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
                self.ctx.put(REPLY, ev.reply_id)
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


