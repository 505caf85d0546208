"""Recording a miss and replaying a hit, for `cache`'s middleware (see its docstring).

A miss is recorded from its events as they pass (`model_tap`, `ModelRecorder`), or, in a run
whose events nobody reads, from the parts its model call hands to the loop's builder
(`_parts_record`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from ..._trusted import Shape, shape
from ...events import AgentEvent, ModelCallEnd, ModelCallStart, ToolResultEnd, ToolResultStart
from ...message import ChatUsage, ToolResultState, ToolUseBlock, new_id

if TYPE_CHECKING:
    from ..._context import RuntimeContext

__all__ = ["HIT", "REPLY", "ModelRecorder", "ToolRecorder", "model_tap", "replay"]

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


