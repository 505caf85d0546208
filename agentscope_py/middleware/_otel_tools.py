"""`OtelTracingMiddleware`'s ``execute_tool`` spans: one per tool call, from the events."""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from ..message import ToolUseBlock
from ._otel_conventions import (
    ERROR_TYPE,
    OPERATION,
    TOOL_ARGUMENTS,
    TOOL_CALL_ID,
    TOOL_DESCRIPTION,
    TOOL_NAME,
    TOOL_RESULT,
    TOOL_STATE,
    TOOL_TYPE,
    dumps,
)

if TYPE_CHECKING:
    from ..agent.react import ReActAgent
    from .tracing import OtelTracingMiddleware

__all__ = ["TOOL_SPANS", "ToolSpans", "tool_parent"]


class ToolSpans:
    """The ``execute_tool {tool}`` spans of one acting subscription: one per call, opened at its
    ToolResultStart and ended at its ToolResultEnd (status from the result's state), children of
    the acting point's context. A sub-agent a tool runs nests under that tool's span when the
    batch has one call (it may ask before the Start has passed here: the span opens then); with
    several calls running at once which one started it is unknowable, so it nests under the
    acting point's span, beside them."""

    def __init__(self, mw: OtelTracingMiddleware, agent: ReActAgent, calls: Sequence[ToolUseBlock]) -> None:
        self.mw = mw
        self.agent = agent
        self.calls = {c.id: c for c in calls}
        self.parent = otel_context.get_current()
        self.open: dict[str, tuple[Span, list[str]]] = {}
        self.done: set[str] = set()

    def start(self, call_id: str, name: str) -> Span | None:
        if call_id in self.open or call_id in self.done:
            return self.open[call_id][0] if call_id in self.open else None
        call = self.calls.get(call_id)
        attrs: dict[str, Any] = {OPERATION: "execute_tool", TOOL_NAME: name, TOOL_CALL_ID: call_id,
                                 TOOL_TYPE: "function"}
        tool = self.agent.toolkit.get(name)
        if tool is not None and tool.description:
            attrs[TOOL_DESCRIPTION] = tool.description
        if tool is not None and tool.metadata:  # e.g. an MCP tool's mcp.server.name
            attrs.update({k: v for k, v in tool.metadata.items() if isinstance(v, str | int | float | bool)})
        if self.mw.capture_content and call is not None:
            attrs[TOOL_ARGUMENTS] = dumps(call.input)
        span = self.mw._start(f"execute_tool {name}", SpanKind.INTERNAL, lambda: attrs, self.parent)
        if span is None:
            self.done.add(call_id)  # no span for it after all: do not try again
            return None
        self.open[call_id] = (span, [])
        return span

    def for_sub_agent(self) -> Span | None:
        if len(self.calls) != 1:
            return None
        (call,) = self.calls.values()
        return self.start(call.id, call.name)

    def observe(self, event: Any) -> None:
        t = event.type
        if t == "tool_result_start":
            self.start(event.tool_call_id, event.tool_name)
        elif t == "tool_result_text_delta":
            entry = self.open.get(event.tool_call_id)
            if entry is not None and self.mw.capture_content:
                entry[1].append(event.delta)
        elif t == "tool_result_end":
            self.end(event.tool_call_id, event.state.value)

    def end(self, call_id: str, state: str | None, outcome: BaseException | None = None) -> None:
        entry = self.open.pop(call_id, None)
        self.done.add(call_id)
        if entry is None:
            return
        span, parts = entry
        try:
            if state is not None:
                span.set_attribute(TOOL_STATE, state)
                if self.mw.capture_content:
                    span.set_attribute(TOOL_RESULT, "".join(parts))
        except Exception:
            self.mw._warn("recording span attributes")
        if state == "success" or state is None:
            self.mw._end(span, outcome)
        elif state in ("error", "interrupted"):
            try:  # an error result is the tool's failure, told to the model, not an exception here
                if state == "error":
                    span.set_attribute(ERROR_TYPE, "_OTHER")
                span.set_status(Status(StatusCode.ERROR, f"the tool call ended with an {state} result"))
            except Exception:
                self.mw._warn("setting the span status")
            _end_span(self.mw, span)
        else:  # denied (or running): not run here, not failed
            _end_span(self.mw, span)

    def close(self, outcome: BaseException) -> None:
        """End the calls still open (the stream ended before their results) with ``outcome``."""
        for call_id in list(self.open):
            self.end(call_id, None, outcome)


TOOL_SPANS: contextvars.ContextVar[ToolSpans | None] = contextvars.ContextVar("agentscope_otel_tools", default=None)
"""Set in an acting subscription's private context, so the tools' context carries it."""


def tool_parent() -> Context | None:
    """The context a sub-agent's ``invoke_agent`` starts in: its tool's span when known."""
    spans = TOOL_SPANS.get()
    span = spans.for_sub_agent() if spans is not None else None
    return trace.set_span_in_context(span) if span is not None else None


def _end_span(mw: OtelTracingMiddleware, span: Span) -> None:
    try:
        span.end()
    except Exception:
        mw._warn("ending a span")
