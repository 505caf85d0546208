"""`EvalContext`: everything an evaluator sees about one run of one case."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar, overload

from ..events import (
    AgentEvent,
    ModelCallEnd,
    ModelCallStart,
    ToolCallDelta,
    ToolCallStart,
    ToolResultEnd,
    ToolResultTextDelta,
)
from ..message import ChatUsage, Msg
from ._case import Case

__all__ = ["EvalContext", "ModelCall", "ToolCall"]

T = TypeVar("T")


class _kept(Generic[T]):  # (lower case: it stands for ``functools.cached_property``)
    """A view computed on first use and kept in the instance, as ``functools.cached_property``
    does, without the lock Python 3.11's takes at each first use (the runner reads a view of
    every run)."""

    def __init__(self, fn: Callable[[Any], T]) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__

    @overload
    def __get__(self, obj: None, owner: type[Any] | None = None) -> _kept[T]: ...
    @overload
    def __get__(self, obj: object, owner: type[Any] | None = None) -> T: ...

    def __get__(self, obj: object | None, owner: type[Any] | None = None) -> T | _kept[T]:
        if obj is None:
            return self
        # Kept under the view's own name: the instance's value shadows this (non-data) descriptor.
        value = obj.__dict__[self.name] = self.fn(obj)
        return value



class ToolCall(NamedTuple):
    """A tool call the run made: ``name``, ``args`` (the parsed arguments; the raw text when they
    are not JSON), the result's ``state`` and text ``output`` (None when no result came)."""

    id: str
    name: str
    args: Any
    state: str | None = None
    output: str | None = None


class ModelCall(NamedTuple):
    """A model call the run made: the ``model`` reported, its ``usage`` (None when unknown)."""

    model: str
    usage: ChatUsage | None
    error: str | None = None


@dataclass
class EvalContext:
    """One run of ``case``: its ``events`` (every event the caller's stream carried), ``output``
    (the final message, None when the run failed), ``error`` (what the run raised, or None),
    ``duration`` (seconds), the OpenTelemetry ``spans`` it produced (empty without an
    `OtelTracingMiddleware` on the agent) and ``attempt`` (0-based, with ``repeat``).

    Derived views: ``text`` (the output's text), ``structured`` (the structured output object),
    ``usage`` (summed over the model calls), ``model_calls`` and ``tool_calls`` (those of the
    agent itself; a sub-agent's events carry a ``source`` and stay in ``events``)."""

    case: Case
    events: Sequence[AgentEvent] = ()
    output: Msg | None = None
    error: BaseException | None = None
    duration: float = 0.0
    spans: Sequence[Any] = ()
    attempt: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def input(self) -> str | list[Msg]:
        return self.case.input

    @property
    def expected_output(self) -> Any:
        return self.case.expected_output

    @property
    def metadata(self) -> dict[str, Any]:
        return self.case.metadata

    @property
    def text(self) -> str:
        return self.output.text if self.output is not None else ""

    @property
    def structured(self) -> Any:
        return self.output.metadata.get("structured_output") if self.output is not None else None

    @_kept
    def model_calls(self) -> list[ModelCall]:
        calls: list[ModelCall] = []
        open_model: dict[str | None, str] = {}
        for event in self.events:
            # Exact types (events are final classes): a run has tens of events per model call.
            if type(event) is ModelCallStart:
                open_model[event.source] = event.model
            elif type(event) is ModelCallEnd:
                calls.append(ModelCall(open_model.pop(event.source, ""), event.usage, event.error))
        return calls

    @_kept
    def usage(self) -> ChatUsage | None:
        """Token totals over every model call (sub-agents' too); None when no call reported any."""
        known = [call.usage for call in self.model_calls if call.usage is not None]
        if len(known) <= 1:
            return known[0] if known else None
        # Summed as numbers and built once: each ChatUsage addition makes a model.
        tokens = [0, 0, 0, 0, 0]
        for u in known:
            tokens[0] += u.input_tokens
            tokens[1] += u.output_tokens
            tokens[2] += u.cache_read_tokens
            tokens[3] += u.cache_write_tokens
            tokens[4] += u.reasoning_tokens
        return ChatUsage(input_tokens=tokens[0], output_tokens=tokens[1], cache_read_tokens=tokens[2],
                         cache_write_tokens=tokens[3], reasoning_tokens=tokens[4])

    @_kept
    def tool_calls(self) -> list[ToolCall]:
        order: list[str] = []
        names: dict[str, str] = {}
        args: dict[str, list[str]] = {}
        outputs: dict[str, list[str]] = {}
        states: dict[str, str] = {}
        for event in self.events:
            if type(event) is ToolCallStart:
                if event.source is None:
                    order.append(event.tool_call_id)
                    names[event.tool_call_id] = event.tool_name
                    args[event.tool_call_id] = []
            elif type(event) is ToolCallDelta:
                if event.source is None:
                    args.setdefault(event.tool_call_id, []).append(event.delta)
            elif type(event) is ToolResultTextDelta:
                if event.source is None:
                    outputs.setdefault(event.tool_call_id, []).append(event.delta)
            elif type(event) is ToolResultEnd and event.source is None:
                states[event.tool_call_id] = str(event.state.value)
                outputs.setdefault(event.tool_call_id, [])
        calls = []
        for call_id in order:
            text = "".join(args.get(call_id, ()))
            parsed: Any
            try:
                parsed = json.loads(text) if text.strip() else {}
            except ValueError:
                parsed = text
            output = outputs.get(call_id)
            calls.append(ToolCall(call_id, names[call_id], parsed, states.get(call_id),
                                  "".join(output) if output is not None else None))
        return calls
