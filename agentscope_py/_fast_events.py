"""Copies of an event with one field changed, for the runtime's own annotations (internal).

`with_source` is ``ev.model_copy(update={"source": ...})`` for the events a sub-agent forwards
into its caller's stream, one per event; `with_metadata` the same for an event a middleware
annotates as it passes (`BudgetMiddleware`'s ModelCallEnd). Each builds the object
``model_copy`` gives (the same ``__dict__`` but the one field, the fields set plus that field, the
same extras and private attributes; `tests/test_events.py` compares them) directly, without
``model_copy``'s generic update machinery. Events are frozen, so a copy never changes the
original that an inner layer may still hold.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

from .events import EventBase

__all__ = ["with_metadata", "with_source"]

_E = TypeVar("_E", bound=EventBase)

_new = object.__new__
_set = object.__setattr__
# pydantic's own slots of a model, set through their descriptors (what ``__copy__`` sets too)
_set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__


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
    adds as the event passes (`BudgetMiddleware`'s, one per model call). ``metadata``: a new
    ``dict`` of the caller's."""
    values = ev.__dict__.copy()
    values["metadata"] = metadata
    new: _E = _new(type(ev))
    _set(new, "__dict__", values)
    _set_fields_set(new, ev.__pydantic_fields_set__ | _METADATA)
    _set_extra(new, ev.__pydantic_extra__)
    _set_private(new, ev.__pydantic_private__)
    return new
