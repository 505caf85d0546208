"""The innermost model call: chunks into events, in the model call's own task.

`model_call_stream` is the model call as a stream: a prefetch whose producer, `model_events`,
streams the model (retrying and failing over before the first chunk) and puts ModelCallStart,
the block Start/Delta/End events and ModelCallEnd into the prefetch buffer, in a task of its own.

Text and thinking deltas cross that buffer as the chunk's ``str`` with the block's delta maker,
``(make, text)``, not as events: a consumer slower than the model (a loaded server) then buffers
strings, and each delta event is made just before it is used, in the consumer's task (the
prefetch's ``deferred`` items). What crosses as a string, and how its event is made, is decided
here and nowhere else: the prefetch only calls ``make(text)``.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from ._bracket_kinds import describe
from ._control import RunControl
from ._deadline import Deadline, DeadlineTimer
from ._fast_events import delta_maker as fast_delta
from ._sanitize import SurrogateCarry, clean
from .errors import AgentInterrupted
from .events import (
    AgentEvent,
    ModelCallEnd,
    ModelCallStart,
    TextBlockDelta,
    TextBlockEnd,
    TextBlockStart,
    ThinkingBlockDelta,
    ThinkingBlockEnd,
    ThinkingBlockStart,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)
from .message import ChatUsage, new_id
from .model.base import ChatChunk, ChatModel, ModelError, ModelRequest
from .stream import Channel, EventStream, prefetched

__all__ = ["FailoverListener", "ModelExecutor", "RetryPolicy", "model_call_stream", "model_events"]

FailoverListener = Callable[[ChatModel, BaseException, ChatModel], Any]
ModelExecutor = Callable[
    [Sequence[ChatModel], ModelRequest, str, RunControl, Deadline | None], EventStream[AgentEvent]]
"""What runs a model call instead of `model_call_stream` (``models``, the request, the reply id,
the run's control, the deadline): `AgentRuntime.model_executor`."""


class RetryPolicy:
    """Retries of retryable errors that happen before the first chunk: exponential backoff with
    full jitter, honouring the provider's retry-after."""

    __slots__ = ("base_delay", "max_delay", "max_retries")

    def __init__(self, max_retries: int = 0, base_delay: float = 0.5, max_delay: float = 20.0) -> None:
        self.max_retries = max_retries
        self.base_delay = base_delay
        self.max_delay = max_delay

    def delay(self, attempt: int, error: BaseException) -> float:
        hint = getattr(error, "retry_after", None)
        if isinstance(hint, int | float) and hint >= 0:
            return min(float(hint), self.max_delay)
        return random.uniform(0, min(self.max_delay, self.base_delay * (2**attempt)))


def _retryable(error: BaseException) -> bool:
    return isinstance(error, ModelError) and error.retryable


async def _recover(
    models: Sequence[ChatModel],
    request: ModelRequest,
    policy: RetryPolicy,
    on_failover: FailoverListener | None,
    error: Exception,
) -> tuple[ChatModel, AsyncIterator[ChatChunk], ChatChunk | None]:
    """The first attempt (``models[0]``) failed with ``error``: retry retryable errors as the
    policy says, then fail over to the next model, until one produces a chunk (or ends cleanly)."""
    i, attempt = 0, 0
    while True:
        if _retryable(error) and attempt < policy.max_retries:
            await asyncio.sleep(policy.delay(attempt, error))
            attempt += 1
        elif i + 1 < len(models):
            if on_failover is not None:
                on_failover(models[i], error, models[i + 1])
            i, attempt = i + 1, 0
        else:
            raise error
        model = models[i]
        it: AsyncIterator[ChatChunk] | None = None
        try:
            it = model.stream(request).__aiter__()
            return model, it, await it.__anext__()
        except StopAsyncIteration:
            assert it is not None
            return model, it, None
        except Exception as exc:
            if it is not None:
                await _close(it)
            error = exc


async def _close(it: Any) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        try:  # noqa: SIM105 - cheaper than contextlib.suppress, once per model call
            await close()
        except Exception:
            pass


def model_call_stream(
    models: Sequence[ChatModel],
    request: ModelRequest,
    reply_id: str,
    policy: RetryPolicy,
    on_failover: FailoverListener | None,
    control: RunControl | None,
    deadline: Deadline | None = None,
) -> EventStream[AgentEvent]:
    """The events of one model call (``models[0]``, then its fallbacks), produced in a task of
    their own that starts at each subscription, in the context current *now* (so a span opened
    around the innermost ``next()`` parents the model call). See `model_events`."""
    # A partial, not a lambda: no closure cells for the call to keep alive.
    source = functools.partial(model_events, models, request, reply_id, policy, on_failover, control, deadline)
    return prefetched(source, push=True, deferred=True)


async def model_events(
    models: Sequence[ChatModel],
    request: ModelRequest,
    reply_id: str,
    policy: RetryPolicy,
    on_failover: FailoverListener | None,
    control: RunControl | None,
    deadline: Deadline | None,
    out: Channel,
) -> None:
    """Put the block events of one model call into ``out`` (the model call's prefetch buffer: this
    runs as the prefetch's producer, in the model call's own task). Nothing is emitted until the
    first chunk arrives, so a failure before it can be retried or failed over (here, or by a
    middleware) cleanly.

    A text or thinking delta is emitted as the chunk's ``str`` with its block's maker (a deferred
    item, ``(make, text)``); on the consumer's side of the prefetch, ``make(text)`` makes its
    event. A consumer slower than the model (a loaded server) then buffers strings, not events,
    and each event lives only from its making to its use. The events of one chunk go in
    together; then, if the buffer is full, this waits for room.

    With ``control`` (the run's interrupt switch), the task running this is registered for the
    call's lifetime, so an interrupt cancels it, and that cancellation surfaces as
    `AgentInterrupted`.

    With a ``deadline`` (`_deadline`), a timer in this task keeps it: when it passes, the task is
    cancelled (the provider's stream closes) and the call fails with `ModelTimeoutError`."""
    task = _register(control)
    timer = None if deadline is None else DeadlineTimer(deadline.total, deadline.first_event)
    model = models[0]
    try:
        if control is not None:
            control.check()
        it: Any = None
        try:
            it = model.stream(request).__aiter__()
            chunk: ChatChunk | None = await it.__anext__()
        except StopAsyncIteration:
            chunk = None
        except Exception as exc:  # retries and fallback live off the common path
            if it is not None:
                await _close(it)
            model, it, chunk = await _recover(models, request, policy, on_failover, exc)
    except asyncio.CancelledError:
        _unregister(control, task)
        timed_out = timer is not None and timer.stop()
        if control is not None and control.interrupted:
            raise AgentInterrupted("the model call was interrupted") from None
        if timed_out and timer is not None:
            raise timer.error(model) from None
        raise
    except BaseException:
        _unregister(control, task)
        if timer is not None:
            timer.stop()
        raise
    if timer is not None:
        timer.first_arrived()
    items, size = out.items, out.size
    put = items.append
    text_id: str | None = None
    thinking_id: str | None = None
    # The open blocks' delta makers: a delta crosses as (make, text), made on the consumer's side.
    text_make: Callable[[str], TextBlockDelta] | None = None
    thinking_make: Callable[[str], ThinkingBlockDelta] | None = None
    signature: str | None = None
    # Text crosses as it came, except that a surrogate pair a provider split across two chunks is
    # joined and a lone half replaced (`_sanitize`): non-ASCII text only, through a carry per kind.
    text_carry: SurrogateCarry | None = None
    thinking_carry: SurrogateCarry | None = None
    # index -> (id, name, delta maker), the open tool calls in order
    calls: dict[int, tuple[str, str, Callable[[str], ToolCallDelta]]] = {}
    usage: ChatUsage | None = None
    finish: str | None = None
    started = False
    try:
        put(ModelCallStart(reply_id=reply_id, model=model.name))
        started = True
        while chunk is not None:
            thinking = chunk.thinking
            # A signature alone opens its block too: reasoning a provider keeps opaque (an
            # encrypted Responses reasoning item without a summary) still has to be carried.
            if thinking or (chunk.thinking_signature and thinking_id is None):
                if thinking_id is None:
                    if text_id is not None:
                        _end_text(put, reply_id, text_id, text_carry, text_make)
                        text_id = None
                    thinking_id = new_id("blk_")
                    thinking_make = fast_delta(ThinkingBlockDelta, reply_id=reply_id, block_id=thinking_id)
                    put(ThinkingBlockStart(reply_id=reply_id, block_id=thinking_id))
                if thinking:
                    if not thinking.isascii():
                        thinking_carry = thinking_carry or SurrogateCarry()
                        thinking = thinking_carry.feed(thinking)
                    if thinking:
                        put((thinking_make, thinking))  # its event is made on the consumer's side
            if chunk.thinking_signature:
                signature = (signature or "") + chunk.thinking_signature
            text = chunk.text
            if text:
                if text_id is None:
                    if thinking_id is not None:
                        _end_thinking(put, reply_id, thinking_id, signature, thinking_carry, thinking_make)
                        thinking_id, signature = None, None
                    text_id = new_id("blk_")
                    text_make = fast_delta(TextBlockDelta, reply_id=reply_id, block_id=text_id)
                    put(TextBlockStart(reply_id=reply_id, block_id=text_id))
                if not text.isascii():
                    text_carry = text_carry or SurrogateCarry()
                    text = text_carry.feed(text)
                if text:
                    put((text_make, text))  # the same
            tc = chunk.tool_call
            if tc is not None:
                if thinking_id is not None:
                    _end_thinking(put, reply_id, thinking_id, signature, thinking_carry, thinking_make)
                    thinking_id, signature = None, None
                if text_id is not None:
                    _end_text(put, reply_id, text_id, text_carry, text_make)
                    text_id = None
                known = calls.get(tc.index)
                if known is None or (tc.id is not None and tc.id != known[0]):
                    if known is not None:  # a provider reusing an index for a new call
                        put(ToolCallEnd(reply_id=reply_id, tool_call_id=known[0], tool_name=known[1]))
                    call_id, name = tc.id or new_id("call_"), tc.name or ""
                    known = calls[tc.index] = (call_id, name, fast_delta(
                        ToolCallDelta, reply_id=reply_id, tool_call_id=call_id, tool_name=name))
                    put(ToolCallStart(reply_id=reply_id, tool_call_id=call_id, tool_name=name))
                if tc.arguments:
                    put(known[2](clean(tc.arguments)))
            if chunk.usage is not None:
                usage = chunk.usage  # providers report cumulative usage: the last one wins
            if chunk.finish_reason is not None:
                finish = chunk.finish_reason
            waiter = out.waiter
            if waiter is not None and items:  # (a chunk with usage only adds nothing)
                out.waiter = None  # Channel.wake(), inlined: a call less per token
                if not waiter.done():
                    waiter.set_result(None)
            if len(items) >= size:
                await out.room()
            try:
                chunk = await it.__anext__()
            except StopAsyncIteration:
                chunk = None
        if thinking_id is not None:
            _end_thinking(put, reply_id, thinking_id, signature, thinking_carry, thinking_make)
        if text_id is not None:
            _end_text(put, reply_id, text_id, text_carry, text_make)
        for call_id, name, _ in calls.values():
            put(ToolCallEnd(reply_id=reply_id, tool_call_id=call_id, tool_name=name))
        put(ModelCallEnd(reply_id=reply_id, usage=usage, finish_reason=finish, model=model.name))
    except BaseException as exc:
        error = exc
        cancelled = isinstance(exc, asyncio.CancelledError)
        interrupted = cancelled and control is not None and control.interrupted
        if interrupted:
            error = AgentInterrupted("the model call was interrupted")
        elif cancelled and timer is not None and timer.expired:
            error = timer.error(model)
        if started:
            # The closing guarantee (`_brackets`): this call's open blocks end, and ModelCallEnd
            # says why, before the error goes out. Put without waiting: after a cancellation nobody
            # may be reading, and the consumer takes these before it sees the error.
            if thinking_id is not None:
                put(ThinkingBlockEnd(reply_id=reply_id, block_id=thinking_id, signature=signature))
            if text_id is not None:
                put(TextBlockEnd(reply_id=reply_id, block_id=text_id))
            for call_id, name, _ in calls.values():
                put(ToolCallEnd(reply_id=reply_id, tool_call_id=call_id, tool_name=name))
            put(ModelCallEnd(reply_id=reply_id, usage=usage, error=describe(error), discarded=not interrupted,
                             model=model.name))
        if error is exc:
            raise
        raise error from None
    finally:
        if timer is not None:
            timer.stop()  # before the close awaits: a deadline passing now must not cancel it
        try:
            await _close(it)
        finally:
            _unregister(control, task)


def _end_text(
    put: Callable[[Any], None], reply_id: str, block_id: str, carry: SurrogateCarry | None, make: Any,
) -> None:
    if carry is not None and carry.held:
        put((make, carry.flush()))
    put(TextBlockEnd(reply_id=reply_id, block_id=block_id))


def _end_thinking(
    put: Callable[[Any], None], reply_id: str, block_id: str, signature: str | None, carry: SurrogateCarry | None,
    make: Any,
) -> None:
    if carry is not None and carry.held:
        put((make, carry.flush()))
    put(ThinkingBlockEnd(reply_id=reply_id, block_id=block_id, signature=signature))


def _register(control: RunControl | None) -> asyncio.Task[Any] | None:
    if control is None:
        return None
    task = asyncio.current_task()
    assert task is not None
    control.tasks.add(task)
    return task


def _unregister(control: RunControl | None, task: asyncio.Task[Any] | None) -> None:
    if control is not None and task is not None:
        control.tasks.discard(task)
