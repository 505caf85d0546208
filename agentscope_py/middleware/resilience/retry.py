"""Resilience built-ins: retry, timeouts and model fallback, streaming-safe by contract.

* `RetryMiddleware` (``on_model_call``) runs a failed model call again, with exponential backoff
  that honours the provider's ``retry_after``;
* `ToolRetryMiddleware` (``on_acting``) runs a failed tool call again (that call only);
* `TimeoutMiddleware` bounds a model call (time to first event and total time, separately), each
  tool call, and the whole run;
* `ModelFallbackMiddleware` tries other models in turn when one fails.

Streaming contract (events already emitted cannot be taken back). By default a failure
is retried (or failed over) only when it happens before the attempt's first event, so the layers
outside never see a failed attempt. ``buffer=True`` holds each attempt's events until it
completes, so any failure is retried unseen (at the price of streaming: the events come at once).
``after_first_event=True`` retries a failure after events went out too: the runtime has closed
the failed attempt by then (its blocks end, then ``ModelCallEnd(discarded=True)``), so the stream
stays balanced and a UI can strike the attempt out; memory keeps only the attempt that completed.

Installed but not triggered, retry and fallback in the default mode add no iterator: the model
call's own stream takes a failure before its first event (`_common.FirstFailure`), and in a
``call()`` nothing observes it hands each attempt's reply to the loop with no events
(`MapSource.building`);
where it cannot (a hook inside that wraps the stream), and in the other modes, they cost one method
call per event (`_common.Attempts`).
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from ...errors import ModelError
from ...events import AgentEvent, ModelCallEnd, ModelCallStart, TextBlockDelta, TextBlockEnd, TextBlockStart
from ...extension.base import ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from ...message import new_id
from ...model.base import ChatModel
from ...stream import EventStream
from ._common import (
    Attempts,
    Backoff,
    ErrorFilter,
    FirstFailure,
    Sleep,
    any_failure,
    describe,
    matcher,
    mode_of,
    note_earlier,
    retryable_model_error,
)
from ._timeout import TimeoutMiddleware
from ._tools import ToolRetryMiddleware

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...extension.base import AgentView

__all__ = ["ModelFallbackMiddleware", "RetryMiddleware", "TimeoutMiddleware", "ToolRetryMiddleware"]

OnRetry = Callable[[int, BaseException, float], Any]
"""``on_retry(retry, error, delay)``: retry number ``retry`` (1-based) starts after ``delay`` s."""
FailoverListener = Callable[[ChatModel, BaseException, ChatModel], Any]
"""``listener(failed_model, error, next_model)``, the builder's ``failover_listener`` shape; may
be ``async``."""


class RetryMiddleware(MiddlewareBase):
    """Runs a failed model call again, at most ``max_retries`` times.

    ``retry_on``: an exception type, a tuple of types, or a predicate; by default a `ModelError`
    whose ``retryable`` is true (rate limits, 5xx, timeouts, connection errors). Waits:
    ``initial_delay * backoff_factor ** n`` seconds before retry ``n`` (0-based), at most
    ``max_delay``, spread by ``±jitter`` (``True`` = ±25 %), never less than the error's
    ``retry_after``. ``on_failure`` when the retries are used up: ``"raise"`` (the last error,
    with the earlier ones in ``__notes__`` and ``earlier_errors``), ``"continue"`` (the model
    call answers with a text reply saying what failed: the run goes on and the model sees it in
    memory next round; ``ModelCallEnd.error`` says why), or a function ``fn(error) -> str``
    (continue, with that text as the reply). Errors ``retry_on`` does not match go on
    at once. ``buffer`` / ``after_first_event``: the streaming contract (module docstring).
    ``sleep`` and ``rng`` are injectable for tests."""

    roles = frozenset({"retry"})

    def __init__(
        self,
        max_retries: int = 2,
        *,
        retry_on: ErrorFilter | None = None,
        on_failure: Literal["raise", "continue"] | Callable[[BaseException], str] = "raise",
        initial_delay: float = 1.0,
        backoff_factor: float = 2.0,
        max_delay: float = 60.0,
        jitter: bool | float = True,
        buffer: bool = False,
        after_first_event: bool = False,
        on_retry: OnRetry | None = None,
        sleep: Sleep | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if not callable(on_failure) and on_failure not in ("raise", "continue"):
            raise ValueError(f"on_failure must be 'raise', 'continue' or a function, got {on_failure!r}")
        self.backoff = Backoff(max_retries, initial_delay, backoff_factor, max_delay, jitter, sleep, rng)
        self.max_retries = max_retries
        self.on_failure = on_failure
        self.mode = mode_of(buffer, after_first_event)
        self._retry_on = matcher(retry_on, retryable_model_error, "retry_on")
        self._on_retry = on_retry

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_MODEL_CALL})

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        # Each subscription counts its own retries afresh.
        call = _Attempted(next(input), self, ctx, input, next)
        if self.mode == "first":
            return EventStream(call)
        return EventStream(partial(Attempts, call.first, call.again, self.mode, count=ctx.add_usage))

    async def _again(self, ctx: RuntimeContext, input: ModelCallInput, next: Next,
                     earlier: list[tuple[str, BaseException]], error: BaseException,
                     emitted: bool) -> EventStream[AgentEvent] | None:
        if not self._retry_on(error):
            note_earlier(error, earlier)
            return None
        retry = len(earlier)
        if retry >= self.max_retries:
            note_earlier(error, earlier)
            if self.on_failure != "raise":
                reply_id = ctx.reply_id or new_id("reply_")  # (the run's: AgentStart's)
                text = (self.on_failure(error) if callable(self.on_failure)
                        else _failure_text(error, retry + 1))
                return EventStream.of(*_error_reply(reply_id, input.model, error, text))
            return None
        delay = self.backoff.delay(retry, error)
        earlier.append((f"{retry + 1} ({input.model.name})", error))
        # Both waits are the run's: an interrupt ends them at once (`RuntimeContext.wait`).
        if self._on_retry is not None:
            await _maybe_await(ctx, self._on_retry(retry + 1, error, delay))
        await ctx.wait(self.backoff.sleep(delay))
        return next(input)


class ModelFallbackMiddleware(MiddlewareBase):
    """Tries ``models`` in turn when the model call fails: the agent's model first, then each of
    these (a `ChatModel`, or an id such as ``"openai:gpt-4o-mini"``).

    ``fallback_on``: an exception type, a tuple, or a predicate; by default every error except a
    middleware's deliberate stop (`MiddlewareTermination`: a guardrail, a rate limit, a budget)
    and a broken hook contract. ``ModelCallStart.model`` says which model served each attempt.
    ``on_failover(failed, error, next_model)`` is called (and awaited if async) before each
    switch. When the last model fails too, its error is re-raised as it is (``except
    RateLimitError`` still works), with the earlier models' errors attached: one ``__notes__``
    line each, and the errors, oldest first, in ``error.earlier_errors``. ``buffer`` /
    ``after_first_event``: the streaming contract (module docstring)."""

    roles = frozenset({"fallback"})

    def __init__(
        self,
        *models: ChatModel | str,
        fallback_on: ErrorFilter | None = None,
        on_failover: FailoverListener | None = None,
        buffer: bool = False,
        after_first_event: bool = False,
    ) -> None:
        if not models:
            raise ValueError("ModelFallbackMiddleware needs at least one model to fall back to")
        from ...model.registry import resolve_model

        self.models: tuple[ChatModel, ...] = tuple(resolve_model(m) if isinstance(m, str) else m for m in models)
        self.mode = mode_of(buffer, after_first_event)
        self._fallback_on = matcher(fallback_on, any_failure, "fallback_on")
        self._on_failover = on_failover

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_MODEL_CALL})

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        call = _Attempted(next(input), self, ctx, input, next)
        if self.mode == "first":
            return EventStream(call)
        return EventStream(partial(Attempts, call.first, call.again, self.mode, count=ctx.add_usage))

    async def _again(self, ctx: RuntimeContext, input: ModelCallInput, next: Next,
                     earlier: list[tuple[str, BaseException]], error: BaseException,
                     emitted: bool) -> EventStream[AgentEvent] | None:
        # (Stateless: each subscription's attempts so far are ``earlier``; ``emitted``, whether
        # the failed attempt had let events out, does not change which model comes next.)
        chain = (input.model, *self.models)
        i = len(earlier)
        if not self._fallback_on(error) or i + 1 >= len(chain):
            note_earlier(error, earlier)
            return None
        failed, following = chain[i], chain[i + 1]
        earlier.append((f"{i + 1} ({failed.name})", error))
        if self._on_failover is not None:
            await _maybe_await(ctx, self._on_failover(failed, error, following))
        return next(input.replace(model=following))


class _Attempted(FirstFailure):
    """One model call under `RetryMiddleware` or `ModelFallbackMiddleware`: its first attempt, and
    what the next ones need (the middleware's ``_again`` makes them)."""

    __slots__ = ("ctx", "input", "mw", "next")

    def __init__(self, first: EventStream[AgentEvent], mw: RetryMiddleware | ModelFallbackMiddleware,
                 ctx: RuntimeContext, input: ModelCallInput, next: Next) -> None:
        self.first, self.mw, self.ctx, self.input, self.next = first, mw, ctx, input, next

    def again(self, earlier: list[tuple[str, BaseException]], error: BaseException,
              emitted: bool) -> Awaitable[EventStream[AgentEvent] | None]:
        return self.mw._again(self.ctx, self.input, self.next, earlier, error, emitted)


def _failure_text(error: BaseException, attempts: int) -> str:
    text = f"The model call failed after {attempts} attempt(s): {describe(error)}"
    if isinstance(error, ModelError) and error.retry_after:
        text += f" (retry after {error.retry_after} s)"
    return text


def _error_reply(reply_id: str, model: ChatModel, error: BaseException, text: str) -> tuple[AgentEvent, ...]:
    """What ``on_failure="continue"`` answers with: a text reply the model will see."""
    block = new_id("blk_")
    return (
        ModelCallStart(reply_id=reply_id, model=model.name),
        TextBlockStart(reply_id=reply_id, block_id=block),
        TextBlockDelta(reply_id=reply_id, block_id=block, delta=text),
        TextBlockEnd(reply_id=reply_id, block_id=block),
        ModelCallEnd(reply_id=reply_id, error=describe(error), finish_reason="error"),
    )


async def _maybe_await(ctx: RuntimeContext, value: Any) -> None:
    """A callback's result awaited, when it is awaitable, as a wait of the run (an interrupt ends it)."""
    if inspect.isawaitable(value):
        await ctx.wait(value)
