"""Events back into messages: `ReplyBuilder` and `ToolResultCollector` rebuild the assistant
message and the tool results from the events that leave the model-call and acting chains, so what
a middleware rewrote there is what is remembered (the agent loop), or what is recorded as a model
call's output (the tracing middleware).

Internal API, below both the agent and the middleware.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from operator import itemgetter
from typing import Any, Literal, Protocol, cast

from ._sanitize import MAX_DEPTH, clean_value, depth_exceeds
from ._trusted import shape
from .errors import MiddlewareError
from .events import (
    AgentEvent,
    ToolResultEnd,
    ToolResultStart,
    ToolResultTextDelta,
)
from .message import (
    Block,
    ChatUsage,
    DataBlock,
    GenerateReason,
    Msg,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolResultState,
    ToolUseBlock,
)

__all__ = [
    "ReplyBuilder", "ReplyParts", "ToolResultCollector", "arguments_problem", "join_output", "result_end",
    "result_events", "result_of", "result_start", "result_text",
]

# The blocks and messages rebuilt here, each from the fields its site always gives.
_TEXT = shape(TextBlock, "text")
_THINKING = shape(ThinkingBlock, "thinking", "signature")
_TOOL_USE = shape(ToolUseBlock, "id", "name", "input")
_UNPARSED = shape(ToolUseBlock, "id", "name", "input", "raw_input")
_RESULT = shape(ToolResultBlock, "id", "name", "output", "state")
_REPLY = shape(Msg, "id", "name", "role", "content", "generate_reason", "usage")
# The events of a tool call's result the acting pass makes (`result_start`, `result_text`, `result_end`),
# with the tool's metadata on the brackets when it has some.
_RESULT_START = shape(ToolResultStart, "reply_id", "tool_call_id", "tool_name")
_RESULT_START_META = shape(ToolResultStart, "reply_id", "tool_call_id", "tool_name", "metadata")
_RESULT_TEXT = shape(ToolResultTextDelta, "reply_id", "tool_call_id", "tool_name", "delta")
_RESULT_END = shape(ToolResultEnd, "reply_id", "tool_call_id", "tool_name", "state")
_RESULT_END_META = shape(ToolResultEnd, "reply_id", "tool_call_id", "tool_name", "state", "metadata")


class ReplyParts(Protocol):
    """What a model call's reply is made of, in the order it streams, as a `PartsManager` hands it
    on when nobody reads the call's events: to a `ReplyBuilder`, or to a layer on its way there
    that meters the parts and hands them on (a budget: `MapSource.building`)."""

    def begin(self, model: str) -> None: ...
    def text(self, block_id: str, delta: str) -> None: ...
    def thinking(self, block_id: str, delta: str) -> None: ...
    def signed(self, block_id: str, signature: str | None) -> None: ...
    def tool_call(self, call_id: str, name: str, delta: str | None = None) -> None: ...
    def end(self, usage: ChatUsage | None, finish_reason: str | None, discarded: bool,
            error: str | None = None) -> None: ...


class ReplyBuilder:
    """Rebuilds the assistant message from block events (starting over at each ModelCallStart,
    so a retried or failed-over call leaves only its own reply, and dropping a call whose
    ModelCallEnd says ``discarded``: what follows it, such as a guardrail's refusal, is the reply)."""

    __slots__ = ("_blocks", "calls_made", "finish_reason", "usage", "usage_total")

    def __init__(self) -> None:
        self._blocks: dict[str, list[Any]] = {}  # block/call id -> [kind, parts, extra]
        self.usage: ChatUsage | None = None
        self.usage_total: ChatUsage | None = None  # None: no call of this builder reported usage
        self.finish_reason: str | None = None
        self.calls_made = 0

    def add(self, ev: Any) -> None:
        # A text delta (one per streamed token) goes straight to `text`; the rest by one look-up
        # of the type: about half of them (block starts and ends, tool call ends) change nothing.
        # Fields are read from the fields dict: an event's class has a __getattr__ (pydantic's),
        # so each attribute read takes the slow path.
        fields = ev.__dict__
        kind = fields["type"]
        if kind == "text_block_delta":
            self.text(fields["block_id"], fields["delta"])
            return
        handle = _ON_EVENT.get(kind)
        if handle is not None:
            handle(self, fields)

    # What a model call's reply is made of, in the order it streams: the event handlers below
    # (`_ON_EVENT`) take it from the events, and a `PartsManager` hands it here itself when nobody
    # reads the call's events (``PartsManager(reply=...)``), so a reply is built one way either way.

    def begin(self, model: str | None = None) -> None:
        """A model call (served by ``model``) starts: the reply starts over (a retried or
        failed-over call leaves only its own)."""
        self._blocks = {}
        self.usage = None
        self.finish_reason = None
        self.calls_made += 1

    def text(self, block_id: str, delta: str) -> None:
        entry = self._blocks.get(block_id)
        if entry is None:
            entry = self._blocks[block_id] = ["text", [], None]
        entry[1].append(delta)

    def thinking(self, block_id: str, delta: str) -> None:
        entry = self._blocks.get(block_id)
        if entry is None:
            entry = self._blocks[block_id] = ["thinking", [], None]
        entry[1].append(delta)

    def signed(self, block_id: str, signature: str | None) -> None:
        """A thinking block ends, with its signature."""
        self._blocks.setdefault(block_id, ["thinking", [], None])[2] = signature

    def tool_call(self, call_id: str, name: str, delta: str | None = None) -> None:
        """A tool call opens (no ``delta``) or its arguments grow by ``delta``."""
        entry = self._blocks.setdefault(call_id, ["tool", [], name])
        if delta is not None:
            entry[1].append(delta)

    def end(self, usage: ChatUsage | None, finish_reason: str | None, discarded: bool,
            error: str | None = None) -> None:
        """A model call ends; ``discarded``: its partial reply is not remembered. ``error``: why
        it failed (``ModelCallEnd.error``), for a layer on the way here that tells a failed call
        from a complete one (a cache records only complete ones); the reply does not keep it."""
        if discarded:
            self._blocks = {}
        self.usage = usage
        self.finish_reason = finish_reason
        if usage is not None:
            total = self.usage_total
            self.usage_total = usage if total is None else total + usage

    @property
    def produced(self) -> bool:
        """Whether any model call or block reached this builder (an empty stream did not)."""
        return self.calls_made > 0 or bool(self._blocks)

    @property
    def calls_tools(self) -> bool:
        """Whether the reply built so far has tool calls."""
        return "tool" in map(_KIND, self._blocks.values())

    def build(self, reply_id: str, name: str | None, reason: GenerateReason | None = None,
              usage: ChatUsage | Literal["last"] | None = "last") -> Msg:
        """The reply as a message; ``usage``: its usage (by default the last model call's).

        What it is built from left the model-call chain: events a middleware made (validated by
        their constructors) or derived with ``model_copy`` (not validated). So each value is
        checked for its field's exact type (the joined text is a ``str`` or a TypeError), and one
        that is not goes through the validating constructor, which names it."""
        content: list[Block] = []
        for key, (kind, parts, extra) in self._blocks.items():
            try:
                joined = "".join(parts)
            except TypeError:
                raise _bad_delta(kind, parts) from None
            if kind == "text":
                content.append(_TEXT.build(text=joined))
            elif kind == "thinking":
                thinking = _THINKING.build if extra is None or type(extra) is str else _THINKING.validated
                content.append(thinking(thinking=joined, signature=extra))
            else:
                content.append(tool_use_block(key, extra or "", joined))
        if type(usage) is str:  # ("last")
            usage = self.usage
        typed = ((usage is None or type(usage) is ChatUsage) and (name is None or type(name) is str)
                 and (reason is None or type(reason) is GenerateReason))
        make = _REPLY.build if typed else _REPLY.validated
        return make(id=reply_id, name=name, role="assistant", content=content, generate_reason=reason, usage=usage)


_KIND = itemgetter(0)
"""The kind of a `ReplyBuilder` entry (``"text"``, ``"thinking"`` or ``"tool"``)."""

_ON_EVENT: dict[str, Callable[[ReplyBuilder, dict[str, Any]], None]] = {
    "thinking_block_delta": lambda b, f: b.thinking(f["block_id"], f["delta"]),
    "thinking_block_end": lambda b, f: b.signed(f["block_id"], f["signature"]),
    "tool_call_start": lambda b, f: b.tool_call(f["tool_call_id"], f["tool_name"]),
    "tool_call_delta": lambda b, f: b.tool_call(f["tool_call_id"], f["tool_name"], f["delta"]),
    "model_call_start": lambda b, f: b.begin(),
    "model_call_end": lambda b, f: b.end(f["usage"], f["finish_reason"], f["discarded"]),
}
"""What each event type that shapes the reply does to the builder, but the text delta (`add`);
the other types change nothing."""


def _bad_delta(kind: str, parts: list[Any]) -> MiddlewareError:
    wrong = next(p for p in parts if not isinstance(p, str))
    what = "tool call" if kind == "tool" else f"{kind} block"
    return MiddlewareError(
        f"a {what} delta is {type(wrong).__name__} ({wrong!r}), not str: a middleware at on_model_call or "
        "on_reasoning rewrote it (deltas must stay strings; use \"\" to drop the text)"
    )


def tool_use_block(call_id: str, name: str, raw: str) -> ToolUseBlock:
    # The id and name come from a tool call's events (see `ReplyBuilder.build`); the input is a
    # dict json.loads made, with str keys.
    typed = type(call_id) is str and type(name) is str
    make = _TOOL_USE.build if typed else _TOOL_USE.validated
    if not raw.strip():
        return make(id=call_id, name=name, input={})
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # (nested a few thousand deep: the parser's own limit)
        value = None  # (kept as text, as what is no JSON object is)
    if not isinstance(value, dict) or (raw.count("{") + raw.count("[") > MAX_DEPTH and depth_exceeds(value)):
        # (what is remembered must load again; fewer brackets than the limit cannot nest deeper)
        return (_UNPARSED.build if typed else _UNPARSED.validated)(id=call_id, name=name, input={}, raw_input=raw)
    if "\\u" in raw or not raw.isascii():
        # A ``\ud800`` escape decodes to a lone surrogate, which no later save could encode.
        value = clean_value(value)
    return make(id=call_id, name=name, input=value)


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}
_AROUND = 40
"""Characters of the argument text shown on each side of where it stops being valid JSON."""


def arguments_problem(raw: str) -> str:
    """Why ``raw``, a tool call's argument text that `tool_use_block` kept as text, is not a JSON
    object of arguments, in words the model can act on: where the JSON breaks (line, column,
    position and the text around it), what else it is, or how deep it nests."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        before, after = raw[max(0, exc.pos - _AROUND):exc.pos], raw[exc.pos:exc.pos + _AROUND]
        return (f"they are not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno} (position {exc.pos}): "
                f"{before!r} <here> {after!r}")
    except RecursionError:
        return f"they nest deeper than the JSON parser goes (a JSON object of at most {MAX_DEPTH} levels)"
    except ValueError as exc:  # (a number too long to convert, say)
        return f"they are not valid JSON: {exc}"
    if not isinstance(value, dict):
        return f"they are a JSON {_JSON_KINDS.get(type(value), type(value).__name__)}: {raw[:500]!r}"
    return f"they nest deeper than {MAX_DEPTH} levels"


class ToolResultCollector:
    """Rebuilds tool results from ToolResult* events, keyed by call id."""

    __slots__ = ("_parts", "results")

    def __init__(self) -> None:
        self._parts: dict[str, tuple[str, list[str | DataBlock]]] = {}
        self.results: dict[str, ToolResultBlock] = {}

    def add(self, ev: Any) -> None:
        # Fields are read from the fields dict, as `ReplyBuilder.add` does (an event's class has
        # pydantic's __getattr__, so each attribute read takes the slow path).
        fields = ev.__dict__
        t = fields["type"]
        if t == "tool_result_text_delta":
            self._entry(fields)[1].append(fields["delta"])
        elif t == "tool_result_data_delta":
            self._entry(fields)[1].append(fields["data"])
        elif t == "tool_result_start":
            self._entry(fields)
        elif t == "tool_result_end":
            call_id = fields["tool_call_id"]
            name, parts = self._parts.pop(call_id, (fields["tool_name"], []))
            self.results[call_id] = result_of(call_id, name, parts, fields["state"])

    def _entry(self, fields: dict[str, Any]) -> tuple[str, list[str | DataBlock]]:
        entry = self._parts.get(fields["tool_call_id"])
        if entry is None:
            entry = self._parts[fields["tool_call_id"]] = (fields["tool_name"], [])
        return entry


def result_of(call_id: str, name: str, parts: list[str | DataBlock], state: ToolResultState) -> ToolResultBlock:
    """The result a call's output ``parts`` and its end make, as `ToolResultCollector` builds it."""
    output = _join(parts)
    # From the acting chain's events: typed unless a middleware derived one with model_copy.
    typed = type(call_id) is str and type(name) is str and type(output) is str and type(state) is ToolResultState
    return (_RESULT.build if typed else _RESULT.validated)(id=call_id, name=name, output=output, state=state)


def join_output(parts: list[str | DataBlock]) -> str | list[TextBlock | DataBlock]:
    """A tool result's output from its chunks, as `ToolResultCollector` builds it."""
    return _join(parts)


def _join(parts: list[str | DataBlock]) -> str | list[TextBlock | DataBlock]:
    try:  # (join takes only str: it raises at the first DataBlock, when there is one)
        return "".join(cast("list[str]", parts))
    except TypeError:
        pass
    out: list[TextBlock | DataBlock] = []
    for p in parts:
        if isinstance(p, DataBlock):
            out.append(p)
        elif out and isinstance(out[-1], TextBlock):
            out[-1] = TextBlock(text=out[-1].text + p)
        else:
            out.append(TextBlock(text=p))
    return out


def result_start(reply_id: str, call: ToolUseBlock, meta: dict[str, Any]) -> ToolResultStart:
    """The ToolResultStart of ``call``, which the acting pass runs; ``meta``: ``{"metadata": the
    tool's}`` or ``{}``. Built from the call's ids when they are exactly ``str`` (a call a
    middleware derived untyped is validated), as `ToolResultCollector` builds the result."""
    shape = _RESULT_START_META if meta else _RESULT_START
    fields = call.__dict__
    call_id, name = fields["id"], fields["name"]
    make = shape.build if type(call_id) is str and type(name) is str else shape.validated
    if meta:
        return make(reply_id=reply_id, tool_call_id=call_id, tool_name=name, metadata=meta["metadata"])
    return make(reply_id=reply_id, tool_call_id=call_id, tool_name=name)


def result_text(reply_id: str, call: ToolUseBlock, text: str) -> ToolResultTextDelta:
    """A text delta of ``call``'s result: its output, or the error text the model sees (``str``
    the runtime made or cleaned); built as `result_start` is."""
    fields = call.__dict__
    call_id, name = fields["id"], fields["name"]
    typed = type(call_id) is str and type(name) is str and type(text) is str
    make = _RESULT_TEXT.build if typed else _RESULT_TEXT.validated
    return make(reply_id=reply_id, tool_call_id=call_id, tool_name=name, delta=text)


def result_end(reply_id: str, call: ToolUseBlock, state: ToolResultState, meta: dict[str, Any]) -> ToolResultEnd:
    """The ToolResultEnd of ``call`` with ``state``; ``meta`` as for `result_start`."""
    shape = _RESULT_END_META if meta else _RESULT_END
    fields = call.__dict__
    call_id, name = fields["id"], fields["name"]
    typed = type(call_id) is str and type(name) is str and type(state) is ToolResultState
    make = shape.build if typed else shape.validated
    if meta:
        return make(reply_id=reply_id, tool_call_id=call_id, tool_name=name, state=state,
                    metadata=meta["metadata"])
    return make(reply_id=reply_id, tool_call_id=call_id, tool_name=name, state=state)


def result_events(
    reply_id: str, call: ToolUseBlock, text: str, state: ToolResultState
) -> tuple[AgentEvent, ...]:
    """The three events of a result known up front (denied, invalid, interrupted…)."""
    return (
        ToolResultStart(reply_id=reply_id, tool_call_id=call.id, tool_name=call.name),
        ToolResultTextDelta(reply_id=reply_id, tool_call_id=call.id, tool_name=call.name, delta=text),
        ToolResultEnd(reply_id=reply_id, tool_call_id=call.id, tool_name=call.name, state=state),
    )

