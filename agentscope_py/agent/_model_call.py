"""The innermost model call: chunks into events, in the model call's own task.

`model_events` streams the model (retrying and failing over before the first chunk) and puts
ModelCallStart, the block Start/Delta/End events and ModelCallEnd into the call's prefetch
buffer (`stream.prefetched(push=True)`: it runs as the producer, in its own task). Text and
thinking deltas cross that buffer as the chunk's ``str``; `delta_maker`, the consumer's half,
makes their events in the run's task. Both halves of that trick live here.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from .._sanitize import SurrogateCarry, clean
from ..errors import AgentInterrupted
from ..events import (
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
    trusted,
)
from ..message import (
    ChatUsage,
    new_id,
    trusted_binder,
)
from ..model.base import ChatChunk, ChatModel, ModelError, ModelRequest
from ..stream import Channel
from ._brackets import describe
from ._session import RunControl

__all__ = ["FailoverListener", "RetryPolicy", "delta_maker", "model_events"]

# Events built from values made here, or from ChatChunk fields (typed by the ChatModel protocol),
# skip validation (`events.trusted`: the same objects at half the cost). The model's name and its
# usage are checked: a provider may hand over something a validator would convert or reject.
_ModelCallStart = trusted(ModelCallStart, "reply_id", "model")
_ModelCallEnd = trusted(ModelCallEnd, "reply_id", "usage", "finish_reason")
_TextBlockStart = trusted(TextBlockStart, "reply_id", "block_id")
# A block's deltas share its reply and block ids: a maker per block copies a dict that has them.
_bind_text_delta = trusted_binder(TextBlockDelta, ("reply_id", "block_id"), ("delta",))
_bind_thinking_delta = trusted_binder(ThinkingBlockDelta, ("reply_id", "block_id"), ("delta",))
_TextBlockEnd = trusted(TextBlockEnd, "reply_id", "block_id")
_ThinkingBlockStart = trusted(ThinkingBlockStart, "reply_id", "block_id")
_ThinkingBlockEnd = trusted(ThinkingBlockEnd, "reply_id", "block_id", "signature")
_ToolCallStart = trusted(ToolCallStart, "reply_id", "tool_call_id", "tool_name")
_ToolCallDelta = trusted(ToolCallDelta, "reply_id", "tool_call_id", "tool_name", "delta")
_ToolCallEnd = trusted(ToolCallEnd, "reply_id", "tool_call_id", "tool_name")


FailoverListener = Callable[[ChatModel, BaseException, ChatModel], Any]


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


async def model_events(
    models: Sequence[ChatModel],
    request: ModelRequest,
    reply_id: str,
    policy: RetryPolicy,
    on_failover: FailoverListener | None,
    control: RunControl | None,
    out: Channel,
) -> None:
    """Put the block events of one model call into ``out`` (the model call's prefetch buffer: this
    runs as the prefetch's producer, in the model call's own task). Nothing is emitted until the
    first chunk arrives, so a failure before it can be retried or failed over (here, or by a
    middleware) cleanly.

    A text or thinking delta is emitted as the chunk's ``str``; on the consumer's side of the
    prefetch, a `delta_maker` makes its event. A consumer slower than the model (a loaded
    server) then buffers strings, not events, and each event lives only from its making to its
    use. The events of one chunk go in together; then, if the buffer is full, this waits for
    room.

    With ``control`` (the run's interrupt switch), the task running this is registered for the
    call's lifetime, so an interrupt cancels it, and that cancellation surfaces as
    `AgentInterrupted`."""
    task = _register(control)
    try:
        if control is not None:
            control.check()
        model = models[0]
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
        if control is not None and control.interrupted:
            raise AgentInterrupted("the model call was interrupted") from None
        raise
    except BaseException:
        _unregister(control, task)
        raise
    items, size = out.items, out.size
    put = items.append
    text_id: str | None = None
    thinking_id: str | None = None
    signature: str | None = None
    # Text crosses as it came, except that a surrogate pair a provider split across two chunks is
    # joined and a lone half replaced (`_sanitize`): non-ASCII text only, through a carry per kind.
    text_carry: SurrogateCarry | None = None
    thinking_carry: SurrogateCarry | None = None
    calls: dict[int, tuple[str, str]] = {}  # index -> (id, name), open tool calls in order
    usage: ChatUsage | None = None
    finish: str | None = None
    started = False
    try:
        model_name = model.name
        make_start = _ModelCallStart if type(model_name) is str else ModelCallStart
        put(make_start(reply_id=reply_id, model=model_name))
        started = True
        while chunk is not None:
            thinking = chunk.thinking
            if thinking:
                if thinking_id is None:
                    if text_id is not None:
                        _end_text(put, reply_id, text_id, text_carry)
                        text_id = None
                    thinking_id = new_id("blk_")
                    put(_ThinkingBlockStart(reply_id=reply_id, block_id=thinking_id))
                if not thinking.isascii():
                    thinking_carry = thinking_carry or SurrogateCarry()
                    thinking = thinking_carry.feed(thinking)
                if thinking:
                    put(thinking)  # made into its event on the consumer's side (delta_maker)
            if chunk.thinking_signature:
                signature = (signature or "") + chunk.thinking_signature
            text = chunk.text
            if text:
                if text_id is None:
                    if thinking_id is not None:
                        _end_thinking(put, reply_id, thinking_id, signature, thinking_carry)
                        thinking_id, signature = None, None
                    text_id = new_id("blk_")
                    put(_TextBlockStart(reply_id=reply_id, block_id=text_id))
                if not text.isascii():
                    text_carry = text_carry or SurrogateCarry()
                    text = text_carry.feed(text)
                if text:
                    put(text)  # the same
            tc = chunk.tool_call
            if tc is not None:
                if thinking_id is not None:
                    _end_thinking(put, reply_id, thinking_id, signature, thinking_carry)
                    thinking_id, signature = None, None
                if text_id is not None:
                    _end_text(put, reply_id, text_id, text_carry)
                    text_id = None
                known = calls.get(tc.index)
                if known is None or (tc.id is not None and tc.id != known[0]):
                    if known is not None:  # a provider reusing an index for a new call
                        put(_ToolCallEnd(reply_id=reply_id, tool_call_id=known[0], tool_name=known[1]))
                    known = (tc.id or new_id("call_"), tc.name or "")
                    calls[tc.index] = known
                    put(_ToolCallStart(reply_id=reply_id, tool_call_id=known[0], tool_name=known[1]))
                if tc.arguments:
                    put(_ToolCallDelta(
                        reply_id=reply_id, tool_call_id=known[0], tool_name=known[1], delta=clean(tc.arguments)
                    ))
            if chunk.usage is not None:
                usage = chunk.usage  # providers report cumulative usage: the last one wins
            if chunk.finish_reason is not None:
                finish = chunk.finish_reason
            if out.waiter is not None and items:  # (a chunk with usage only adds nothing)
                out.wake()
            if len(items) >= size:
                await out.room()
            try:
                chunk = await it.__anext__()
            except StopAsyncIteration:
                chunk = None
        if thinking_id is not None:
            _end_thinking(put, reply_id, thinking_id, signature, thinking_carry)
        if text_id is not None:
            if text_carry is not None and text_carry.held:
                put(text_carry.flush())
            put(_TextBlockEnd(reply_id=reply_id, block_id=text_id))
        for call_id, name in calls.values():
            put(_ToolCallEnd(reply_id=reply_id, tool_call_id=call_id, tool_name=name))
        make_end = _ModelCallEnd if usage is None or type(usage) is ChatUsage else ModelCallEnd
        put(make_end(reply_id=reply_id, usage=usage, finish_reason=finish))
    except BaseException as exc:
        error = exc
        interrupted = isinstance(exc, asyncio.CancelledError) and control is not None and control.interrupted
        if interrupted:
            error = AgentInterrupted("the model call was interrupted")
        if started:
            # The closing guarantee (`_brackets`): this call's open blocks end, and ModelCallEnd
            # says why, before the error goes out. Put without waiting: after a cancellation nobody
            # may be reading, and the consumer takes these before it sees the error.
            if thinking_id is not None:
                put(_ThinkingBlockEnd(reply_id=reply_id, block_id=thinking_id, signature=signature))
            if text_id is not None:
                put(_TextBlockEnd(reply_id=reply_id, block_id=text_id))
            for call_id, name in calls.values():
                put(_ToolCallEnd(reply_id=reply_id, tool_call_id=call_id, tool_name=name))
            put(ModelCallEnd(reply_id=reply_id, usage=usage, error=describe(error), discarded=not interrupted))
        if error is exc:
            raise
        raise error from None
    finally:
        try:
            await _close(it)
        finally:
            _unregister(control, task)


def _end_text(put: Callable[[Any], None], reply_id: str, block_id: str, carry: SurrogateCarry | None) -> None:
    if carry is not None and carry.held:
        put(carry.flush())
    put(_TextBlockEnd(reply_id=reply_id, block_id=block_id))


def _end_thinking(
    put: Callable[[Any], None], reply_id: str, block_id: str, signature: str | None, carry: SurrogateCarry | None
) -> None:
    if carry is not None and carry.held:
        put(carry.flush())
    put(_ThinkingBlockEnd(reply_id=reply_id, block_id=block_id, signature=signature))


def delta_maker(start: TextBlockStart | ThinkingBlockStart) -> Callable[[str], AgentEvent]:
    """The consumer's half of `model_events` (its prefetch's ``make``): what makes the events of
    the text or thinking deltas that follow ``start``, which leave the model's task as the
    chunk's ``str``. ``start`` is the item before the run of deltas it belongs to, always its
    block's Start: `model_events` opens a block only after closing the other kind, and a tool call
    closes both."""
    bind = _bind_text_delta if type(start) is TextBlockStart else _bind_thinking_delta
    return bind(reply_id=start.reply_id, block_id=start.block_id)


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
