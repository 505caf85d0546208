"""What `OtelTracingMiddleware`'s ``invoke_agent`` and ``chat`` spans record from the events."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.trace import Span

from .._replies import ReplyBuilder
from ..message import ChatUsage, GenerateReason, Msg
from ._otel_conventions import (
    CACHE_READ_TOKENS,
    CACHE_WRITE_TOKENS,
    FINISH_REASONS,
    INPUT_MESSAGES,
    INPUT_TOKENS,
    OUTPUT_MESSAGES,
    OUTPUT_TOKENS,
    REASONING_TOKENS,
    REPLY_ID,
    RESPONSE_MODEL,
    TIME_TO_FIRST_CHUNK,
    messages_json,
)

__all__ = ["Closer", "Observer", "Records", "agent_records", "chat_records"]

Observer = Callable[[Any], None]
Closer = Callable[[Span], str | None]
"""Records the rest when the span's stream completes; returns the error its part ended in
without the stream raising (``"Type: message"``), else None."""
Records = tuple[Observer, Closer | None]
"""What sees each event of a span's stream, and what records the rest when it completes."""


INTERRUPTED_RUN = "AgentInterrupted: the run was interrupted"
"""The error an interrupted run's ``invoke_agent`` span ends with: the run was cut, though it
answered (its INTERRUPTED reply), as the interrupted model call's and tool calls' spans end."""


def agent_records(span: Span, capture: bool, admitted: Callable[[], Sequence[Msg]] | None = None) -> Records:
    """What an ``invoke_agent`` span records: the reply id, the result's finish reason and usage
    (and, with ``capture``, the result, and the input as ``admitted`` gives it once the run took it
    in: at the first event after the prelude, when the ``on_agent_state_ready`` hooks, a PII
    redaction's, have rewritten it); the closer returns `INTERRUPTED_RUN` for an interrupted run."""
    waiting = admitted
    interrupted = [False]

    def observe(event: Any) -> None:
        nonlocal waiting
        if event.source is not None:
            return
        t = event.type
        if waiting is not None and t not in _PRELUDE:
            msgs = waiting()
            waiting = None  # (asked once: a resume's answers are not taken into memory)
            if msgs:
                span.set_attribute(INPUT_MESSAGES, messages_json(msgs))
        if t == "agent_start":
            span.set_attribute(REPLY_ID, event.reply_id)
        elif t == "agent_result":
            result: Msg = event.result
            if result.generate_reason is not None:
                span.set_attribute(FINISH_REASONS, (result.generate_reason.value,))
                interrupted[0] = result.generate_reason is GenerateReason.INTERRUPTED
            if result.usage is not None:
                set_usage(span, result.usage)
            if capture:
                span.set_attribute(OUTPUT_MESSAGES, messages_json([result]))

    def close(span: Span) -> str | None:
        return INTERRUPTED_RUN if interrupted[0] else None

    return observe, close


_PRELUDE = frozenset({"agent_start", "middleware_started", "middleware_completed"})
"""The events a run may publish before its input is in memory: its start, and the trace events of
the prelude's hooks (``trace_middleware``)."""


def chat_records(span: Span, capture: bool) -> Records:
    """What a ``chat`` span records: the response model, the time to the first chunk, usage and
    finish reason (and, with ``capture``, the reply rebuilt from the events). A call can end in an
    error and its stream still complete (a budget cut it short and stopped the run, a retry gave
    up with ``on_failure="continue"``): the error of the last ``ModelCallEnd`` is what the closer
    returns, so the span ends with an error status all the same."""
    started = time.perf_counter()
    builder = ReplyBuilder() if capture else None
    failed: list[str | None] = [None]  # the error of the last ModelCallEnd seen

    def observe(event: Any) -> None:
        if event.source is not None:
            return
        if builder is not None:
            builder.add(event)
        t = event.type
        if t == "model_call_start":
            span.set_attribute(RESPONSE_MODEL, event.model)
            span.set_attribute(TIME_TO_FIRST_CHUNK, time.perf_counter() - started)
        elif t == "model_call_end":
            failed[0] = event.error
            if event.usage is not None:
                set_usage(span, event.usage)
            if event.finish_reason:
                span.set_attribute(FINISH_REASONS, (event.finish_reason,))

    def close(span: Span) -> str | None:
        if builder is not None:
            reply = builder.build("output", None)
            span.set_attribute(OUTPUT_MESSAGES, messages_json([reply], builder.finish_reason))
        return failed[0]

    return observe, close


def set_usage(span: Span, usage: ChatUsage) -> None:
    span.set_attribute(INPUT_TOKENS, usage.input_tokens)
    span.set_attribute(OUTPUT_TOKENS, usage.output_tokens)
    # The detailed counts only when the provider reported them.
    if usage.cache_read_tokens:
        span.set_attribute(CACHE_READ_TOKENS, usage.cache_read_tokens)
    if usage.cache_write_tokens:
        span.set_attribute(CACHE_WRITE_TOKENS, usage.cache_write_tokens)
    if usage.reasoning_tokens:
        span.set_attribute(REASONING_TOKENS, usage.reasoning_tokens)
