"""A model call's reply as the parts its call hands to the loop's builder, for `cache`'s
`ResponseCacheMiddleware` in a run whose events nobody reads (`MapSource.building`):

* a miss is recorded from those parts (`Missed`): no event is made while the
  call streams, and the store keeps the reply as data (`RecordedReply`), whose events — the ones
  a miss read as events stores (`_cache_record.model_tap`) — are made when they are first read;
* a hit hands the recorded reply to the builder as those parts (`Hit`), as its replayed events
  would hand it, and makes no event."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, overload

from ..._stream.operators import Maps, MapSource, Recovery, aclose, aclosing, apply_maps, iterate, maps_of
from ..._trusted import shape
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
)
from ...message import ChatUsage, new_id
from ._cache_record import model_tap, replay

if TYPE_CHECKING:
    from ..._replies import ReplyParts
    from ...stream import EventStream

__all__ = ["Hit", "Missed", "RecordedReply"]


class _Recording:
    """The reply a model call read with no events hands its parts to (`_replies.ReplyParts`), for
    a miss (`Missed.building`): each part handed on to the consumer's ``reply`` and kept as a
    tuple; at the end of a complete call (no ``error``, not ``discarded``), the reply is stored as
    a `RecordedReply`, whose events are the ones `model_tap` stores for a miss read as events. A
    retry's next attempt inside starts the recording over (`begin`).

    The events a `RecordedReply` makes, in the order `PartsManager` makes them: a block's Start
    before its first part; a text block ends at the next part that is not its own (thinking, a
    tool call) or at the end; a thinking block at its signature (its End's part, a block of a
    signature alone included); the tool calls, all at the end (a call a provider ended early by
    reusing its index for the next one is recorded as ending there too: the parts do not carry
    the index)."""

    __slots__ = ("key", "model", "parts", "reply", "reply_id", "store", "ttl")

    model: str  # (set by `begin`, which comes first)
    parts: list[tuple[Any, ...]]

    def __init__(self, reply: ReplyParts, store: Any, key: str, ttl: float | None, reply_id: str) -> None:
        self.reply = reply
        self.store = store
        self.key = key
        self.ttl = ttl
        self.reply_id = reply_id

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
            self.store.set_nowait(self.key, RecordedReply(self.parts, self.model, usage, finish_reason, self.reply_id),
                                  self.ttl)
        self.parts = []
        self.reply.end(usage, finish_reason, discarded, error)


class Missed(MapSource):
    """A miss's stream factory in a run, for a store that answers at once: subscribed, the inner
    stream with `model_tap` fused (each subscription records its own); read with no events
    (`building`), a `_Recording` of its own is the reply the inner call hands its parts to (not
    this factory: the source inside may hold its reply, and a reply holding that source would
    make a cycle). It only subscribes the stream built inside the hook (``inner``): `context_free`."""

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
        recorder = _Recording(reply, self.store, self.key, self.ttl, self.reply_id)
        if factory.quiet_building():
            # The subscription yields nothing of its own but what ``recovery`` resumes with (a
            # retry's next attempt read as events): only those need recording as events. (A
            # budget's refusal after a cut is no reply: the recording stores nothing for it.)
            if recovery is not None:
                recovery = (recovery[0], recovery[1], partial(_tapped, recovery[2], recorder))
            return factory.building(recorder, alone, recovery)
        it = factory.building(recorder, alone, recovery)
        return None if it is None else _Tapping(it, recorder)


async def _tapped(resume: Callable[[Exception], AsyncIterator[Any]], miss: _Recording,
                  error: Exception) -> AsyncIterator[Any]:
    """What a recovery resumes a miss read with no events with (`Missed.building`), recorded as
    `Missed.with_maps` records it."""
    tap = model_tap(miss.store, miss.key, miss.ttl)
    async with aclosing(resume(error)) as it:
        async for ev in it:
            yield tap(ev)


class _Tapping:
    """A miss read with no events (`Missed.building`) through a source other than the model
    call's own: what it still yields (an attempt of a retry inside that is read as events)
    recorded as `Missed.with_maps` records it, by a `model_tap` made at the first such event. An
    iterator rather than an async generator: most calls yield nothing, and this one asks the
    loop for nothing when it starts."""

    __slots__ = ("__weakref__", "it", "miss", "tap")

    def __init__(self, it: AsyncIterator[Any], miss: _Recording) -> None:
        self.it = it
        self.miss = miss
        self.tap: Callable[[Any], Any] | None = None

    def __aiter__(self) -> _Tapping:
        return self

    async def __anext__(self) -> Any:
        ev = await self.it.__anext__()
        tap = self.tap
        if tap is None:
            miss = self.miss
            tap = self.tap = model_tap(miss.store, miss.key, miss.ttl)
        return tap(ev)

    async def aclose(self) -> None:
        await aclose(self.it)


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


class RecordedReply(Sequence[AgentEvent]):
    """A complete reply recorded from its parts (`Missed`), as a store that answers at
    once keeps it: the events the reply would have made (`Missed` says in which order),
    made when they are first read (a hit's replay, a store that encodes them), once. A miss that
    is never hit makes none."""

    __slots__ = ("events", "finish_reason", "model", "parts", "reply_id", "usage")

    def __init__(self, parts: list[tuple[Any, ...]], model: str, usage: ChatUsage | None,
                 finish_reason: str | None, reply_id: str) -> None:
        self.parts = parts
        self.model = model
        self.usage = usage
        self.finish_reason = finish_reason
        self.reply_id = reply_id
        self.events: tuple[AgentEvent, ...] | None = None

    def __len__(self) -> int:
        return len(self._made())

    @overload
    def __getitem__(self, index: int) -> AgentEvent: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[AgentEvent, ...]: ...
    def __getitem__(self, index: int | slice) -> AgentEvent | tuple[AgentEvent, ...]:
        return self._made()[index]

    def __iter__(self) -> Iterator[AgentEvent]:
        return iter(self._made())

    def _made(self) -> tuple[AgentEvent, ...]:
        events = self.events
        if events is None:
            events = self.events = self._events()
        return events

    def _events(self) -> tuple[AgentEvent, ...]:
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
        put(_END.build(reply_id=rid, usage=self.usage, finish_reason=self.finish_reason, model=self.model))
        return tuple(out)


class Hit(MapSource):
    """A hit's stream factory: subscribed, the recorded events replayed (`_cache_record.replay`,
    with the reply id ``reply_id()`` gives then); read with no events (`building`), the recorded
    reply handed to the builder as the parts the replayed events would hand it — the same blocks,
    fresh tool-call ids, ``usage=ChatUsage()`` — with no event made. A recording with events a
    builder reads otherwise (an inner middleware's, a sub-agent's) is replayed as events. It
    subscribes nothing: `context_free`."""

    __slots__ = ("recorded", "reply_id")

    context_free = True

    def __init__(self, recorded: Sequence[AgentEvent], reply_id: Callable[[], str]) -> None:
        self.recorded = recorded
        self.reply_id = reply_id

    def with_maps(self, maps: Maps) -> AsyncIterator[Any]:
        it = iterate(replay(self.recorded, self.reply_id()))
        return apply_maps(it, maps) if maps else it

    def building(
        self, reply: ReplyParts, alone: Callable[[], bool], recovery: Recovery | None = None,
    ) -> AsyncIterator[Any] | None:
        recorded = self.recorded
        if type(recorded) is not RecordedReply and not all(
                type(ev) in _PLAIN and ev.source is None for ev in recorded):
            return None
        return _handed(recorded, reply)


_PLAIN = frozenset({ModelCallStart, ModelCallEnd, TextBlockStart, TextBlockDelta, TextBlockEnd, ThinkingBlockStart,
                    ThinkingBlockDelta, ThinkingBlockEnd, ToolCallStart, ToolCallDelta, ToolCallEnd})
"""The events a model call's own reply is made of (`PartsManager`'s): a recording of only these
is handed to a builder as parts."""


async def _handed(recorded: Sequence[AgentEvent], reply: ReplyParts) -> AsyncIterator[Any]:
    """`Hit.building`'s subscription: the parts handed to ``reply`` when it is read; no item."""
    if type(recorded) is RecordedReply:
        _hand_parts(recorded, reply)
    else:
        _hand_events(recorded, reply)
    return
    yield  # (an async generator that yields nothing)


def _hand_parts(recorded: RecordedReply, reply: ReplyParts) -> None:
    ids: dict[str, str] = {}  # recorded block and call id -> fresh one (as `replay` gives them)
    reply.begin(recorded.model)
    for part in recorded.parts:
        kind, key = part[0], part[1]
        fresh = ids.get(key) or ids.setdefault(key, new_id("call_" if kind == _CALL_PART else "blk_"))
        if kind == _TEXT_PART:
            reply.text(fresh, part[2])
        elif kind == _THINKING_PART:
            reply.thinking(fresh, part[2])
        elif kind == _SIGNED_PART:
            reply.signed(fresh, part[2])
        else:
            reply.tool_call(fresh, part[2], part[3])
    reply.end(ChatUsage(), recorded.finish_reason, False)


def _hand_events(recorded: Sequence[AgentEvent], reply: ReplyParts) -> None:
    ids: dict[str, str] = {}
    for ev in recorded:
        fields = ev.__dict__
        cls = type(ev)
        if cls is TextBlockDelta or cls is ThinkingBlockDelta or cls is ThinkingBlockEnd:
            key = fields["block_id"]
            fresh = ids.get(key) or ids.setdefault(key, new_id("blk_"))
            if cls is TextBlockDelta:
                reply.text(fresh, fields["delta"])
            elif cls is ThinkingBlockDelta:
                reply.thinking(fresh, fields["delta"])
            else:
                reply.signed(fresh, fields["signature"])
        elif cls is ToolCallStart or cls is ToolCallDelta:
            key = fields["tool_call_id"]
            fresh = ids.get(key) or ids.setdefault(key, new_id("call_"))
            reply.tool_call(fresh, fields["tool_name"], fields["delta"] if cls is ToolCallDelta else None)
        elif cls is ModelCallStart:
            reply.begin(fields["model"])
        elif cls is ModelCallEnd:
            reply.end(ChatUsage(), fields["finish_reason"], False)
