"""`internal_model_call`: the one way a middleware (or a tool) asks a model something on its own.

A summariser, a tool selector or a guardrail classifier needs a model reply that is *not* part of
the conversation. LangChain v1 runs those calls through the same callbacks as the agent's, so
their tokens stream into the user's output (langchain issue 34382). Here the call goes straight
to the model's ``stream`` — not through the agent's ``on_model_call`` chain (a middleware calling
it from ``on_model_call`` cannot recurse into itself) and not into any event stream — and comes
back as one `Msg`. What still sees it:

* tracing: with an `OtelTracingMiddleware` on the agent, a ``chat {model} ({purpose})`` CLIENT
  span, a child of the span current where the call is made, with ``agentscope.internal=true``,
  ``agentscope.internal.purpose`` and the ``gen_ai`` usage attributes;
* usage: the reply's usage is added to the call's `RuntimeContext` (``ctx.add_usage``), which the
  loop adds to the run's totals (``ctx.extra_usage``).

The request is sent once: no retry, no fallback (a middleware that wants them wraps the call).
Errors propagate as the model raised them (providers raise the `ModelError` kinds); a
cancellation closes the model's stream (its HTTP request) before it propagates. While a run of
the session is in flight, ``agent.interrupt(...)`` cancels the call too, which then raises
`AgentInterrupted` (the loop makes that an INTERRUPTED reply).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._control import RunControl
from .._replies import tool_use_block
from ..errors import AgentInterrupted
from ..extension.base import ExtensionPoint
from ..message import Block, ChatUsage, GenerateReason, Msg, TextBlock, ThinkingBlock, new_id
from ..model.base import ChatChunk, ChatModel, ModelRequest, ToolSchema, model_provider
from ..stream import aclose

if TYPE_CHECKING:
    from .._context import RuntimeContext
    from ..extension.base import AgentView
    from .observability.tracing import OtelTracingMiddleware

__all__ = ["INTERNAL", "PURPOSE", "internal_model_call"]

INTERNAL = "agentscope.internal"
"""Span attribute: true on the span of an internal model call."""
PURPOSE = "agentscope.internal.purpose"
"""Span attribute: the ``purpose`` the internal call was made for."""


async def internal_model_call(
    agent: AgentView,
    ctx: RuntimeContext,
    messages: Sequence[Msg],
    *,
    model: ChatModel | None = None,
    tools: Sequence[ToolSchema] = (),
    options: Mapping[str, Any] | None = None,
    purpose: str = "internal",
) -> Msg:
    """Ask ``model`` (default: the agent's model) for one reply to ``messages``, outside the
    conversation: nothing reaches the caller's event stream or memory, the call is traced (its own
    span, when the agent traces) and its usage is counted into ``ctx`` (`RuntimeContext.add_usage`).

    ``tools`` are offered to the model (its tool calls come back as `ToolUseBlock`s in the reply;
    nothing runs them); ``options`` are the request options (the agent's ``model_options`` are not
    applied: an internal call says what it needs). ``purpose`` names the call in its span.

    Returns the assistant `Msg` (text, thinking and tool-call blocks; ``usage`` as reported;
    ``generate_reason`` TOOL_CALLS or MODEL_STOP)."""
    if not isinstance(purpose, str) or not purpose:
        raise ValueError("internal_model_call: purpose must be a non-empty str (it names the call's span)")
    chosen = model if model is not None else agent.model
    opts = dict(options or {})
    request = ModelRequest(
        messages=list(messages), tools=tuple(tools), options=opts, structured_output=opts.get("structured_output")
    )
    control = ctx.control  # the run's interrupt switch (None outside a run)
    if control is not None:
        control.check()  # (before the call's coroutine is made: one never awaited is reported)
    tracing = _tracing_middleware(agent)
    call = _collect(chosen, request) if tracing is None else _traced(tracing, chosen, request, ctx, purpose)
    if control is None:
        reply = await call
    else:
        reply = await _interruptible(call, control, purpose)
    ctx.add_usage(reply.usage)
    return reply


async def _interruptible(call: Coroutine[Any, Any, Msg], control: RunControl, purpose: str) -> Msg:
    """``call`` in a task of its own, registered with the run's control as the agent's own model
    call is: an interrupt cancels that task (never the caller's), and the call ends as
    `AgentInterrupted`; the caller's own cancellation stays a cancellation."""
    child = asyncio.get_running_loop().create_task(call)
    control.tasks.add(child)
    try:
        return await child
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if control.interrupted and child.cancelled() and (current is None or not current.cancelling()):
            raise AgentInterrupted(f"the internal model call ({purpose}) was interrupted") from None
        raise
    finally:
        control.tasks.discard(child)


async def _collect(model: ChatModel, request: ModelRequest, span: Any = None) -> Msg:
    texts: list[str] = []
    thinking: list[str] = []
    signature: list[str] = []
    calls: list[list[Any]] = []  # [id, name, argument parts], in order
    open_calls: dict[int, list[Any]] = {}  # the call each index currently names
    usage: ChatUsage | None = None
    response_model: str | None = None
    it: AsyncIterator[ChatChunk] = model.stream(request).__aiter__()
    try:
        async for chunk in it:
            if chunk.text:
                texts.append(chunk.text)
            if chunk.thinking:
                thinking.append(chunk.thinking)
            if chunk.thinking_signature:
                signature.append(chunk.thinking_signature)
            tc = chunk.tool_call
            if tc is not None:
                entry = open_calls.get(tc.index)
                if entry is None or (tc.id is not None and entry[0] is not None and tc.id != entry[0]):
                    entry = open_calls[tc.index] = [tc.id, tc.name or "", []]  # (an index reused: a new call)
                    calls.append(entry)
                elif tc.name and not entry[1]:
                    entry[1] = tc.name
                entry[2].append(tc.arguments)
            if chunk.usage is not None:
                usage = chunk.usage  # providers report cumulative usage: the last one wins
            if chunk.model:
                response_model = chunk.model
    finally:
        await aclose(it)  # also on cancellation: the model's request ends here
    content: list[Block] = []
    if thinking or signature:  # a signature alone is opaque reasoning, carried all the same
        content.append(ThinkingBlock(thinking="".join(thinking), signature="".join(signature) or None))
    if texts:
        content.append(TextBlock(text="".join(texts)))
    for call_id, name, parts in calls:
        content.append(tool_use_block(call_id or new_id("call_"), name, "".join(parts)))
    reason = GenerateReason.TOOL_CALLS if calls else GenerateReason.MODEL_STOP
    if span is not None:
        _record(span, usage, response_model)
    return Msg(role="assistant", content=content, usage=usage, generate_reason=reason)


def _tracing_middleware(agent: Any) -> OtelTracingMiddleware | None:
    # Without the tracing module loaded, no agent can have the middleware: OTel is never imported.
    module = sys.modules.get("agentscope_py.middleware.observability.tracing")
    if module is None:
        return None
    for mw in agent.middlewares_at(ExtensionPoint.ON_MODEL_CALL):
        if isinstance(mw, module.OtelTracingMiddleware):
            found: OtelTracingMiddleware = mw
            return found
    return None


async def _traced(
    tracing: OtelTracingMiddleware, model: ChatModel, request: ModelRequest, ctx: RuntimeContext, purpose: str
) -> Msg:
    from opentelemetry.trace import SpanKind

    from ._otel_conventions import CONVERSATION_ID, MESSAGE_COUNT, OPERATION, PROVIDER, REQUEST_MODEL, TOOL_COUNT

    name = str(getattr(model, "name", None) or "unknown")

    def attributes() -> dict[str, Any]:
        return {
            OPERATION: "chat",
            PROVIDER: model_provider(model),
            REQUEST_MODEL: name,
            CONVERSATION_ID: ctx.session_id,
            MESSAGE_COUNT: len(request.messages),
            TOOL_COUNT: len(request.tools),
            INTERNAL: True,
            PURPOSE: purpose,
        }

    # A child of the span current here (the caller's context): no context is attached, so nothing
    # leaks into the caller's task.
    span = tracing._start(f"chat {name} ({purpose})", SpanKind.CLIENT, attributes)
    if span is None:
        return await _collect(model, request)
    outcome: BaseException | None = None
    try:
        return await _collect(model, request, span)
    except BaseException as exc:
        outcome = exc
        raise
    finally:
        tracing._end(span, outcome)


def _record(span: Any, usage: ChatUsage | None, response_model: str | None) -> None:
    from ._otel_conventions import RESPONSE_MODEL
    from ._otel_records import set_usage

    try:
        if usage is not None:
            set_usage(span, usage)
        if response_model:
            span.set_attribute(RESPONSE_MODEL, response_model)
    except Exception:  # a broken span must not fail the call (as in the tracing middleware)
        pass
