"""The innermost model call, read in its consumer's task.

`model_call_stream` is the model call as a stream (`ModelCall`, its factory), for the
``on_model_call`` chain to compose; `model_call_events` is its one subscription, for a loop that
reads the call itself. Each subscription is one async generator, `model_events`, which reads the
model (retrying and failing over before the first chunk), turns each chunk into the block events
in a `PartsManager` (`_parts`) and yields them, in the task that iterates it. No task of its own:
the provider is read when the consumer asks for the next event — every chunk it has without
waiting, then the events of them all are handed over — and nothing is read while the consumer is
away (the transport buffers what arrives meanwhile).

What a task of its own would give is kept by `ModelRead`, one object per call: the provider's code
runs inside the context captured when the stream was built (so a span opened around the
innermost ``next()`` parents the model call, and nothing the provider sets leaks into the
consumer), and an interrupt or a deadline cuts the read as ``asyncio.timeout`` cuts a block: the
consumer's task is cancelled while it is inside the read, and the call takes that cancellation
back and raises its typed error. Outside a read nothing is cancelled: the next read fails at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import random
import types
from collections.abc import AsyncIterator, Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any

from ._control import RunControl, TaskCut
from ._deadline import Deadline, DeadlineTimer
from ._parts import PartsManager
from ._stream.operators import Maps, MapSource, Recovery, aclose
from .errors import AgentInterrupted
from .events import AgentEvent
from .message import ChatUsage
from .model.base import ChatChunk, ChatModel, ModelError, ModelRequest
from .stream import EventStream

if TYPE_CHECKING:
    from ._replies import ReplyBuilder, ReplyParts

__all__ = [
    "FailoverListener", "ModelCall", "ModelExecutor", "ModelRead", "RetryPolicy", "model_call_events",
    "model_call_stream", "model_events", "read_alone", "read_passed",
]

FailoverListener = Callable[[ChatModel, BaseException, ChatModel], Any]
UsageSink = Callable[[ChatUsage], None]
"""Where a call's usage goes when the call is cut after the usage was read and before its end
went out (the run's `RuntimeContext.add_usage`): the provider billed it all the same."""
ModelExecutor = Callable[
    [Sequence[ChatModel], ModelRequest, str, RunControl, Deadline | None, UsageSink], EventStream[AgentEvent]]
"""What runs a model call instead of `model_call_stream` (``models``, the request, the reply id,
the run's control, the deadline, where the usage no event carries goes): `AgentRuntime.model_executor`."""


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
        with contextlib.suppress(Exception):
            await close()


FAIR_TURN = 32
"""Events the read makes before it hands them over and lets the loop run once, when the provider
has more without waiting. A provider that never waits (one in process, a replay) would otherwise
feed its whole reply in one step of the consumer's task, held in memory, while nothing else on the
loop (a server's clients, whose pace holds the run back) runs; a provider reading a socket waits
whenever its buffer is empty anyway."""


def model_call_stream(
    models: Sequence[ChatModel],
    request: ModelRequest,
    reply_id: str,
    policy: RetryPolicy,
    on_failover: FailoverListener | None,
    control: RunControl | None,
    deadline: Deadline | None = None,
    cut_usage: UsageSink | None = None,
) -> EventStream[AgentEvent]:
    """The events of one model call (``models[0]``, then its fallbacks), read at each subscription
    in the subscriber's task, the provider's code inside the context current *now* (so a span
    opened around the innermost ``next()`` parents the model call). ``cut_usage``: where the
    usage of a subscription cut before its end went out goes. See `model_events`."""
    return EventStream(ModelCall(models, request, reply_id, policy, on_failover, control, deadline,
                                 contextvars.copy_context(), cut_usage))


def model_call_events(
    models: Sequence[ChatModel],
    request: ModelRequest,
    reply_id: str,
    policy: RetryPolicy,
    on_failover: FailoverListener | None,
    control: RunControl | None,
    deadline: Deadline | None = None,
    reply: ReplyBuilder | None = None,
    events: bool = False,
    cut_usage: UsageSink | None = None,
) -> AsyncIterator[AgentEvent]:
    """The events of one model call read once, by a consumer that iterates them itself (the agent
    loop when no hook wraps the call): `model_call_stream`'s one subscription, without the stream
    object that lets hooks compose and re-subscribe to it. ``reply``: the builder the consumer
    would hand the events to; the call hands the reply to it directly (`PartsManager`), and
    yields the events only with ``events`` (a consumer that passes them on). ``cut_usage``: as
    for `model_call_stream`."""
    return model_events(ModelCall(models, request, reply_id, policy, on_failover, control, deadline,
                                  contextvars.copy_context(), cut_usage), (), None, reply, events)


def read_alone(stream: object, reply: ReplyBuilder, alone: Callable[[], bool]) -> AsyncIterator[AgentEvent] | None:
    """The stream that came back from the ``on_model_call`` hooks, subscribed by a consumer that
    is the only reader of its events and hands them to ``reply``, so that it makes none: the model
    call's own stream (`model_call_stream`) passed through as it was (no operator added, not
    wrapped), or a retry or fallback around it (`MapSource.building`) hands the reply to the
    builder directly (`PartsManager`). None for any other stream. ``alone()``: whether the
    consumer is still the only reader, for the attempts a retry makes later. (A hook that
    subscribes the stream itself gets its own subscription, events and all.)"""
    if type(stream) is EventStream and not stream._steps and isinstance(stream._factory, MapSource):
        return stream._factory.building(reply, alone)
    return None


def read_passed(stream: object, reply: ReplyBuilder) -> AsyncIterator[AgentEvent] | None:
    """A model call's own stream (`model_call_stream`) that came back from the ``on_model_call``
    hooks as it was (passed through: no operator added, not wrapped), subscribed by a consumer
    that passes its events on and would hand each of them to ``reply``: the subscription makes
    the events and hands the reply to ``reply`` itself (`PartsManager`). None for any other
    stream (a retry or fallback around the call, whose attempts the consumer then hands to the
    builder event by event)."""
    if type(stream) is EventStream and not stream._steps and type(stream._factory) is ModelCall:
        return model_events(stream._factory, (), None, reply, True)
    return None


class ModelCall(MapSource):
    """The factory of one model call's stream: each subscription is a `model_events` generator,
    which applies the stream's maps to each event itself, takes a failure before its first event
    to the retry's ``recovery`` (`MapSource.recovering`), and, for a consumer that only hands the
    events to a reply builder, hands the reply to it instead of making them (`MapSource.building`)."""

    __slots__ = ("control", "ctx", "cut_usage", "deadline", "models", "on_failover", "policy", "reply_id", "request")

    def __init__(
        self,
        models: Sequence[ChatModel],
        request: ModelRequest,
        reply_id: str,
        policy: RetryPolicy,
        on_failover: FailoverListener | None,
        control: RunControl | None,
        deadline: Deadline | None,
        ctx: contextvars.Context,
        cut_usage: UsageSink | None = None,
    ) -> None:
        self.models = models
        self.request = request
        self.reply_id = reply_id
        self.policy = policy
        self.on_failover = on_failover
        self.control = control
        self.deadline = deadline
        self.ctx = ctx
        self.cut_usage = cut_usage

    def with_maps(self, maps: Maps) -> AsyncIterator[Any]:
        return model_events(self, maps, None)

    def recovering(self, maps: Maps, recovery: Recovery) -> AsyncIterator[Any]:
        return model_events(self, maps, recovery)

    def building(
        self, reply: ReplyParts, alone: Callable[[], bool], recovery: Recovery | None = None,
    ) -> AsyncIterator[Any]:
        return model_events(self, (), recovery, reply)

    def quiet_building(self) -> bool:
        return True  # (`model_events` with a reply yields only what ``recovery`` resumes with)


NO_STEP: Any = object()
"""`ModelRead.first` when no step is held."""

HAND_OVER: Any = object()
"""What `_read` yields after the first chunk: `ModelRead` ends the consumer's await there (the
step goes to no task), so the first chunk's events are handed over before the next is read."""


class ModelRead(TaskCut):
    """One model call's reads of its provider, in the consumer's task: what an interrupt or the
    deadline cuts (a `_control.Cancellable` in the run's control, the deadline's target), and the
    awaitable that steps the provider's coroutines inside the call's context.

    **The cut.** ``reading`` is True only while the consumer's task is inside the read
    (`model_events` sets it around each ``await read``: two attribute writes per hand-over). `cancel`
    marks the read ``cut`` and, only when it is reading, cancels the task, once; the cancellation then
    surfaces inside the read, where `failure` takes it back (``uncancel``) and turns it into the
    typed error, unless the task was cancelled by someone else too (then it stays a
    cancellation). A cut outside a read cancels nothing: the next read fails at once.

    **The context.** ``await read`` after ``read.coro = ctx.run(...)`` runs that coroutine inside
    the call's context, as a Task runs its coroutine in its context: each ``await`` delegates to a
    generator (`__await__`) that steps the coroutine there, one await at a time. A step the read
    already holds (``first``) goes to the task before the coroutine is stepped again.

    **Handing over.** ``coro`` is `_read`, one coroutine that reads the whole call: the first
    chunk (retrying and failing over before it), then the rest, feeding each chunk to the parts
    manager (``parts``; ``out`` gets the events). The first chunk's events end the await at once
    (`HAND_OVER`). After them, when it would wait for the provider with events made, the await keeps
    the step it yielded (``first``) and ends instead: the consumer takes the events, and
    its next read hands that step to the task and goes on. So the context is entered once per
    wake-up of the provider, not once per chunk: each chunk is read by a plain ``await`` inside
    `_read`, or, from the providers' own SSE reader, handed to the parts manager by the reader
    itself (`_convert.stream_chunks` takes the feed: no generator hand-off per chunk).

    **The reading task.** The cut cancels the task that reads, and a consumer may go on reading
    in another task (`rx.pipe_operators` pulls in tasks of its own): each hand-over checks that
    the task is still ``task``. On Python 3.11 ``asyncio.current_task()`` is a Python function,
    about as costly as the rest of a hand-over's bookkeeping together, so the check reads
    ``running`` instead: the task's coroutine, whose ``cr_running`` is true exactly while that
    task runs (no task starts inside another's step there), so only a consumer in another task
    asks for its task. On 3.12+ an eager task's first steps run inside the step of the task that
    made it, whose coroutine is running then too, and ``current_task()`` is a C function:
    ``running`` is None there, as for a task whose coroutine is not a native one, and the task is
    asked for at every hand-over (`_coroutine_of`)."""

    __slots__ = ("control", "coro", "ctx", "cut", "filling", "first", "it", "model", "out", "parts", "reading",
                 "running", "timer")

    def __init__(self, ctx: contextvars.Context, model: ChatModel, control: RunControl | None) -> None:
        self.ctx = ctx
        self.coro: Any = None  # the coroutine being stepped (`_read`, then `_close` if need be)
        self.first: Any = NO_STEP  # a step it yielded that the task has not been given yet
        self.model = model  # the model being read (a failover moves it on)
        self.control = control
        self.it: AsyncIterator[ChatChunk] | None = None  # the provider's stream, once opened
        self.reading = False
        self.cut = control is not None and control.interrupted
        task = asyncio.current_task()
        assert task is not None
        TaskCut.__init__(self, task)  # (``base``: the task's cancellations before this call, kept by `failure`)
        self.running = _coroutine_of(task)
        self.timer: DeadlineTimer | None = None
        self.parts: PartsManager | None = None  # once the first chunk arrived (or the stream ended at once)
        self.out: list[Any] | None = None  # the events made and not handed over yet (``parts.out``)
        self.filling = False  # `_read` has not ended

    # -- the cut (`_control.Cancellable`) -----------------------------------------------------------

    def cancel(self, msg: Any | None = None) -> bool:
        self.cut = True
        if self.reading and not self.cancelled:
            self.cancel_task(msg)
        return True

    # -- handing the events over (stepping inside the context, and a pause when the read would wait) --

    def __await__(self) -> Generator[Any, Any, None]:
        # A generator, not an iterator object with ``send``: the task steps it as it steps a
        # coroutine, and it ends each hand-over by returning, where an iterator's ``send`` must
        # raise StopIteration (an exception made and caught per token).
        # A held step goes to the task unchecked: `_abandon` holds a cleanup's step while events
        # may still be in ``out``, and that step must run.
        ctx, coro = self.ctx, self.coro
        step, self.first = self.first, NO_STEP
        try:
            if step is NO_STEP:
                step = ctx.run(coro.send, None)
                if step is HAND_OVER:  # the first chunk's events: to the consumer before anything else is read
                    return
                if self.out:  # it would wait with events made: those go to the consumer first
                    self.first = step
                    return
            while True:
                try:
                    value = yield step
                except GeneratorExit:
                    ctx.run(coro.close)
                    raise
                except BaseException as exc:  # (a cancellation of the task: into the read, in its context)
                    step = ctx.run(coro.throw, exc)
                else:
                    step = ctx.run(coro.send, value)
                if step is HAND_OVER:
                    return
                if self.out:
                    self.first = step
                    return
        except StopIteration:  # the coroutine ended
            return

    def failure(self, exc: BaseException | None) -> BaseException:
        """What the call raises when a read ended with ``exc`` (None: the read was cut before it
        began): the cut's typed error — `AgentInterrupted`, or the deadline's `ModelTimeoutError`
        — or ``exc`` itself (a provider's error; a cancellation of the consumer's own)."""
        if self.cancelled:  # the cut landed inside this read: take its cancellation back
            if self.uncancel() > self.base and isinstance(exc, asyncio.CancelledError):
                return exc  # the consumer's task was cancelled as well: that goes on
        elif exc is not None:
            return exc
        control, timer = self.control, self.timer
        if timer is not None and timer.expired and not (control is not None and control.interrupted):
            return timer.error(self.model)
        return AgentInterrupted("the model call was interrupted")


async def model_events(
    call: ModelCall, maps: Maps, recovery: Recovery | None, reply: ReplyParts | None = None, events: bool = False,
) -> AsyncIterator[Any]:
    """The events of one model call, its maps applied, read in the task iterating this. With
    ``reply``, the reply goes to that builder, and the events are made only with ``events``
    (`model_call_events`, `read_alone`).

    Nothing is yielded until the first chunk arrives, so a failure before it can be retried or
    failed over (here, `_recover`, or by a middleware: ``recovery``) cleanly. Its events are
    yielded (`PartsManager.feed`), then those of the chunks the provider has without waiting, then
    the next chunks are read (letting the loop run once every `FAIR_TURN` events).

    With ``control`` (the run's interrupt switch), the call's `ModelRead` is registered for the
    call's lifetime, so an interrupt cuts the read and the call raises `AgentInterrupted`. With a
    ``deadline`` (`_deadline`), one timer per call cuts it the same way and the call raises
    `ModelTimeoutError`. Either way the open blocks are closed first (`PartsManager.fail`: the
    closing guarantee, `agent._brackets`) and the provider's stream is closed.

    The usage goes out with the call's end: to ``reply`` when `PartsManager.end` or ``fail`` hands
    it over, else in the ModelCallEnd, the last event. Since the provider is read ahead, the usage
    may have been read when the subscription is closed before that (a hook raised at an earlier
    event, the consumer left, an interrupt ended a wait outside the read): the provider billed the
    call all the same, so the usage read goes to ``call.cut_usage`` (the run's) as the
    subscription ends; never when the end went out."""
    control, ctx, deadline = call.control, call.ctx, call.deadline
    read = ModelRead(ctx, call.models[0], control)
    if control is not None:
        control.tasks.add(read)
    if deadline is not None:
        read.timer = DeadlineTimer(deadline.total, deadline.first_event, read)
    error: BaseException | None = None
    sent = False  # the call's end, and its usage with it, went out
    try:
        try:
            if read.cut:
                raise read.failure(None)
            # One coroutine reads the whole call inside the call's context (`_read`): the first
            # chunk, whose events are handed over at once, then the chunks the provider has
            # without waiting, handed over when it would wait (`ModelRead.__await__`) or when it ends.
            read.filling = True
            read.coro = ctx.run(_read, call, read, reply, events)
            read.reading = True
            await read
            read.reading = False
        except BaseException as exc:
            read.reading = False
            if read.parts is not None:  # after the first chunk: the call fails with its blocks closed
                error = read.failure(exc)
            else:
                failed = read.failure(exc)
                if recovery is None or not isinstance(failed, Exception):
                    if failed is exc:
                        raise
                    raise failed from None
                await _finish(read)
                resumed = recovery[2](failed)
                try:
                    async for item in resumed:
                        yield item
                finally:
                    await aclose(resumed)
                return
        parts = read.parts
        assert parts is not None
        out = parts.out
        if recovery is not None:
            # Until the first event that is not a bracket of hook tracing (`Recovery`), an error of
            # the stream's own maps goes to ``recovery`` too, as it would seen from outside.
            n, passes, resume = recovery
            inner, outer = maps[:n], maps[n:]
            while out:
                event = out.pop(0)
                try:
                    for fn in inner:
                        event = fn(event)
                except Exception as exc:
                    await _finish(read)
                    resumed = resume(exc)
                    try:
                        async for item in resumed:
                            yield item
                    finally:
                        await aclose(resumed)
                    return
                first = type(event) not in passes
                for fn in outer:
                    event = fn(event)
                yield event
                if first:
                    break
        while error is None:
            for event in out:
                for fn in maps:
                    event = fn(event)
                yield event
            out.clear()
            # A cut fails the call when reads remain, or when it landed inside a read (a provider
            # that swallowed its cancellation and went on to its end)
            if read.cut and (read.filling or read.cancelled):
                error = read.failure(None)
                break
            if not read.filling:
                break
            running = read.running
            if running is None or not running.cr_running:  # (`ModelRead`: the reading task)
                task = asyncio.current_task()
                if task is not read.task:
                    # The consumer pulls in another task now (`rx.pipe_operators` pulls in tasks of
                    # its own while time operators wait): the cut cancels the task that reads.
                    assert task is not None
                    read.task, read.base, read.running = task, task.cancelling(), _coroutine_of(task)
            read.reading = True
            try:
                await read
            except BaseException as exc:
                error = read.failure(exc)
                break
            finally:
                read.reading = False
        if error is None:
            parts.end()
        elif isinstance(error, Exception):
            parts.fail(error, isinstance(error, AgentInterrupted))
        else:
            raise error  # a cancellation of the consumer's own: nobody takes more events
        sent = parts.reply is not None
        end = out.pop() if out else None  # the ModelCallEnd (none when only ``reply`` takes the reply)
        for event in out:
            for fn in maps:
                event = fn(event)
            yield event
        out.clear()
        if end is not None:
            for fn in maps:
                end = fn(end)
            sent = True
            yield end
        if error is not None:
            raise error
    finally:
        if not sent and read.parts is not None and call.cut_usage is not None:
            usage = read.parts.usage_read()
            if usage is not None:
                call.cut_usage(usage)
        await _finish(read)


async def _read(call: ModelCall, read: ModelRead, reply: ReplyParts | None, events: bool) -> None:
    """The whole read of the provider, inside the call's context: the first chunk (a failure
    before it goes to `_recover`; the deadline's first-event limit ends with it), the parts
    manager made for the model that gave it, then each chunk fed to it as it arrives (by the
    reader itself when it takes the feed). `ModelRead` hands the events over after the first
    chunk (`_hand_over`) and whenever this would wait for the provider after it (and `FAIR_TURN`,
    or the reader's `FED_TURN`, makes it wait now and then)."""
    try:
        model = call.models[0]
        it: AsyncIterator[ChatChunk] | None = None
        chunk: ChatChunk | None
        try:
            it = read.it = model.stream(call.request).__aiter__()
            chunk = await it.__anext__()
        except StopAsyncIteration:
            _ended(read)
            chunk = None
        except Exception as exc:  # retries and fallback live off the common path
            if it is not None:
                read.it = None
                await _close(it)
            read.model, read.it, chunk = await _recover(call.models, call.request, call.policy, call.on_failover,
                                                        exc)
        timer = read.timer
        if timer is not None and timer.waiting_first:  # (moved to the total deadline; most have none)
            timer.first_arrived()
        parts = read.parts = PartsManager(call.reply_id, read.model.name, reply, events)
        out = read.out = parts.out
        if chunk is None or read.it is None:
            return
        it = read.it
        feed, anext = parts.feed, it.__anext__
        feed(chunk)
        await _hand_over()
        if type(it) is types.AsyncGeneratorType and getattr(read.model, "stream_takes_feed", False):
            # Sent the feed in place of the request for the next chunk, the providers' own reader
            # (`_convert.stream_chunks`, a model that says ``stream_takes_feed``) feeds every chunk
            # after this one itself and ends without yielding; a reader that ignores what it is
            # sent (a subclass's own stream) yields its next chunk, and the loop below goes on. A
            # user's model is never sent a value its ``stream`` did not ask for.
            feed(await it.asend(feed))
        if parts.events:
            while True:
                feed(await anext())
                if len(out) >= FAIR_TURN:
                    await _pause()
        else:  # no events to count (the reply goes to its builder only): the loop runs every FAIR_TURN chunks
            fed = 0
            while True:
                feed(await anext())
                fed += 1
                if fed == FAIR_TURN:
                    fed = 0
                    await _pause()
    except StopAsyncIteration:
        _ended(read)
    finally:
        read.filling = False


_EAGER_TASKS = hasattr(asyncio, "eager_task_factory")
"""Python 3.12+: a task may start inside another's step (`ModelRead`: the reading task)."""


def _coroutine_of(task: asyncio.Task[Any]) -> types.CoroutineType[Any, Any, Any] | None:
    """``task``'s coroutine for `ModelRead`'s check of the reading task, where that check is exact:
    a native coroutine, and no eager tasks. None otherwise: the task is asked for."""
    if _EAGER_TASKS:
        return None
    coro = task.get_coro()
    return coro if type(coro) is types.CoroutineType else None


def _ended(read: ModelRead) -> None:
    """The provider's stream ended: an async generator that did has run its cleanup already (its
    ``aclose`` does nothing), so only another kind of stream is left for `_finish` to close."""
    if type(read.it) is types.AsyncGeneratorType:
        read.it = None


@types.coroutine
def _hand_over() -> Generator[Any, None, None]:
    """The first chunk's events to the consumer (`HAND_OVER`), as the reads after it hand theirs
    over whenever the provider would wait: the time the consumer then holds them counts toward
    the call's deadline, whether or not the provider has more at once."""
    yield HAND_OVER


@types.coroutine
def _pause() -> Generator[None, None, None]:
    """One loop turn (what ``asyncio.sleep(0)`` yields)."""
    yield


async def _abandon(read: ModelRead) -> None:
    """End the read `_read` is waiting in (the consumer left, or the call was cut while nobody
    waited for the provider): the provider's await is cancelled, inside the call's context."""
    read.first = NO_STEP
    cut = asyncio.CancelledError()
    try:
        step = read.ctx.run(read.coro.throw, cut)
    except BaseException:  # it ended there, as it should
        return
    read.first = step  # it awaits in its cleanup
    try:
        await read
    except asyncio.CancelledError as exc:
        if exc is not cut:  # the consumer's own, meanwhile
            raise
    except Exception:
        pass


async def _finish(read: ModelRead) -> None:
    """The call's end, however it ends: the deadline disarmed (before anything is awaited: passing
    now must not cut the close), the provider's stream closed inside the call's context, the read
    unregistered from the run's control."""
    timer = read.timer
    if timer is not None:
        timer.stop()
        read.timer = None
    read.uncancel()  # (a provider that swallowed the cut's cancellation left it out)
    read.out = None
    try:
        if read.filling:  # left while the provider was being read: end that read
            read.filling = False
            await _abandon(read)
        it, read.it = read.it, None
        if it is not None:
            read.coro = read.ctx.run(_close, it)
            await read
    finally:
        if read.control is not None:
            read.control.tasks.discard(read)
