"""`SpanCollector`: how the runner gathers the OpenTelemetry spans of one run.

The spans a run produces are those its agent's `OtelTracingMiddleware` makes. The runner roots
each run in a trace of its own (a non-recording parent span with a fresh trace id, made current
while the run is read), and this span processor, on the middleware's tracer provider (the global
one when the middleware names none), keeps the ended spans of that trace for the run's
evaluators. Spans of other traces pass untouched; without an SDK provider (or without the
middleware) a run has no spans and nothing is installed."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

__all__ = ["SpanCollector"]

_ids = RandomIdGenerator()


class SpanCollector(SpanProcessor):
    """A span processor that keeps, per trace being collected, the spans that end in it."""

    def __init__(self) -> None:
        self._traces: dict[int, list[Any]] = {}
        self._lock = threading.Lock()  # span processors may be called from exporter threads

    def on_end(self, span: ReadableSpan) -> None:
        context = span.context
        spans = self._traces.get(context.trace_id) if context is not None else None
        if spans is not None:
            with self._lock:
                spans.append(span)

    @contextlib.contextmanager
    def collect(self) -> Iterator[list[Any]]:
        """Make a fresh trace current and yield the list its ended spans are added to."""
        root = trace.NonRecordingSpan(trace.SpanContext(_ids.generate_trace_id(), _ids.generate_span_id(), False,
                                                         trace.TraceFlags(trace.TraceFlags.SAMPLED)))
        spans: list[Any] = []
        self._traces[root.get_span_context().trace_id] = spans
        token = otel_context.attach(trace.set_span_in_context(root))
        try:
            yield spans
        finally:
            otel_context.detach(token)
            self._traces.pop(root.get_span_context().trace_id, None)
