"""The innermost model call: chunks into events.

`model_call_stream` is the model call as a stream: a stepped prefetch whose producer,
`ModelEvents`, streams the model (retrying and failing over before the first chunk) and puts
ModelCallStart, the block Start/Delta/End events and ModelCallEnd into the prefetch buffer, a
chunk per step. The steps run in the consumer's task while it waits for the next event (the
common case: no task hop per token), and in a task of their own once the consumer has been away
for a loop turn (`_stream.concurrent.Prefetch`, ``steps``).

Text and thinking deltas cross that buffer as the chunk's ``str`` with the block's delta maker,
``(make, text)``, not as events: a consumer slower than the model (a loaded server) then buffers
strings, and each delta event is made just before it is used, in the consumer's task (the
prefetch's ``deferred`` items). What crosses as a string, and how its event is made, is decided
here and nowhere else: the prefetch only calls ``make(text)``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any

from .._deadline import Deadline, DeadlineTimer
from .._fast_events import delta_maker as fast_delta
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
)
from ..message import ChatUsage, new_id
from ..model.base import ChatChunk, ChatModel, ModelRequest
from ..stream import Channel, EventStream, prefetched
from ._brackets import describe
from ._model_retry import FailoverListener, RetryPolicy, close_quietly, recover
from ._session import RunControl

__all__ = ["FailoverListener", "ModelEvents", "ModelExecutor", "RetryPolicy", "model_call_stream"]

ModelExecutor = Callable[
    [Sequence[ChatModel], ModelRequest, str, RunControl, Deadline | None], EventStream[AgentEvent]]
"""What runs a model call instead of `model_call_stream` (``models``, the request, the reply id,
the run's control, the deadline): `AgentRuntime.model_executor`."""


def model_call_stream(
    models: Sequence[ChatModel],
    request: ModelRequest,
    reply_id: str,
    policy: RetryPolicy,
    on_failover: FailoverListener | None,
    control: RunControl | None,
    deadline: Deadline | None = None,
) -> EventStream[AgentEvent]:
    """The events of one model call (``models[0]``, then its fallbacks), its producer stepped in
    the context current *now* (so a span opened around the innermost ``next()`` parents the model
    call) at each subscription. See `ModelEvents`."""
    # A partial, not a lambda: no closure cells for the call to keep alive.
    source = functools.partial(ModelEvents, models, request, reply_id, policy, on_failover, control, deadline)
    return prefetched(source, deferred=True, steps=True)


_current_task = asyncio.current_task


class ModelEvents:
    """One model call's events into ``out`` (its prefetch buffer), a chunk per `step`: the one
    implementation of the model call's semantics, whichever task steps it (`model_call_stream`).

    Nothing is emitted until the first chunk arrives, so a failure before it can be retried or
    failed over (here, `_recover`, or by a middleware) cleanly. A text or thinking delta is put
    as the chunk's ``str`` with its block's maker (a deferred item, ``(make, text)``); on the
    consumer's side of the prefetch, ``make(text)`` makes its event. A consumer slower than the
    model (a loaded server) then buffers strings, not events, and each event lives only from its
    making to its use. The events of one chunk go in together. A failure after the first chunk
    ends this call's open blocks and puts ModelCallEnd saying why before it goes out (the closing
    guarantee, `_brackets`).

    **Where a cancellation may land: only inside a step's read** (the wait for room, the
    provider's next chunk). The task reading — the consumer's, or the prefetch's own — is the one
    the run's interrupt (``control``) and the ``deadline`` cancel, and only while it reads:

    * it is registered with ``control`` for the read; an interrupt cancels it there, this takes
      the cancellation back (``uncancel``, as ``asyncio.timeout`` does) and the call fails with
      `AgentInterrupted`. An interrupt while nobody reads (the consumer busy with an event) only
      marks the control, and the next step fails the call;
    * the deadline's timer (`DeadlineTimer`) is pointed at it for the read, likewise: cancelled
      there and taken back, `ModelTimeoutError`; passed while nobody reads, it marks the call,
      and the next step fails it. A call that has ended (its last event put) never fails;
    * any other cancellation of the reading task (the consumer's own) is not taken back: the
      provider's stream closes and the cancellation goes on."""

    __slots__ = (
        "calls", "control", "finish", "it", "model", "models", "on_failover", "opened", "out", "policy",
        "reply_id", "request", "signature", "started", "text_carry", "text_id", "text_make", "thinking_carry",
        "thinking_id", "thinking_make", "timer", "usage",
    )

    def __init__(
        self, models: Sequence[ChatModel], request: ModelRequest, reply_id: str, policy: RetryPolicy,
        on_failover: FailoverListener | None, control: RunControl | None, deadline: Deadline | None, out: Channel,
    ) -> None:
        self.models, self.request, self.reply_id = models, request, reply_id
        self.policy, self.on_failover, self.control, self.out = policy, on_failover, control, out
        self.model = models[0]
        self.timer: DeadlineTimer | None = None
        if deadline is not None:
            self.timer = DeadlineTimer(deadline.total, deadline.first_event)
            self.timer.task = None  # pointed at the reading task only while it reads
        self.it: Any = None
        self.opened = False  # the first read done
        self.started = False  # ModelCallStart put
        self.text_id: str | None = None
        self.thinking_id: str | None = None
        # The open blocks' delta makers: a delta crosses as (make, text), made on the consumer's side.
        self.text_make: Callable[[str], TextBlockDelta] | None = None
        self.thinking_make: Callable[[str], ThinkingBlockDelta] | None = None
        self.signature: str | None = None
        # Text crosses as it came, except that a surrogate pair a provider split across two chunks
        # is joined and a lone half replaced (`_sanitize`): non-ASCII text only, a carry per kind.
        self.text_carry: SurrogateCarry | None = None
        self.thinking_carry: SurrogateCarry | None = None
        # index -> (id, name, delta maker), the open tool calls in order
        self.calls: dict[int, tuple[str, str, Callable[[str], ToolCallDelta]]] = {}
        self.usage: ChatUsage | None = None
        self.finish: str | None = None

    async def step(self) -> bool:
        """Read the next chunk and put its events; False once the call has ended (its last event
        put, the provider's stream closed). A failure puts the closing events and raises."""
        out, control, timer = self.out, self.control, self.timer
        try:
            if control is not None and control.interrupted:  # (marked while nobody read)
                raise AgentInterrupted("the model call was interrupted" if self.opened else "the run was interrupted")
            if timer is not None and timer.expired:  # likewise
                raise timer.error(self.model)
            # The read: the only place this call's interrupt or deadline cancels (see the class).
            task = _current_task()
            assert task is not None
            tasks = None if control is None or task in control.tasks else control.tasks
            if tasks is not None:
                tasks.add(task)
            if timer is not None:
                timer.task = task
            entry = task.cancelling()
            caught: BaseException | None = None
            chunk: ChatChunk | None = None
            try:
                if len(out.items) >= out.size:  # (only a task ahead of its consumer finds it full)
                    await out.room()
                if self.opened:
                    chunk = await self.it.__anext__()
                else:
                    chunk = await self._open()
            except StopAsyncIteration:
                chunk = None
            except BaseException as exc:
                caught = exc
            ours = 0
            if tasks is not None:
                tasks.discard(task)
                if control is not None and control.interrupted:  # it cancelled this task, once
                    ours = 1
            if timer is not None:
                timer.task = None
                if timer.cancelled is task:
                    timer.cancelled = None
                    ours += 1
            if ours:
                left = entry
                for _ in range(ours):
                    left = task.uncancel()
                if left <= entry and (caught is None or isinstance(caught, asyncio.CancelledError)):
                    if control is not None and control.interrupted:
                        caught = AgentInterrupted("the model call was interrupted")
                    else:
                        assert timer is not None
                        caught = timer.error(self.model)
            if caught is not None:
                raise caught
            put = out.items.append
            if not self.started:
                if timer is not None:
                    timer.first_arrived()
                put(ModelCallStart(reply_id=self.reply_id, model=self.model.name))
                self.started = True
            if chunk is None:
                self._end(put)
            else:  # the chunk's events
                reply_id = self.reply_id
                thinking = chunk.thinking
                if thinking:
                    if self.thinking_id is None:
                        if self.text_id is not None:
                            _end_text(put, reply_id, self.text_id, self.text_carry, self.text_make)
                            self.text_id = None
                        self.thinking_id = block_id = new_id("blk_")
                        self.thinking_make = fast_delta(ThinkingBlockDelta, reply_id=reply_id, block_id=block_id)
                        put(ThinkingBlockStart(reply_id=reply_id, block_id=block_id))
                    if not thinking.isascii():
                        self.thinking_carry = self.thinking_carry or SurrogateCarry()
                        thinking = self.thinking_carry.feed(thinking)
                    if thinking:
                        put((self.thinking_make, thinking))  # its event is made on the consumer's side
                if chunk.thinking_signature:
                    self.signature = (self.signature or "") + chunk.thinking_signature
                text = chunk.text
                if text:
                    if self.text_id is None:
                        if self.thinking_id is not None:
                            self._end_thinking(put)
                        self.text_id = block_id = new_id("blk_")
                        self.text_make = fast_delta(TextBlockDelta, reply_id=reply_id, block_id=block_id)
                        put(TextBlockStart(reply_id=reply_id, block_id=block_id))
                    if not text.isascii():
                        self.text_carry = self.text_carry or SurrogateCarry()
                        text = self.text_carry.feed(text)
                    if text:
                        put((self.text_make, text))  # the same
                tc = chunk.tool_call
                if tc is not None:
                    if self.thinking_id is not None:
                        self._end_thinking(put)
                    if self.text_id is not None:
                        _end_text(put, reply_id, self.text_id, self.text_carry, self.text_make)
                        self.text_id = None
                    calls = self.calls
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
                    self.usage = chunk.usage  # providers report cumulative usage: the last one wins
                if chunk.finish_reason is not None:
                    self.finish = chunk.finish_reason
                if out.waiter is not None and out.items:  # (a chunk with usage only adds nothing)
                    out.wake()
                return True
        except BaseException as exc:
            self._failed(exc)
            await self._release()
            raise
        await self._release()
        return False

    async def _open(self) -> ChatChunk | None:
        """The first chunk: ``models[0]``'s, or after retries and fallbacks (`_recover`)."""
        self.opened = True
        it: Any = None
        try:
            it = self.it = self.model.stream(self.request).__aiter__()
            return await it.__anext__()  # type: ignore[no-any-return]
        except StopAsyncIteration:
            return None
        except Exception as exc:  # retries and fallback live off the common path
            if it is not None:
                self.it = None
                await close_quietly(it)
            self.model, self.it, chunk = await recover(self.models, self.request, self.policy, self.on_failover, exc)
            return chunk

    def _end_thinking(self, put: Callable[[Any], None]) -> None:
        assert self.thinking_id is not None
        if self.thinking_carry is not None and self.thinking_carry.held:
            put((self.thinking_make, self.thinking_carry.flush()))
        put(ThinkingBlockEnd(reply_id=self.reply_id, block_id=self.thinking_id, signature=self.signature))
        self.thinking_id, self.signature = None, None

    def _end(self, put: Callable[[Any], None]) -> None:
        """The provider's stream ended: the open blocks' ends, then ModelCallEnd."""
        reply_id = self.reply_id
        if self.thinking_id is not None:
            self._end_thinking(put)
        if self.text_id is not None:
            _end_text(put, reply_id, self.text_id, self.text_carry, self.text_make)
            self.text_id = None
        for call_id, name, _ in self.calls.values():
            put(ToolCallEnd(reply_id=reply_id, tool_call_id=call_id, tool_name=name))
        self.calls = {}
        put(ModelCallEnd(reply_id=reply_id, usage=self.usage, finish_reason=self.finish))

    def _failed(self, error: BaseException) -> None:
        """``error`` ends the call (a cancellation by its interrupt or deadline is typed already,
        in `step`; any other stays what it is): the closing events, when it had started."""
        if self.started:
            # The closing guarantee (`_brackets`): this call's open blocks end, and ModelCallEnd
            # says why, before the error goes out. Put without waiting: after a cancellation nobody
            # may be reading, and the consumer takes these before it sees the error.
            put, reply_id = self.out.items.append, self.reply_id
            if self.thinking_id is not None:
                put(ThinkingBlockEnd(reply_id=reply_id, block_id=self.thinking_id, signature=self.signature))
            if self.text_id is not None:
                put(TextBlockEnd(reply_id=reply_id, block_id=self.text_id))
            for call_id, name, _ in self.calls.values():
                put(ToolCallEnd(reply_id=reply_id, tool_call_id=call_id, tool_name=name))
            interrupted = isinstance(error, AgentInterrupted)
            put(ModelCallEnd(reply_id=reply_id, usage=self.usage, error=describe(error), discarded=not interrupted))
            self.started = False  # (closed: nothing more is put)

    async def _release(self) -> None:
        """The call has ended: its deadline disarmed (before the close awaits: a deadline passing
        now must not cancel it), the provider's stream closed."""
        if self.timer is not None:
            self.timer.stop()
        it, self.it = self.it, None
        await close_quietly(it)

    async def close(self) -> None:
        """The consumer left between steps, for good: the provider's stream closes."""
        await self._release()


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
