"""`PartsManager`: a model's chunks become the typed block events of its reply, and the per-token
work of the runtime lives here (with `delta_maker`, the delta events' constructor).

Everywhere else the runtime is written plainly and builds its events with pydantic's validating
constructors; what runs once per streamed token is here, and why it is shaped as it is is said in
`PartsManager`'s docstring, in one place.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from ._bracket_kinds import describe
from ._sanitize import SurrogateCarry, clean
from .events import (
    EventBase,
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
    ToolResultTextDelta,
)
from .message import ChatUsage, id_factory, new_id

if TYPE_CHECKING:
    from ._stream.channel import Channel
    from .model.base import ChatChunk, ToolCallChunk

__all__ = ["PartsManager", "delta_maker"]


class PartsManager:
    """The parts of one model call's reply as it streams: which text, thinking and tool-call
    blocks are open (their ids, their delta makers), the thinking signature, the usage and the
    finish reason; `run` turns each `ChatChunk` into the block events (Start, Delta, End) and
    puts them into the model call's channel (called by `model_events`, in the model call's task).

    One text or thinking block is open at a time: text after thinking ends the thinking block,
    and the reverse; a tool call ends both. Tool calls are keyed by the provider's index (a new id
    at a known index ends the call there and opens a new one). `end` closes whatever is open and
    puts ModelCallEnd; `fail` does the same with the error, so every Start has its End. The reply
    itself (the message memory keeps) is rebuilt from the events after the ``on_model_call``
    layers (`_replies.ReplyBuilder`), since middleware may rewrite them.

    What runs once per streamed token, and why it is shaped so:

    * **A delta crosses the task boundary as its ``str``.** A text or thinking delta goes into the
      channel as ``(make, text)`` (a `Deferred`), not as an event; the prefetch's drain calls
      ``make(text)`` in the consumer's task (`_stream.concurrent.Prefetch`, ``deferred``). A
      consumer slower than the model (a loaded server) then buffers strings, and each event lives
      only from its making to its use.
    * **Delta events are made without validating** (`delta_maker`): the object the validating
      constructor gives (the same ``__dict__`` in the same order, the same ``model_fields_set``,
      no extras, no private attributes; `tests/test_events.py` compares them) at ~0.6× its cost.
      Safe because only values the runtime made itself go in: ids it generated or read from
      typed events, and text that arrived as ``str``. A delta class that gains a validator,
      extras or private attributes fails at import instead of silently skipping them.
    * **A block's maker is a `functools.partial`** of one module-level function over a template
      dict, not a closure: a maker lives as long as its block streams, and a served process holds
      thousands of blocks open, each a few objects for the garbage collector to walk instead of a
      dozen cells.
    * **Text passes as it came**, except that a surrogate pair split across two chunks is joined
      and a lone half replaced (`_sanitize.SurrogateCarry`): the carry is made only for a block
      that meets non-ASCII text, and ASCII text is one flag test.
    * **The hand-off costs no call per event**: the events are appended to the channel
      (`Channel.append`, the list's own ``append``), and `Channel.flush` is called once per
      chunk, after all the chunk's events are in, and only when it has something to do (the
      consumer waits, or the channel is full: then the producer awaits `Channel.room`); `run`
      reads the channel's fields to tell, and only the channel writes them. `run` is one
      coroutine for the whole stream, not a call per chunk. On the other side the prefetch
      drains the channel in its own loop, where the deferred pairs are made and the fused maps
      of every ``on_model_call`` layer run (`_stream.concurrent`, `_stream.operators.MapSource`):
      no generator between the channel and the maps.
    """

    __slots__ = (
        "calls", "finish", "model", "put", "reply_id", "signature", "text_carry", "text_id", "text_make",
        "thinking_carry", "thinking_id", "thinking_make", "usage",
    )

    def __init__(self, reply_id: str, model: str, out: Channel) -> None:
        self.reply_id = reply_id
        self.model = model
        self.put: Callable[[Any], None] = out.append
        self.text_id: str | None = None
        self.text_make: Callable[[str], TextBlockDelta] | None = None
        self.text_carry: SurrogateCarry | None = None
        self.thinking_id: str | None = None
        self.thinking_make: Callable[[str], ThinkingBlockDelta] | None = None
        self.thinking_carry: SurrogateCarry | None = None
        self.signature: str | None = None
        # provider index -> (id, name, delta maker): the open tool calls, in order
        self.calls: dict[int, tuple[str, str, Callable[[str], ToolCallDelta]]] = {}
        self.usage: ChatUsage | None = None
        self.finish: str | None = None
        self.put(ModelCallStart(reply_id=reply_id, model=model))

    async def run(self, chunk: ChatChunk | None, chunks: AsyncIterator[ChatChunk], out: Channel) -> None:
        """Put the events of ``chunk`` and of the rest of ``chunks``, chunk by chunk into ``out``,
        then `end`. The common chunk (a text delta in an open block) is handled in this loop; the
        rest (a block opening or closing, thinking, a tool call) in methods."""
        put, items, size = self.put, out.items, out.size
        while chunk is not None:
            # A signature alone opens its block too: reasoning a provider keeps opaque (an
            # encrypted Responses reasoning item without a summary) still has to be carried.
            if chunk.thinking or chunk.thinking_signature:
                self._thinking(chunk.thinking, chunk.thinking_signature)
            text = chunk.text
            if text:
                if self.text_id is None:
                    self._open_text()
                if not text.isascii():
                    text = self._text_carry().feed(text)
                if text:
                    put((self.text_make, text))
            if chunk.tool_call is not None:
                self._tool_call(chunk.tool_call)
            if chunk.usage is not None:
                self.usage = chunk.usage  # providers report cumulative usage: the last one wins
            if chunk.finish_reason is not None:
                self.finish = chunk.finish_reason
            if (out.waiter is not None or len(items) >= size) and out.flush():
                await out.room()
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                chunk = None
        self.end()

    def end(self) -> None:
        """The stream completed: close the open blocks, then ModelCallEnd."""
        self._end_thinking()
        self._end_text()
        self._end_calls()
        self.put(ModelCallEnd(reply_id=self.reply_id, usage=self.usage, finish_reason=self.finish,
                              model=self.model))

    def fail(self, error: BaseException, interrupted: bool) -> None:
        """The stream failed with ``error``: close the open blocks, then a ModelCallEnd that says
        why (``discarded`` unless it was interrupted). What a carry holds is dropped with the
        reply, and nothing waits for room: after a cancellation nobody may be reading, and the
        consumer takes these before it sees the error."""
        put, reply_id = self.put, self.reply_id
        if self.thinking_id is not None:
            put(ThinkingBlockEnd(reply_id=reply_id, block_id=self.thinking_id, signature=self.signature))
        if self.text_id is not None:
            put(TextBlockEnd(reply_id=reply_id, block_id=self.text_id))
        self._end_calls()
        put(ModelCallEnd(reply_id=reply_id, usage=self.usage, error=describe(error), discarded=not interrupted,
                         model=self.model))

    def _thinking(self, thinking: str | None, signature: str | None) -> None:
        if self.thinking_id is None:
            self._end_text()
            self.thinking_id = block_id = new_id("blk_")
            self.thinking_make = delta_maker(ThinkingBlockDelta, reply_id=self.reply_id, block_id=block_id)
            self.put(ThinkingBlockStart(reply_id=self.reply_id, block_id=block_id))
        if thinking:
            if not thinking.isascii():
                self.thinking_carry = self.thinking_carry or SurrogateCarry()
                thinking = self.thinking_carry.feed(thinking)
            if thinking:
                self.put((self.thinking_make, thinking))
        if signature:
            self.signature = (self.signature or "") + signature

    def _open_text(self) -> None:
        self._end_thinking()
        self.text_id = block_id = new_id("blk_")
        self.text_make = delta_maker(TextBlockDelta, reply_id=self.reply_id, block_id=block_id)
        self.put(TextBlockStart(reply_id=self.reply_id, block_id=block_id))

    def _text_carry(self) -> SurrogateCarry:
        if self.text_carry is None:
            self.text_carry = SurrogateCarry()
        return self.text_carry

    def _tool_call(self, tc: ToolCallChunk) -> None:
        self._end_thinking()
        self._end_text()
        known = self.calls.get(tc.index)
        if known is None or (tc.id is not None and tc.id != known[0]):
            if known is not None:  # a provider reusing an index for a new call
                self.put(ToolCallEnd(reply_id=self.reply_id, tool_call_id=known[0], tool_name=known[1]))
            call_id, name = tc.id or new_id("call_"), tc.name or ""
            make = delta_maker(ToolCallDelta, reply_id=self.reply_id, tool_call_id=call_id, tool_name=name)
            known = self.calls[tc.index] = (call_id, name, make)
            self.put(ToolCallStart(reply_id=self.reply_id, tool_call_id=call_id, tool_name=name))
        if tc.arguments:
            self.put(known[2](clean(tc.arguments)))

    def _end_text(self) -> None:
        if self.text_id is None:
            return
        if self.text_carry is not None and self.text_carry.held:
            self.put((self.text_make, self.text_carry.flush()))
        self.put(TextBlockEnd(reply_id=self.reply_id, block_id=self.text_id))
        self.text_id = None

    def _end_thinking(self) -> None:
        if self.thinking_id is None:
            return
        if self.thinking_carry is not None and self.thinking_carry.held:
            self.put((self.thinking_make, self.thinking_carry.flush()))
        self.put(ThinkingBlockEnd(reply_id=self.reply_id, block_id=self.thinking_id, signature=self.signature))
        self.thinking_id, self.signature = None, None

    def _end_calls(self) -> None:
        for call_id, name, _ in self.calls.values():
            self.put(ToolCallEnd(reply_id=self.reply_id, tool_call_id=call_id, tool_name=name))


# -- the delta events' constructor ----------------------------------------------------------------

_D = TypeVar("_D", TextBlockDelta, ThinkingBlockDelta, ToolCallDelta, ToolResultTextDelta)

_new = object.__new__
_set = object.__setattr__
# pydantic's own slots of a model, set through their descriptors (what ``__copy__`` sets too)
_set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__
_event_id = id_factory("ev_")  # what EventBase's id field defaults to
_now = time.time


class _Kind:
    """What every delta of one class shares: its field order (a validated sample's) and the
    fields an ordinary construction sets."""

    __slots__ = ("bound", "cls", "fields_set", "names", "template")

    def __init__(self, cls: type[EventBase], **sample: str) -> None:
        decorators = cls.__pydantic_decorators__
        if (decorators.field_validators or decorators.model_validators or cls.__private_attributes__
                or cls.model_config.get("extra") not in (None, "ignore")):
            raise TypeError(f"{cls.__name__} needs validation: build it with its constructor")
        made = cls.model_validate({**sample, "delta": ""})
        self.cls = cls
        self.bound = tuple(sample)
        self.names = frozenset(sample)
        self.template: dict[str, Any] = dict(made.__dict__)
        self.fields_set = made.__pydantic_fields_set__


_KINDS: dict[type[EventBase], _Kind] = {
    TextBlockDelta: _Kind(TextBlockDelta, reply_id="", block_id=""),
    ThinkingBlockDelta: _Kind(ThinkingBlockDelta, reply_id="", block_id=""),
    ToolCallDelta: _Kind(ToolCallDelta, reply_id="", tool_call_id="", tool_name=""),
    ToolResultTextDelta: _Kind(ToolResultTextDelta, reply_id="", tool_call_id="", tool_name=""),
}


def delta_maker(cls: type[_D], **bound: Any) -> Callable[[str], _D]:
    """``delta_maker(C, **ids)(text)`` gives the event ``C(**ids, delta=text)`` gives (a fresh
    ``id``, ``created_at`` and ``metadata`` each), without validating (see `PartsManager`). ``ids``:
    every field of ``C`` but ``delta`` (``reply_id`` and ``block_id``, or ``reply_id``,
    ``tool_call_id`` and ``tool_name``); only for values the runtime made itself. Ids that are not
    exactly ``str`` (a provider's tool name of another type) get a maker that validates."""
    kind = _KINDS[cls]
    if bound.keys() != kind.names:
        raise TypeError(f"delta_maker({cls.__name__}) takes {', '.join(kind.bound)}")
    if any(type(value) is not str for value in bound.values()):
        return lambda delta: cls.model_validate({**bound, "delta": delta})
    return partial(_make, cls, {**kind.template, **bound}, kind.fields_set)


def _make(cls: type[_D], template: dict[str, Any], fields_set: set[str], delta: str) -> _D:
    values = template.copy()
    values["id"] = _event_id()
    values["created_at"] = _now()
    values["metadata"] = {}
    values["delta"] = delta
    event: _D = _new(cls)
    _set(event, "__dict__", values)
    _set_fields_set(event, fields_set)
    _set_extra(event, None)
    _set_private(event, None)
    return event
