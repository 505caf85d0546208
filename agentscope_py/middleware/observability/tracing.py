"""`OtelTracingMiddleware`: OpenTelemetry spans for agent runs, per the GenAI semantic conventions.

Spans (instrumentation scope ``agentscope_py``):

* ``invoke_agent {agent}`` (INTERNAL) around each execution (``on_agent``);
* ``chat {model}`` (CLIENT) around each model invocation (``on_model_call``), a child of it;
* ``execute_tool {tool}`` (INTERNAL) for each tool call (in ``on_acting``, from its
  ToolResultStart to its ToolResultEnd), each with its own ``gen_ai.tool.call.id``; a child of
  the ``invoke_agent`` span (of the acting point's context), status ERROR for an ``error`` or
  ``interrupted`` result. A sub-agent called from a lone tool call nests under that call's span.

Status: OK when the stream completes; ERROR with the exception recorded (and ``error.type`` set)
when it fails; ERROR ``"cancelled"`` when the consumer cancels or closes it early. A part that
ends in an error without its stream failing ends ERROR too, as if that error had been raised
(its message the description, its type ``error.type``): a ``chat`` span whose last
``ModelCallEnd`` has an ``error`` (a budget cut the call short and stopped the run, a retry gave
up and continued), an ``invoke_agent`` span whose run was interrupted (``AgentInterrupted``: the
run answered, with its INTERRUPTED reply, but was cut, as its model and tool calls were). Every span is
ended exactly once. Message contents (``gen_ai.input.messages``, ``gen_ai.output.messages``, tool
arguments and results) are recorded only with ``capture_content=True``.

Provider: the ``tracer_provider`` given (the global one is never touched), else the global one,
resolved lazily at each hook call until one is configured. With no SDK configured each hook
passes straight through (no span, no wrapper). A provider that fails to create a span never
breaks the run: the hook passes through and the failure is logged once.

Context: each hook is a layer of the chain's fold like any other (`middleware.chain`): it
returns an async generator of the events, which the fold steps in a private copy of the
context (`_stream.context.stepped`). The generator opens its span at the first pull (one closed
unpulled leaves nothing open), makes it current in that copy, and calls ``next(input)`` and
iterates the inner stream there: the loop body and the tool tasks run in the context of whoever
steps their stream, so this is what parents the ``chat`` and ``execute_tool`` spans (and a
sub-agent's ``invoke_agent``) correctly. Nothing is attached in the consumer's context
(OpenTelemetry contexts attached across ``yield`` break when a generator is closed from another
task), and no span leaks into it.
"""

from __future__ import annotations

import asyncio
import builtins
import contextvars
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, TracerProvider
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "OtelTracingMiddleware needs OpenTelemetry: pip install 'agentscope-py[otel]'"
    ) from exc

from ... import errors
from ...events import AgentEvent
from ...extension.base import ActingInput, AgentInput, ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from ...message import Msg, ToolUseBlock
from ...model.base import ChatModel, model_provider
from ...stream import EventStream, aclose, aclosing
from .._otel_conventions import (
    AGENT_ID,
    AGENT_NAME,
    CONVERSATION_ID,
    ERROR_TYPE,
    INPUT_MESSAGES,
    MESSAGE_COUNT,
    OPERATION,
    PROVIDER,
    REQUEST_MODEL,
    REQUEST_OPTIONS,
    TOOL_ARGUMENTS,
    TOOL_CALL_ID,
    TOOL_COUNT,
    TOOL_DEFINITIONS,
    TOOL_DESCRIPTION,
    TOOL_NAME,
    TOOL_RESULT,
    TOOL_STATE,
    TOOL_TYPE,
    dumps,
    messages_json,
    tools_json,
)
from .._otel_records import Closer, Observer, Records, agent_records, chat_records
from ._remembered import remembered_input

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...extension.base import AgentView

__all__ = ["SCOPE", "OtelTracingMiddleware"]

SCOPE = "agentscope_py"
"""The instrumentation scope name of every span."""

_log = logging.getLogger("agentscope_py.middleware.tracing")

# Providers that mean "no SDK configured" (the API's defaults).
_UNCONFIGURED = (trace.NoOpTracerProvider, trace.ProxyTracerProvider)

Watch = tuple[Observer, Callable[[BaseException | None], None]]
"""What watches one subscription: what sees each event, and what ends it given the outcome (None:
completed; the error; `_CANCELLED`: closed or cancelled)."""


class OtelTracingMiddleware(MiddlewareBase):
    """Traces executions, model calls and tool batches as OpenTelemetry spans.

    ``tracer_provider``: an application-owned provider (recommended; the global one is used when
    omitted). ``capture_content``: also record message contents, tool arguments and results
    (opt-in: they may hold personal data).
    """

    def __init__(self, tracer_provider: TracerProvider | None = None, capture_content: bool = False) -> None:
        self._provider = tracer_provider
        self.capture_content = capture_content
        # The chat spans record the reply rebuilt from the events they see (the ordering lints).
        self.roles = frozenset({"logs_content"}) if capture_content else frozenset()
        self._tracer: Tracer | None = None
        self._warned = False

    @property
    def tracer_provider(self) -> TracerProvider | None:
        """The provider given at construction (None: the global one is used)."""
        return self._provider

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_AGENT, ExtensionPoint.ON_MODEL_CALL, ExtensionPoint.ON_ACTING})

    def _chat_records(self, span: Span) -> Records:
        return chat_records(span, self.capture_content)

    # -- hooks -----------------------------------------------------------------------------------

    def on_agent(self, agent: AgentView, ctx: RuntimeContext, input: AgentInput, next: Next) -> Any:
        if self._get_tracer() is None:  # nothing configured: no span, no wrapper
            return next(input)

        def attributes() -> dict[str, Any]:
            attrs: dict[str, Any] = {
                OPERATION: "invoke_agent",
                PROVIDER: model_provider(agent.model),
                AGENT_NAME: agent.name,
                AGENT_ID: str(getattr(agent, "id", None) or agent.name),
                CONVERSATION_ID: ctx.session_id,
                REQUEST_MODEL: _model_name(agent.model),
                MESSAGE_COUNT: len(input.msgs),
            }
            return attrs

        def admitted() -> list[Msg]:
            # (a PII redaction's ``on_agent_state_ready`` is inside this layer, by the lints)
            return remembered_input(ctx, input.msgs)

        def records(span: Span) -> Records:
            return agent_records(span, self.capture_content, admitted if self.capture_content else None)

        name = f"invoke_agent {agent.name}" if agent.name else "invoke_agent"
        return self._traced(name, SpanKind.INTERNAL, attributes, lambda: next(input), records, tool_parent)

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        if self._get_tracer() is None:
            return next(input)
        model = _model_name(input.model)

        def attributes() -> dict[str, Any]:
            attrs: dict[str, Any] = {
                OPERATION: "chat",
                PROVIDER: model_provider(input.model),
                REQUEST_MODEL: model,
                CONVERSATION_ID: ctx.session_id,
                MESSAGE_COUNT: len(input.messages),
                TOOL_COUNT: len(input.tools),
            }
            for option, key in REQUEST_OPTIONS.items():
                value = input.options.get(option)
                if isinstance(value, str) and option == "stop":
                    value = (value,)
                if isinstance(value, bool | int | float | str | tuple | list):
                    attrs[key] = tuple(value) if isinstance(value, list) else value
            if self.capture_content:
                attrs[INPUT_MESSAGES] = messages_json(input.messages)
                if input.tools:
                    attrs[TOOL_DEFINITIONS] = tools_json(input.tools)
            return attrs

        return self._traced(f"chat {model}", SpanKind.CLIENT, attributes, lambda: next(input), self._chat_records)

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        if self._get_tracer() is None:
            return next(input)
        calls = input.tool_calls

        def open_tools() -> Watch:
            # Built in the layer's private context, where next() then builds the tools' context
            # (so a sub-agent can find its tool's span through TOOL_SPANS).
            spans = ToolSpans(self, agent, calls)
            TOOL_SPANS.set(spans)

            def observe(event: Any) -> None:
                if event.source is None:  # a sub-agent's forwarded events are its own spans
                    spans.observe(event)

            def finish(outcome: BaseException | None) -> None:
                spans.close(outcome if outcome is not None else _CANCELLED)

            return observe, finish

        return self._watch(open_tools, lambda: next(input))

    # -- the spans around a stream ---------------------------------------------------------------

    def _traced(
        self,
        name: str,
        kind: SpanKind,
        attributes: Callable[[], dict[str, Any]],
        call_next: Callable[[], EventStream[AgentEvent]],
        observer: Callable[[Span], tuple[Observer, Closer | None]],
        parent: Callable[[], Context | None] | None = None,
    ) -> AsyncIterator[AgentEvent]:
        def open_span() -> Watch | None:
            span = self._start(name, kind, attributes, parent() if parent is not None else None)
            if parent is not None:
                TOOL_SPANS.set(None)  # found (or not): the calls of this run are its own
            if span is None:  # no span after all (the provider failed): just the inner stream
                return None
            otel_context.attach(trace.set_span_in_context(span))  # in the layer's private context; never detached
            observe, close = observer(span)  # fresh per subscription: a re-iteration starts clean

            def finish(outcome: BaseException | None) -> None:
                failed: str | None = None
                if close is not None and outcome is None:
                    try:
                        failed = close(span)
                    except Exception:
                        self._warn("recording span attributes")
                self._end(span, outcome, failed)

            return observe, finish

        return self._watch(open_span, call_next)

    async def _watch(
        self, open_: Callable[[], Watch | None], call_next: Callable[[], EventStream[AgentEvent]],
    ) -> AsyncIterator[AgentEvent]:
        """The inner stream, watched: a hook's generator, which the fold steps in the layer's
        private context. ``open_`` opens the spans (and makes one current) there at the first
        pull; next() then builds the inner layers in it (so the model call's task inherits it) and
        the inner stream is stepped in it (so the loop body and the tool tasks do too). Nothing is
        attached anywhere else. The spans open at the first pull, not at ``__aiter__``: a
        subscription closed before it is pulled never runs this body, so it leaves no span open."""
        watch = open_()
        if watch is None:
            async with aclosing(call_next().__aiter__()) as plain:
                async for event in plain:
                    yield event
            return
        observe, finish = watch
        outcome: BaseException | None = _CANCELLED  # left as is when the consumer goes away
        it: AsyncIterator[Any] | None = None
        try:
            it = call_next().__aiter__()
            async for event in it:
                try:
                    observe(event)
                except Exception:
                    self._warn("recording span attributes")
                yield event
            outcome = None
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except BaseException as exc:
            outcome = exc
            raise
        finally:
            try:
                if it is not None:
                    await aclose(it)  # children end before their parent
            finally:
                finish(outcome)

    def _start(
        self, name: str, kind: SpanKind, attributes: Callable[[], dict[str, Any]], parent: Context | None = None
    ) -> Span | None:
        """A recording (or sampled-out but propagating) span, or None when there is nothing to do.
        ``parent``: the context to start it in (default: the current one)."""
        tracer = self._get_tracer()
        if tracer is None:
            return None
        try:
            span = tracer.start_span(name, context=parent, kind=kind, attributes=attributes())
            if not span.is_recording() and span.get_span_context() == trace.get_current_span(parent).get_span_context():
                return None  # a no-op tracer hands back the current span: nothing to add
            return span
        except Exception:
            self._warn("starting a span")
            return None

    def _end(self, span: Span, outcome: BaseException | None, failed: str | None = None) -> None:
        """End ``span`` with ``outcome``'s status; ``failed``: the error (``"Type: message"``) its
        part ended in though its stream completed (ERROR, as if that error had been raised)."""
        try:
            if outcome is None and failed:
                kind, _, message = failed.partition(": ")  # ("Type: message", as a raised one reads)
                span.set_attribute(ERROR_TYPE, _named_error_type(kind))
                span.set_status(Status(StatusCode.ERROR, message or kind))
            elif outcome is None:
                span.set_status(Status(StatusCode.OK))
            elif outcome is _CANCELLED or isinstance(outcome, asyncio.CancelledError):
                span.set_status(Status(StatusCode.ERROR, "cancelled"))
            else:
                span.set_attribute(ERROR_TYPE, _error_type(outcome))
                span.record_exception(outcome)
                span.set_status(Status(StatusCode.ERROR, str(outcome) or type(outcome).__name__))
        except Exception:
            self._warn("setting the span status")
        finally:
            try:
                span.end()
            except Exception:
                self._warn("ending a span")

    def _get_tracer(self) -> Tracer | None:
        if self._tracer is not None:
            return self._tracer
        provider = self._provider if self._provider is not None else trace.get_tracer_provider()
        # Nothing configured (yet): pass through, and look again at the next subscription.
        if isinstance(provider, _UNCONFIGURED):
            return None
        from ... import __version__

        try:
            self._tracer = provider.get_tracer(SCOPE, __version__)
        except Exception:
            self._warn("getting a tracer")
            return None
        return self._tracer

    def _warn(self, what: str) -> None:
        # Once per middleware instance: a broken exporter would otherwise log on every event.
        if not self._warned:
            self._warned = True
            _log.warning("OtelTracingMiddleware: %s failed; the run goes on untraced there", what, exc_info=True)
        else:
            _log.debug("OtelTracingMiddleware: %s failed", what, exc_info=True)


class _Cancelled(BaseException):
    """Marks an iteration that ended without completing or failing (closed or cancelled)."""


_CANCELLED = _Cancelled()


def _model_name(model: ChatModel | None) -> str:
    return str(getattr(model, "name", None) or "unknown")


def _error_type(exc: BaseException) -> str:
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _named_error_type(name: str) -> str:
    """``error.type`` for an error known by its type's name only (``ModelCallEnd.error``): the
    qualified name when it is one of this package's errors or a builtin, as a raised one gets."""
    cls = getattr(errors, name, None) or getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, BaseException):
        return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return name


# -- the execute_tool spans: one per tool call, from the events --------------------------------


class ToolSpans:
    """The ``execute_tool {tool}`` spans of one acting subscription: one per call, opened at its
    ToolResultStart and ended at its ToolResultEnd (status from the result's state), children of
    the acting point's context. A sub-agent a tool runs nests under that tool's span when the
    batch has one call (it may ask before the Start has passed here: the span opens then); with
    several calls running at once which one started it is unknowable, so it nests under the
    acting point's span, beside them."""

    def __init__(self, mw: OtelTracingMiddleware, agent: AgentView, calls: Sequence[ToolUseBlock]) -> None:
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
