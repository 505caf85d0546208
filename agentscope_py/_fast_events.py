"""Fast constructors for the per-token delta events (internal).

Everything else in the runtime is built with pydantic's validating constructors. The delta events
are the exception because there is one per streamed token: validating ``TextBlockDelta(...)``
costs about 1.7x what this module's makers do, and that difference shows per token (see
docs/stream.md, "What a token costs").

`delta_maker` is handed the ids a block's deltas share, once per block, and returns a function of
the delta text that builds the event. What it builds is the object the validating constructor
gives (the same ``__dict__`` with the same field order, the same ``model_fields_set``, no extras,
no private attributes), which `tests/test_events.py` checks field by field. It is safe
because of what it is given and what it is used for:

* only the runtime calls it, with values it made itself and that already have the field's type:
  ids it generated or read from typed events, and text that has crossed the model call as ``str``
  (`_model_call.py` puts only ``str`` deltas in transit);
* the delta classes have no validators, no extras and no private attributes (checked at import:
  a class that gains one fails loudly here instead of silently skipping its validation);
* events are frozen, so the fields set that every delta of a kind shares is never mutated in
  place (pydantic's ``model_copy`` copies it first).

No code is generated: each maker is a partial of one function over a template dict. `with_source` is the
same kind of copy for the events a sub-agent forwards (its ``source`` set), one per event, and
`with_metadata` for an event a middleware annotates as it passes (`BudgetMiddleware`'s
ModelCallEnd, one per model call).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from pydantic import BaseModel

from .events import EventBase, TextBlockDelta, ThinkingBlockDelta, ToolCallDelta, ToolResultTextDelta
from .message import id_factory

__all__ = ["delta_maker", "with_metadata", "with_source"]

_D = TypeVar("_D", TextBlockDelta, ThinkingBlockDelta, ToolCallDelta, ToolResultTextDelta)
_E = TypeVar("_E", bound=EventBase)

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
    ``id``, ``created_at`` and ``metadata`` each), without validating. ``ids``: every field of
    ``C`` but ``delta`` (``reply_id`` and ``block_id``, or ``reply_id``, ``tool_call_id`` and
    ``tool_name``); only for values the runtime made itself. Ids that are not exactly ``str`` (a
    provider's tool name of another type) get a maker that validates."""
    kind = _KINDS[cls]
    if bound.keys() != kind.names:
        raise TypeError(f"delta_maker({cls.__name__}) takes {', '.join(kind.bound)}")
    for value in bound.values():  # (a loop: a generator expression costs a frame per block)
        if type(value) is not str:
            return lambda delta: cls.model_validate({**bound, "delta": delta})
    # A partial of one module-level function, not a closure: a maker lives as long as its block
    # streams, and a closure over ten cells was twelve objects per open block for the collector to
    # walk (a served process holds thousands of runs in flight); the partial is two.
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


_SOURCE = frozenset({"source"})


def with_source(ev: EventBase, source: str) -> Any:
    """``ev.model_copy(update={"source": source})`` without its generic machinery, for the events a
    sub-agent forwards into its caller's stream (one per event, `agent/_subagent.py`): the same
    ``__dict__`` but ``source``, the fields set plus ``source``, the same extras and private
    attributes. ``source`` is a ``str`` the runtime made (the agent path)."""
    values = ev.__dict__.copy()
    values["source"] = source
    new = _new(type(ev))
    _set(new, "__dict__", values)
    _set_fields_set(new, ev.__pydantic_fields_set__ | _SOURCE)
    _set_extra(new, ev.__pydantic_extra__)
    _set_private(new, ev.__pydantic_private__)
    return new


_METADATA = frozenset({"metadata"})


def with_metadata(ev: _E, metadata: dict[str, Any]) -> _E:
    """``ev.model_copy(update={"metadata": metadata})`` the same way, for an annotation a middleware
    adds as the event passes (`BudgetMiddleware`'s, one per model call). A copy: events are
    immutable, and an inner layer may hold ``ev`` itself. ``metadata``: a new ``dict`` of the
    caller's. (Not one helper with `with_source`: that one runs per forwarded event, and a shared
    helper would cost it a frame each.)"""
    values = ev.__dict__.copy()
    values["metadata"] = metadata
    new: _E = _new(type(ev))
    _set(new, "__dict__", values)
    _set_fields_set(new, ev.__pydantic_fields_set__ | _METADATA)
    _set_extra(new, ev.__pydantic_extra__)
    _set_private(new, ev.__pydantic_private__)
    return new
