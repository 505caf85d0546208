"""`HasMatchingSpan`, and which span collector serves an agent (`collector_for`)."""

from __future__ import annotations

import re
import sys
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._context import EvalContext
from ._evaluator import Evaluator
from ._result import EvalResult

__all__ = ["HasMatchingSpan", "collector_for"]

if TYPE_CHECKING:
    from ._span_collector import SpanCollector


_collectors: weakref.WeakKeyDictionary[Any, SpanCollector] = weakref.WeakKeyDictionary()


def collector_for(agent: Any) -> SpanCollector | None:
    """The collector on the tracer provider of ``agent``'s tracing middleware (installed once per
    provider), or None when the agent produces no spans we can see."""
    # An agent can hold an OtelTracingMiddleware only once its module is imported: until then
    # (most evaluations) this costs one dictionary look-up per run.
    tracing = sys.modules.get("agentscope_py.middleware.observability.tracing")
    if tracing is None:
        return None
    from ..extension.base import ExtensionPoint

    tracers = [m for m in agent.middlewares_at(ExtensionPoint.ON_AGENT) if isinstance(m, tracing.OtelTracingMiddleware)]
    if not tracers:
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider

        from ._span_collector import SpanCollector
    except ImportError:  # the API without the SDK: no spans to collect
        return None
    provider = tracers[0].tracer_provider or trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        return None
    collector = _collectors.get(provider)
    if collector is None:
        collector = _collectors[provider] = SpanCollector()
        provider.add_span_processor(collector)
    return collector


class HasMatchingSpan(Evaluator):
    """The run produced a span named ``name`` (exact; or a compiled regex, searched) whose
    attributes include ``attributes`` (equal values), at least ``count`` times. Spans come from
    the agent's `OtelTracingMiddleware` (``invoke_agent {agent}``, ``chat {model}``,
    ``execute_tool {tool}``)."""

    def __init__(self, name: str | re.Pattern[str] | None = None, *, attributes: Mapping[str, Any] | None = None,
                 count: int = 1) -> None:
        self.span_name = name
        self.attributes = dict(attributes or {})
        self.count = count

    def spec(self) -> dict[str, Any]:
        if isinstance(self.span_name, re.Pattern):
            raise TypeError("HasMatchingSpan with a regex name cannot be written to a dataset file")
        return {"name": self.span_name, "attributes": self.attributes, "count": self.count}

    def _matches(self, span: Any) -> bool:
        if isinstance(self.span_name, re.Pattern):
            if self.span_name.search(span.name) is None:
                return False
        elif self.span_name is not None and span.name != self.span_name:
            return False
        attrs = span.attributes or {}
        return all(k in attrs and attrs[k] == v for k, v in self.attributes.items())

    def evaluate(self, ctx: EvalContext) -> EvalResult:
        if not ctx.spans:
            return EvalResult.of(False, "the run produced no spans (give the agent an OtelTracingMiddleware "
                                        "with an SDK TracerProvider)")
        found = sum(1 for span in ctx.spans if self._matches(span))
        if found >= self.count:
            return EvalResult.of(True)
        names = sorted({span.name for span in ctx.spans})
        want = self.span_name.pattern if isinstance(self.span_name, re.Pattern) else self.span_name
        return EvalResult.of(False, f"{found} span(s) match name={want!r} attributes={self.attributes} "
                                    f"(need {self.count}); spans: {', '.join(names)}")
