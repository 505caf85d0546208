"""`PartsManager`: a model's chunks become the typed block events of its reply, and the per-token
work of the runtime lives here (with `_trusted.Trusted`, which builds the delta events).

Everywhere else the runtime is written plainly; what runs once per streamed token is here, and why
it is shaped as it is is said in `PartsManager`'s docstring, in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._bracket_kinds import describe
from ._sanitize import SurrogateCarry, clean
from ._trusted import delta_maker, delta_shape, shape
from .errors import MalformedStreamError
from .events import (
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
from .message import ChatUsage, new_id

if TYPE_CHECKING:
    from ._replies import ReplyParts
    from .model.base import ChatChunk, ToolCallChunk

__all__ = ["PartsManager", "delta_maker"]


# The brackets of a model call and of its blocks, built from the reply id, the model's name and
# ids as `PartsManager` holds them: exact ``str`` (a value of another type is validated once, by the
# call's or the tool call's Start, and the events after it take the Start's values).
_MODEL_START = shape(ModelCallStart, "reply_id", "model")
_MODEL_END = shape(ModelCallEnd, "reply_id", "usage", "finish_reason", "model")
_TEXT_START = shape(TextBlockStart, "reply_id", "block_id")
_TEXT_END = shape(TextBlockEnd, "reply_id", "block_id")
_CALL_START = shape(ToolCallStart, "reply_id", "tool_call_id", "tool_name")
_CALL_END = shape(ToolCallEnd, "reply_id", "tool_call_id", "tool_name")
# Each block's delta maker, from the same ids
_TEXT_DELTA = delta_shape(TextBlockDelta)
_THINKING_DELTA = delta_shape(ThinkingBlockDelta)
_CALL_DELTA = delta_shape(ToolCallDelta)


def _cleaned(value: Any) -> Any:
    return clean(value) if type(value) is str else value


def _no_block(text: str) -> Any:
    raise AssertionError("a delta with no open block")


class PartsManager:
    """The parts of one model call's reply as it streams: which text, thinking and tool-call
    blocks are open (their ids, their delta makers), the thinking signature, the usage and the
    finish reason; `feed` turns each `ChatChunk` into the block events (Start, Delta, End) and
    appends them to ``out``, which the model call's generator (`_model_call.model_events`) hands
    to its consumer, chunk by chunk, in the consumer's task.

    With ``reply`` (a `ReplyBuilder`, or a layer that meters the parts on their way to one:
    `_replies.ReplyParts`), no hook reads the call's events before the loop that
    builds the reply from them, so what the events would carry to the builder — each delta under
    its block's id, each tool call's name and arguments, the usage, the finish reason, whether
    the reply is kept — is handed to it directly, as each part is made. ``events`` says whether
    the events are made too: not when the builder would be their only reader (a ``call()`` that
    nothing observes: ``out`` stays empty), yes when they are published (a ``stream()``: the
    loop then passes them on and hands none of them to the builder). The ids of blocks and calls
    are made as they would be, and a provider's values of another type are validated by the
    event they would have gone into, so the reply is the one the events would have built.

    One text or thinking block is open at a time: text after thinking ends the thinking block,
    and the reverse; a tool call ends both. Tool calls are keyed by the provider's index (a new id
    at a known index ends the call there and opens a new one; an id the reply already gave another
    call is a `MalformedStreamError`). `end` closes whatever is open and appends ModelCallEnd;
    `fail` does the same with the error, so every Start has its End. The
    reply itself (the message memory keeps) is rebuilt from the events after the
    ``on_model_call`` layers (`_replies.ReplyBuilder`), since middleware may rewrite them.

    What runs once per streamed token, and why it is shaped so:

    * **Delta events are made without validating** (`delta_shape`, `_trusted.Trusted`): the
      object the validating constructor gives (the same ``__dict__`` in the same order, the same
      ``model_fields_set``, no extras, no private attributes; `tests/test_events.py` compares
      them) at ~0.6× its cost. Safe because only values the runtime made itself go in: ids it
      generated or read from typed events, and text that arrived as ``str``. A block's maker is a
      `functools.partial` over a template dict, not a closure (see `Trusted`).
    * **Text passes as it came**, except that a surrogate pair split across two chunks is joined
      and a lone half replaced (`_sanitize.SurrogateCarry`): the carry is made only for a block
      that meets non-ASCII text, and ASCII text is one flag test.
    * **The common chunk is handled in `feed` itself** (a text delta in an open block: one event
      made and appended); the rest (a block opening or closing, thinking, a tool call) in methods.
    """

    __slots__ = (
        "call_ids", "calls", "events", "finish", "model", "out", "put", "reply", "reply_id", "signature", "text_carry",
        "text_id", "text_make", "thinking_carry", "thinking_id", "thinking_make", "usage",
    )

    def __init__(self, reply_id: str, model: str, reply: ReplyParts | None = None, events: bool = False) -> None:
        events = events or reply is None
        if type(reply_id) is str and type(model) is str:
            start = _MODEL_START.build(reply_id=reply_id, model=model) if events else None
        else:  # (a model's name of another type, a reply id from elsewhere)
            start = ModelCallStart(reply_id=reply_id, model=model)
            reply_id, model = start.reply_id, start.model
        self.reply_id = reply_id
        self.model = model
        self.reply = reply
        self.events = events
        self.out: list[Any] = []
        """The events of the chunk fed last (the consumer takes them and clears the list)."""
        self.put: Callable[[Any], None] = self.out.append
        self.text_id: str | None = None
        # A block's delta maker, read only while the block is open (its id set)
        self.text_make: Callable[[str], TextBlockDelta] = _no_block
        self.text_carry: SurrogateCarry | None = None
        self.thinking_id: str | None = None
        self.thinking_make: Callable[[str], ThinkingBlockDelta] = _no_block
        self.thinking_carry: SurrogateCarry | None = None
        self.signature: str | None = None
        # provider index -> (id, name, delta maker): the open tool calls, in order
        self.calls: dict[int, tuple[str, str, Callable[[str], ToolCallDelta]]] = {}
        self.call_ids: set[str] = set()  # every call id this reply started, ended ones too
        self.usage: ChatUsage | None = None
        self.finish: str | None = None
        if events:
            self.put(start)
        if reply is not None:
            reply.begin(model)

    def feed(self, chunk: ChatChunk) -> None:
        """Append the events of ``chunk`` to ``out`` and hand its parts to ``reply`` (either or both)."""
        # A signature alone opens its block too: reasoning a provider keeps opaque (an encrypted
        # Responses reasoning item without a summary) still has to be carried.
        if chunk.thinking or chunk.thinking_signature:
            self._thinking(chunk.thinking, chunk.thinking_signature)
        text = chunk.text
        if text:
            block_id = self.text_id
            if block_id is None:
                block_id = self._open_text()
            if not text.isascii():
                text = self._text_carry().feed(text)
            if text:
                if self.events:
                    self.put(self.text_make(text))
                if self.reply is not None:
                    self.reply.text(block_id, text)
        if chunk.tool_call is not None:
            self._tool_call(chunk.tool_call)
        if chunk.usage is not None:
            self.usage = chunk.usage  # providers report cumulative usage: the last one wins
        if chunk.finish_reason is not None:
            self.finish = chunk.finish_reason

    def end(self) -> None:
        """The stream completed: close the open blocks, then ModelCallEnd."""
        self._end_thinking()
        self._end_text()
        self._end_calls()
        usage, finish = self.usage, self.finish
        # The provider's usage and finish reason: validated unless already a `ChatUsage` and a ``str``
        typed = (usage is None or type(usage) is ChatUsage) and (finish is None or type(finish) is str)
        reply = self.reply
        if reply is not None and typed and not self.events:
            reply.end(usage, finish, False)
            return
        if typed:
            end = _MODEL_END.build(reply_id=self.reply_id, usage=usage, finish_reason=finish, model=self.model)
        else:  # (the reply takes the values as the validated end holds them)
            end = _MODEL_END.validated(reply_id=self.reply_id, usage=usage, finish_reason=finish, model=self.model)
            usage, finish = end.usage, end.finish_reason
        if self.events:
            self.put(end)
        if reply is not None:
            reply.end(usage, finish, False)

    def fail(self, error: BaseException, interrupted: bool) -> None:
        """The stream failed with ``error``: close the open blocks, then a ModelCallEnd that says
        why (``discarded`` unless it was interrupted). What a carry holds is dropped with the
        reply; the consumer takes these before it sees the error."""
        reply, reply_id = self.reply, self.reply_id
        if reply is not None:
            if self.thinking_id is not None:
                reply.signed(self.thinking_id, self.signature)
            reply.end(self.usage_read(), None, not interrupted, describe(error))
        if not self.events:
            return
        put = self.put
        if self.thinking_id is not None:
            put(ThinkingBlockEnd(reply_id=reply_id, block_id=self.thinking_id, signature=self.signature))
        if self.text_id is not None:
            put(_TEXT_END.build(reply_id=reply_id, block_id=self.text_id))
        self._end_calls()
        put(ModelCallEnd(reply_id=reply_id, usage=self.usage, error=describe(error), discarded=not interrupted,
                         model=self.model))

    def usage_read(self) -> ChatUsage | None:
        """The usage the provider reported so far, validated as ModelCallEnd validates it."""
        usage = self.usage
        if usage is not None and type(usage) is not ChatUsage:
            usage = ModelCallEnd(reply_id=self.reply_id, usage=usage, model=self.model).usage
        return usage

    def _thinking(self, thinking: str | None, signature: str | None) -> None:
        block_id = self.thinking_id
        if block_id is None:
            self._end_text()
            self.thinking_id = block_id = new_id("blk_")
            if self.events:
                self.thinking_make = _THINKING_DELTA.maker(reply_id=self.reply_id, block_id=block_id)
                self.put(ThinkingBlockStart(reply_id=self.reply_id, block_id=block_id))
        if thinking:
            if not thinking.isascii():
                self.thinking_carry = self.thinking_carry or SurrogateCarry()
                thinking = self.thinking_carry.feed(thinking)
            if thinking:
                self._thought(block_id, thinking)
        if signature:
            # (cleaned: the signature goes back to the provider with the reply)
            self.signature = (self.signature or "") + clean(signature)

    def _thought(self, block_id: str, thinking: str) -> None:
        if self.events:
            self.put(self.thinking_make(thinking))
        if self.reply is not None:
            self.reply.thinking(block_id, thinking)

    def _open_text(self) -> str:
        self._end_thinking()
        self.text_id = block_id = new_id("blk_")
        if self.events:
            self.text_make = _TEXT_DELTA.maker(reply_id=self.reply_id, block_id=block_id)
            self.put(_TEXT_START.build(reply_id=self.reply_id, block_id=block_id))
        return block_id

    def _text_carry(self) -> SurrogateCarry:
        if self.text_carry is None:
            self.text_carry = SurrogateCarry()
        return self.text_carry

    def _tool_call(self, tc: ToolCallChunk) -> None:
        self._end_thinking()
        self._end_text()
        reply, events = self.reply, self.events
        known = self.calls.get(tc.index)
        # (a known call's id is kept cleaned: one with a lone surrogate is compared so)
        if known is None or (tc.id is not None and tc.id != known[0] and _cleaned(tc.id) != known[0]):
            call_id, name = tc.id or new_id("call_"), tc.name or ""
            if type(call_id) is str and type(name) is str:
                # Both go back to the provider with the reply: a lone surrogate could not be sent.
                call_id, name = clean(call_id), clean(name)
                start = (_CALL_START.build(reply_id=self.reply_id, tool_call_id=call_id, tool_name=name) if events
                         else None)
            else:  # a provider's id or name of another type
                start = ToolCallStart(reply_id=self.reply_id, tool_call_id=call_id, tool_name=name)
                call_id, name = start.tool_call_id, start.tool_name
            if call_id in self.call_ids:
                # Two calls of one id: the tool would run twice, its results could not be told
                # apart, and a Start would repeat. A provider's broken stream, not a new call.
                raise MalformedStreamError(f"{self.model}: malformed stream: the tool call id {call_id!r} names a "
                                           f"call this reply already made")
            self.call_ids.add(call_id)
            if known is not None and events:  # a provider reusing an index for a new call
                self.put(_CALL_END.build(reply_id=self.reply_id, tool_call_id=known[0], tool_name=known[1]))
            if events:
                make = _CALL_DELTA.maker(reply_id=self.reply_id, tool_call_id=call_id, tool_name=name)
                self.put(start)
            else:
                make = _no_block
            if reply is not None:
                reply.tool_call(call_id, name)
            known = self.calls[tc.index] = (call_id, name, make)
        if tc.arguments:
            arguments = clean(tc.arguments)
            if events:
                self.put(known[2](arguments))
            if reply is not None:
                reply.tool_call(known[0], known[1], arguments)

    def _end_text(self) -> None:
        block_id = self.text_id
        if block_id is None:
            return
        if self.text_carry is not None and self.text_carry.held:
            rest = self.text_carry.flush()
            if self.events:
                self.put(self.text_make(rest))
            if self.reply is not None:
                self.reply.text(block_id, rest)
        if self.events:
            self.put(_TEXT_END.build(reply_id=self.reply_id, block_id=block_id))
        self.text_id = None

    def _end_thinking(self) -> None:
        block_id = self.thinking_id
        if block_id is None:
            return
        if self.thinking_carry is not None and self.thinking_carry.held:
            self._thought(block_id, self.thinking_carry.flush())
        if self.events:
            self.put(ThinkingBlockEnd(reply_id=self.reply_id, block_id=block_id, signature=self.signature))
        if self.reply is not None:
            self.reply.signed(block_id, self.signature)
        self.thinking_id, self.signature = None, None

    def _end_calls(self) -> None:
        if not self.events:
            return
        for call_id, name, _ in self.calls.values():
            self.put(_CALL_END.build(reply_id=self.reply_id, tool_call_id=call_id, tool_name=name))
