"""`ToolRetryMiddleware`: runs a failed tool call again, that call only.

A failed tool call is a result that ends with ``ToolResultEnd(state="error")`` (the runtime turns
a raising tool, a tool timeout, bad arguments into such a result). Its retry goes through
``next`` with ``tool_calls`` narrowed to that one call, so the other calls of the batch are never
run twice, and its events take the failed attempt's place in the stream.

A tool's ``ToolResultStart`` goes out before the tool runs, so "before the first event" means
here: before the result's first output. By default the layer holds a call's Start and its first
delta until a second delta (output is streaming: let it go) or the End: a failure that streamed
no output but its error text is retried unseen. ``buffer=True`` holds each retried call's events
to its End (any failure unseen; a streaming tool's output then comes at once).
``after_first_event=True`` holds nothing and retries even a failure whose output went out: the
failed result stays in the stream (balanced, ``state="error"``) and the retry's result follows it
with the same call id; memory keeps the last one.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable, Collection
from typing import TYPE_CHECKING, Any, Literal

from ...errors import AgentInterrupted, MiddlewareTermination
from ...events import AgentEvent, ToolResultEnd, ToolResultStart, ToolResultTextDelta
from ...extension.base import ActingInput, ExtensionPoint, MiddlewareBase, Next
from ...message import ToolResultState, ToolUseBlock
from ...stream import EventStream, aclosing
from ._common import Backoff, Sleep, mode_of

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ...extension.base import AgentView

__all__ = ["ToolRetryMiddleware"]

OnToolRetry = Callable[[int, ToolUseBlock, str, float], Any]
"""``on_retry(retry, call, error_text, delay)``: retry ``retry`` (1-based) of ``call`` starts
after ``delay`` s."""

_ERROR = ToolResultState.ERROR


class ToolRetryMiddleware(MiddlewareBase):
    """Runs a tool call whose result is an error again, at most ``max_retries`` times.

    ``tools``: the names to retry (None: every tool). ``retry_on``: a predicate on the error
    result's text (by default every error result). Backoff as `RetryMiddleware`'s (tools have no
    ``retry_after``). ``on_failure`` when the retries are used up: ``"continue"`` (the default:
    the last error result stands, and the model sees it) or ``"raise"`` (that result goes out,
    then `MiddlewareTermination` ends the run). ``buffer`` / ``after_first_event``: the streaming
    contract (module docstring). ``sleep`` and ``rng`` are injectable for tests."""

    roles = frozenset({"retry"})

    def __init__(
        self,
        max_retries: int = 2,
        *,
        tools: Collection[str] | None = None,
        retry_on: Callable[[str], bool] | None = None,
        on_failure: Literal["raise", "continue"] = "continue",
        initial_delay: float = 1.0,
        backoff_factor: float = 2.0,
        max_delay: float = 60.0,
        jitter: bool | float = True,
        buffer: bool = False,
        after_first_event: bool = False,
        on_retry: OnToolRetry | None = None,
        sleep: Sleep | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if on_failure not in ("raise", "continue"):
            raise ValueError(f"on_failure must be 'raise' or 'continue', got {on_failure!r}")
        if isinstance(tools, str):
            raise ValueError(f"tools must be a collection of names, not the string {tools!r}")
        if retry_on is not None and not callable(retry_on):
            raise ValueError(f"retry_on must be a predicate on the error text, got {retry_on!r}")
        self.backoff = Backoff(max_retries, initial_delay, backoff_factor, max_delay, jitter, sleep, rng)
        self.max_retries = max_retries
        self.tools = None if tools is None else frozenset(tools)
        self.on_failure = on_failure
        self.mode = mode_of(buffer, after_first_event)
        self._retry_on = retry_on
        self._on_retry = on_retry

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_ACTING})

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        tools = self.tools
        calls = {c.id: c for c in input.tool_calls if tools is None or c.name in tools}
        first = next(input)
        if not calls or self.max_retries == 0:
            return first  # nothing to retry: no layer at all
        return EventStream(lambda: self._run(first, calls, {}, ctx, input, next))

    async def _run(
        self, stream: EventStream[AgentEvent], calls: dict[str, ToolUseBlock], tries: dict[str, int],
        ctx: RuntimeContext, input: ActingInput, next: Next,
    ) -> AsyncIterator[AgentEvent]:
        mode = self.mode
        held: list[Any] | None = None  # the events of the call being held, unseen so far
        held_id = ""
        deltas = 0
        texts: dict[str, list[str]] = {}  # "always": the text of each call's result so far
        ev: Any
        async with aclosing(stream.__aiter__()) as it:
            async for ev in it:
                cls = type(ev)
                if held is not None:
                    if ev.source is None and getattr(ev, "tool_call_id", None) == held_id:
                        held.append(ev)
                        if cls is ToolResultEnd:
                            events, held = held, None
                            if ev.state is _ERROR:
                                async for out in self._failed(calls[held_id], events, True, tries, ctx, input,
                                                              next):
                                    yield out
                            else:
                                for out in events:
                                    yield out
                            continue
                        deltas += 1
                        if mode == "first" and deltas >= 2:  # output is streaming: let it go
                            events, held = held, None
                            for out in events:
                                yield out
                        continue
                    if mode == "buffer":  # (a sub-agent's events inside the call, say)
                        held.append(ev)
                        continue
                    events, held = held, None  # something else comes first: keep the order
                    for out in events:
                        yield out
                if cls is ToolResultStart and ev.source is None and ev.tool_call_id in calls:
                    if mode != "always":
                        held, held_id, deltas = [ev], ev.tool_call_id, 0
                        continue
                    texts[ev.tool_call_id] = []
                elif mode == "always" and ev.source is None and texts:
                    cid = getattr(ev, "tool_call_id", None)
                    if cid in texts:
                        if cls is ToolResultTextDelta:
                            texts[cid].append(ev.delta)
                        elif cls is ToolResultEnd:
                            text = "".join(texts.pop(cid))
                            yield ev
                            if ev.state is _ERROR:
                                async for out in self._failed(calls[cid], [], False, tries, ctx, input, next,
                                                              text):
                                    yield out
                            continue
                yield ev
        if held:  # the stream ended with the call open: pass on what there is (the runtime closes it)
            for out in held:
                yield out

    async def _failed(
        self, call: ToolUseBlock, events: list[Any], held: bool, tries: dict[str, int], ctx: RuntimeContext,
        input: ActingInput, next: Next, text: str | None = None,
    ) -> AsyncIterator[AgentEvent]:
        """``call``'s result was an error: run the call again and stream that (the failed attempt's
        ``events``, held so far, are dropped unseen); or, with the retries used up or ``retry_on``
        saying no, pass those events on and do what ``on_failure`` says. ``held``: whether
        ``events`` were held (else the failed result is already out)."""
        if text is None:
            text = "".join(e.delta for e in events if type(e) is ToolResultTextDelta)
        retry = tries.get(call.id, 0)
        if retry < self.max_retries and (self._retry_on is None or self._retry_on(text)):
            delay = self.backoff.delay(retry)
            # Both waits are in the run's task (not the tool's): an interrupt ends them at once
            # (`RuntimeContext.wait`). No retry replaces the failed attempt then: its result, held
            # unseen so far, is the call's result (as when the retries are used up).
            try:
                if self._on_retry is not None:
                    outcome = self._on_retry(retry + 1, call, text, delay)
                    if hasattr(outcome, "__await__"):
                        await ctx.wait(outcome)
                await ctx.wait(self.backoff.sleep(delay))
            except AgentInterrupted:
                if held:
                    for out in events:
                        yield out
                raise
            again = next(input.replace(tool_calls=[call]))
            async for out in self._run(again, {call.id: call}, {**tries, call.id: retry + 1}, ctx, input, next):
                yield out
            return
        if held:
            for out in events:
                yield out
        if self.on_failure == "raise" and (self._retry_on is None or self._retry_on(text)):
            raise MiddlewareTermination(
                f"tool {call.name} (call {call.id}) failed after {retry + 1} attempt(s): {text}"
            )
