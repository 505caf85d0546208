"""`HedgeMiddleware`: a hedged model call. When the first token is late, the same request goes to
a backup model too, and the attempt that produces its first token first is the call.

Each attempt runs in a task of its own that reads its whole stream (`_Attempt`): the two must be
read at once during the race, and a stream is read in one task from its first event to its
close, so an inner layer's context (a span it opened, a variable it set) stays in that task.
Until an attempt's first token its events (``ModelCallStart``, hook tracing's brackets) are held;
the winner's are then passed on and the loser's are dropped with it, so the layers outside see
one attempt, balanced, whose ``ModelCallEnd`` names the model that served it and carries its
usage only. The loser is cancelled: its task ends, its stream is closed (a provider's HTTP
connection with it), and nothing it produced reaches the events or memory. What the provider
reported it billed always reaches the run's usage: an attempt (the winner, or a loser that had
read its whole reply when the tie went the other way) that read its ``ModelCallEnd`` when the call
ended, and never handed it on, has that usage added to the run's (``ctx.add_usage``).

A token is any event of the attempt but ``ModelCallStart`` and hook tracing's brackets: a text,
thinking or data delta, a tool call's start, or the call's end (an empty reply).

The streaming contract of the other resilience built-ins holds: a failure before the first token
starts the backup at once (no point in waiting out the delay for a call that already failed);
when both attempts fail before their first token the call fails with `HedgeError`, naming both;
a failure after the winner's first token goes on as it is (a `RetryMiddleware` outside may run
the call again).
"""

from __future__ import annotations

import asyncio
import math
import re
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from ...errors import HedgeError
from ...events import AgentEvent, MiddlewareCompleted, MiddlewareStarted, ModelCallEnd, ModelCallStart
from ...extension.base import ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from ...message import ChatUsage
from ...model.base import ChatModel
from ...stream import EventStream, aclose
from ._common import ErrorFilter, any_failure, matcher

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...extension.base import AgentView

__all__ = ["HedgeMiddleware"]

_NOT_TOKENS = (ModelCallStart, MiddlewareStarted, MiddlewareCompleted)
_PERCENTILE = re.compile(r"p(\d{1,2}(?:\.\d+)?)")
_BUFFER = 64  # events an attempt reads ahead of its consumer (back-pressure on the model's stream)


class HedgeMiddleware(MiddlewareBase):
    """Sends the model call to ``backup`` as well when its first token has not come within
    ``after``, and keeps whichever attempt produces its first token first.

    ``backup``: a `ChatModel`, a model id such as ``"openai:gpt-4o-mini"``, or None / ``"same"``
    for the call's own model again (a second request, which often lands on a faster replica).

    ``after``: the delay before the backup starts, in seconds (a number), or a percentile of the
    recent first-token times, ``"p95"`` (``"p50"`` … ``"p99.9"``): the primary attempts' times of
    the last ``window`` calls, each clamped to [``floor``, ``ceiling``]; a primary cancelled
    because the backup won counts with the time it had waited (a lower bound: the true one is
    later). Until ``min_samples`` times are known the delay is ``ceiling``, so a fresh
    middleware hedges only calls that are slow by any measure. With a percentile ``pN`` about
    ``100 - N`` % of the calls are hedged, whatever the model's usual speed.

    ``hedge_on``: which failure of the first attempt starts the backup at once (an exception
    type, a tuple, or a predicate); by default every error except a middleware's deliberate stop,
    a broken hook contract and an interrupt (another model cannot help). Another error goes on as
    it is and no backup starts.

    Usage: only the attempt that won reaches the run's usage (its ``ModelCallEnd``), so a budget
    outside this middleware counts one call at the winner's usage; the tokens of the cancelled
    attempt (its prompt, at least, which the provider bills) are not counted, unless it had read
    its usage and not yet handed its end on when it was cancelled (then the run's usage counts
    it, as for any model call cut so). A budget or call
    limit inside it sees both attempts as calls of their own. ``roles``: ``fallback`` (the
    ordering lints tell when a limit is outside it).
    """

    roles = frozenset({"fallback"})

    def __init__(
        self,
        backup: ChatModel | str | None,
        *,
        after: float | str = 0.8,
        window: int = 200,
        min_samples: int = 20,
        floor: float = 0.05,
        ceiling: float = 5.0,
        hedge_on: ErrorFilter | None = None,
    ) -> None:
        if backup is None or backup == "same":
            self.backup: ChatModel | None = None
        elif isinstance(backup, str):
            from ...model.registry import resolve_model

            self.backup = resolve_model(backup)
        elif callable(getattr(backup, "stream", None)):
            self.backup = backup
        else:
            raise TypeError(f"backup must be a ChatModel, a model id such as 'openai:gpt-4o-mini', or None / "
                            f"'same' for the call's own model; got {backup!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1 (how many first-token times to keep), got {window!r}")
        if isinstance(min_samples, bool) or not isinstance(min_samples, int) or not 1 <= min_samples <= window:
            raise ValueError(f"min_samples must be an int in [1, window={window}], got {min_samples!r}")
        if not 0 < floor <= ceiling:
            raise ValueError(f"floor and ceiling must be seconds with 0 < floor <= ceiling, got {floor!r}, {ceiling!r}")
        self.quantile: float | None = None
        if isinstance(after, str):
            match = _PERCENTILE.fullmatch(after)
            percent = float(match.group(1)) if match else 0.0
            if not 0 < percent < 100:
                raise ValueError(f"after must be seconds (> 0) or a percentile such as 'p95' (p1 … p99.9), "
                                 f"got {after!r}")
            self.quantile = percent / 100
            self.after = float(ceiling)
        elif isinstance(after, bool) or not isinstance(after, int | float) or not after > 0:
            raise ValueError(f"after must be seconds (> 0) or a percentile such as 'p95', got {after!r}")
        else:
            self.after = float(after)
        self.window = window
        self.min_samples = min_samples
        self.floor = float(floor)
        self.ceiling = float(ceiling)
        self.samples: deque[float] = deque(maxlen=window)
        self._hedge_on = matcher(hedge_on, any_failure, "hedge_on")

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_MODEL_CALL})

    def delay(self) -> float:
        """The delay before the backup starts, now: ``after`` in seconds, or the percentile of
        the recent first-token times (``ceiling`` until ``min_samples`` are known)."""
        if self.quantile is None:
            return self.after
        n = len(self.samples)
        if n < self.min_samples:
            return self.ceiling
        ranked = sorted(self.samples)
        return ranked[max(0, math.ceil(self.quantile * n) - 1)]

    def _record(self, seconds: float) -> None:
        if self.quantile is not None:
            self.samples.append(min(self.ceiling, max(self.floor, seconds)))

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        return EventStream(lambda: self._race(ctx, input, next))

    async def _race(self, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> AsyncIterator[AgentEvent]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        primary = _Attempt(next(input), input.model.name)
        attempts = [primary]
        winner: _Attempt | None = None
        try:
            await asyncio.wait((primary.first,), timeout=self.delay())
            error = _failure(primary)
            if primary.first.done() and error is None:
                winner = primary
                self._record(loop.time() - started)
            else:
                if error is not None and not self._hedge_on(error):
                    raise error
                model = input.model if self.backup is None else self.backup
                backup = _Attempt(next(input.replace(model=model)), model.name)
                attempts.append(backup)
                winner = await _first_token(primary, backup, self._hedge_on)
                if error is None:  # the primary's first-token time; when the backup won, its wait so far
                    self._record(loop.time() - started)
            for attempt in attempts:
                if attempt is not winner:
                    await attempt.cancel()
            async for event in winner.events():
                yield event
        finally:
            for attempt in attempts:
                await attempt.cancel()
            # An attempt whose model answered but whose end was never handed on (the winner cut
            # before it was read here, a loser that read its whole reply before it lost the tie):
            # the provider reported that usage, so the run's usage counts it all the same.
            for attempt in attempts:
                for usage in attempt.unread_usage():
                    ctx.add_usage(usage)


def _failure(attempt: _Attempt) -> BaseException | None:
    first = attempt.first
    if not first.done():
        return None
    if first.cancelled():  # its task was cancelled from outside (the loop closing): so is the call
        raise asyncio.CancelledError
    return first.exception()


async def _first_token(primary: _Attempt, backup: _Attempt, hedge_on: Callable[[BaseException], bool]) -> _Attempt:
    """The attempt whose first token comes first; when one fails first, the other (whatever
    its speed); when both fail, `HedgeError` naming both (or the error that must go on as it is)."""
    pending = {primary.first, backup.first}
    while True:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for attempt in (primary, backup):  # (both done at once: the primary wins the tie)
            if attempt.first in done and _failure(attempt) is None:
                return attempt
        for attempt in (primary, backup):
            error = _failure(attempt)
            if attempt.first in done and error is not None and not hedge_on(error):
                raise error
        if not pending:
            errors = tuple((a.model, e) for a in (primary, backup) if (e := _failure(a)) is not None)
            raise HedgeError(errors) from errors[-1][1]


class _End:
    """The end of an attempt's stream, in its queue: ``error`` None when it completed."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class _Attempt:
    """One attempt of the call, read by a task of its own into a bounded queue; ``first`` is
    done at its first token (or its end), or holds its error when it failed before one."""

    __slots__ = ("ending", "first", "held", "model", "queue", "task")

    def __init__(self, stream: EventStream[AgentEvent], model: str) -> None:
        self.model = model
        self.ending = False  # `cancel` ends the attempt: no one reads its queue any more
        self.held: AgentEvent | None = None  # read, and cancelled while it waited for room in the queue
        self.queue: asyncio.Queue[AgentEvent | _End] = asyncio.Queue(_BUFFER)
        self.first: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(self._pump(stream))

    async def _pump(self, stream: EventStream[AgentEvent]) -> None:
        it = stream.__aiter__()
        first, queue = self.first, self.queue
        try:
            async for event in it:
                # (no coroutine per event: the queue waits only when it is full)
                if queue.full():
                    try:
                        await queue.put(event)
                    except asyncio.CancelledError:
                        self.held = event
                        raise
                else:
                    queue.put_nowait(event)
                if not first.done() and not isinstance(event, _NOT_TOKENS):
                    first.set_result(None)
        except Exception as exc:
            if not first.done():
                first.set_exception(exc)
                first.exception()  # (read here: a loser's error is dropped, never "never retrieved")
            await queue.put(_End(exc))
        except asyncio.CancelledError as exc:
            # Not by `cancel`: the stream raised it of its own, or another task cancelled this one.
            # The winner's reader waits on the queue (a wait no interrupt ends) and gets it there,
            # as it would from the stream read without a hedge.
            if not self.ending and first.done():
                await queue.put(_End(exc))
            raise
        else:
            if not first.done():
                first.set_result(None)
            await queue.put(_End(None))
        finally:
            if not first.done():  # (cancelled before its first token: whoever waits for it, stops)
                first.cancel()
            await aclose(it)

    async def events(self) -> AsyncIterator[AgentEvent]:
        """The attempt's events, to its end (its error raised where it failed)."""
        queue = self.queue
        while True:
            item = queue.get_nowait() if queue.qsize() else await queue.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            yield item

    def unread_usage(self) -> list[ChatUsage]:
        """The usage of the attempt's own ModelCallEnds that it read and nobody took from it (call
        it once the attempt has ended)."""
        queue = self.queue
        unread = [queue.get_nowait() for _ in range(queue.qsize())]
        if self.held is not None:
            unread.append(self.held)
        return [e.usage for e in unread if type(e) is ModelCallEnd and e.source is None and e.usage is not None]

    async def cancel(self) -> None:
        """Ends the attempt: its task is cancelled and waited for, so its stream is closed (a
        provider's connection with it) before the call goes on. When the caller is cancelled
        meanwhile, the cancelled task finishes closing on its own."""
        task = self.task
        self.ending = True
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
