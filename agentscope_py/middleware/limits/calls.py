"""Call limits and concurrency limits.

* `ConcurrencyLimitMiddleware(limit)`: at most ``limit`` model calls (``points=`` for tool passes
  or runs) in flight per key; the others wait, first come first served. A waiter that is
  cancelled never takes a slot; a slot is given back when its stream completes, fails or is
  closed early (``max_wait``: a waiter that waits longer fails with `RateLimitExceeded`).
* `ModelCallLimitMiddleware` / `ToolCallLimitMiddleware` (LangChain v1's, with its parameter
  names): ``run_limit`` calls per execution, ``session_limit`` (alias ``thread_limit``) per session,
  counted in ``AgentState.metadata["call_limits"]`` so the count survives restarts with a store.
  What ``run_limit`` counts is ``scope``: ``"run"`` (the default) each agent's execution on its
  own — a sub-agent that inherits the middleware (`agent.as_tool`) gets a count of its own per
  call —, ``"tree"`` the root execution and every sub-agent run under it, in one count (checked
  and counted in one step, so parallel sub-agents never pass it together).
  ``exit_behavior``: ``"end"`` (a `RequestStop`; the run ends with MIDDLEWARE_STOP_REQUESTED and
  the model never sees the reason), ``"error"`` (`CallLimitExceeded`, a `MiddlewareTermination`)
  or, for tools, ``"continue"`` (only the calls over the limit get an error result the model
  sees; the run goes on).

A call counts when it starts (its stream is subscribed): a failed model call counts too, and a
retry outside the limit re-counts each attempt (put the limit outside retries to count calls
once). A tool call counts once, as the model asked for it (LangChain's count): a
`ToolRetryMiddleware` outside the limit runs the same call again, uncounted and never refused.
A structured run's ``generate_response`` call (`agent.RESPONSE_TOOL`, unless the agent has a tool
of that name) is the run's answer, not a tool call: it is neither counted nor refused.
The checks run once per call; a call within the limits is the inner stream itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import AsyncIterator, Collection, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from ..._response_tool import answer_tool
from ...errors import CallLimitExceeded, RateLimitExceeded
from ...events import RequestStop, ToolResultEnd, ToolResultStart, ToolResultTextDelta
from ...extension.base import ActingInput, AgentInput, ExtensionPoint, MiddlewareBase, ModelCallInput, Next
from ...message import Msg, ToolResultState, ToolUseBlock
from ...stream import EventStream, aclosing
from ._session_counts import check_counts, is_count
from .rate_limit import KeySpec, check_points, key_function

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ..._state import AgentState
    from ...extension.base import AgentView

__all__ = ["CallLimitExceeded", "ConcurrencyLimitMiddleware", "ModelCallLimitMiddleware", "ToolCallLimitMiddleware"]

STATE_KEY = "call_limits"  # AgentState.metadata[STATE_KEY][counter] = calls so far in the session


# -- concurrency ---------------------------------------------------------------------------------

_SlotKey = tuple[ExtensionPoint, Hashable]  # (the point, what the key function returned)
_HELD_POINTS = frozenset({ExtensionPoint.ON_AGENT, ExtensionPoint.ON_ACTING, ExtensionPoint.ON_REASONING})


class _Slots:
    __slots__ = ("free", "waiters")

    def __init__(self, free: int) -> None:
        self.free = free
        self.waiters: deque[asyncio.Future[None]] = deque()


class ConcurrencyLimitMiddleware(MiddlewareBase):
    """At most ``limit`` calls in flight per key (``key`` as for `RateLimitMiddleware`).

    At ``on_acting`` the unit is one round's batch of tool calls (the runtime runs a batch
    together; a batch's own parallelism is the tools' ``concurrency_safe`` business); a
    `ToolRetryMiddleware` outside runs a failed call again within its batch's slot."""

    def __init__(
        self,
        limit: int,
        *,
        key: KeySpec = "global",
        points: Collection[ExtensionPoint | str] = (ExtensionPoint.ON_MODEL_CALL,),
        max_wait: float | None = None,
    ) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1, not {limit!r}")
        if max_wait is not None and (isinstance(max_wait, bool) or not max_wait >= 0):
            raise ValueError(f"max_wait must be >= 0 seconds or None, not {max_wait!r}")
        self.limit = limit
        self.max_wait = max_wait
        self.points = check_points(points)
        # A slot held by the caller's whole run or acting batch would be waited for by its own
        # sub-agent (a deadlock at the limit): only model-call limits reach down by default.
        self.inherit_to_subagents = not (self.points & _HELD_POINTS)
        self._key = key_function(key)
        self._slots: dict[_SlotKey, _Slots] = {}  # only keys with a call in flight or waiting
        self._batches: set[tuple[_SlotKey, int]] = set()  # (key, id of the run's context): acting passes holding a slot

    def active_points(self) -> frozenset[ExtensionPoint]:
        return self.points

    def in_flight(self, point: ExtensionPoint = ExtensionPoint.ON_MODEL_CALL, key: Hashable = "*") -> int:
        """Calls holding a slot for ``key`` (as the key function returns it) at ``point``."""
        slots = self._slots.get((point, key))
        return 0 if slots is None else self.limit - slots.free

    def waiting(self, point: ExtensionPoint = ExtensionPoint.ON_MODEL_CALL, key: Hashable = "*") -> int:
        slots = self._slots.get((point, key))
        return 0 if slots is None else sum(not f.done() for f in slots.waiters)

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        inner = next(input)
        return EventStream(lambda: self._held((ExtensionPoint.ON_MODEL_CALL, self._key(ctx)), ctx, inner))

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        inner = next(input)
        return EventStream(lambda: self._held((ExtensionPoint.ON_ACTING, self._key(ctx)), ctx, inner))

    def on_agent(self, agent: AgentView, ctx: RuntimeContext, input: AgentInput, next: Next) -> Any:
        inner = next(input)
        return EventStream(lambda: self._held((ExtensionPoint.ON_AGENT, self._key(ctx)), ctx, inner))

    async def _held(self, key: _SlotKey, ctx: RuntimeContext, inner: EventStream[Any]) -> AsyncIterator[Any]:
        # A run's acting pass while its batch holds a slot is that batch: a `ToolRetryMiddleware`
        # outside runs a failed call again while the batch's stream is still open (its other calls
        # may be running). It uses the batch's slot; waiting for another would wait for itself.
        batch = (key, id(ctx)) if key[0] is ExtensionPoint.ON_ACTING else None
        if batch is not None and batch in self._batches:
            async with aclosing(inner.__aiter__()) as it:
                async for event in it:
                    yield event
            return
        # The slot is taken inside the generator: a stream closed before its first item never
        # took one, and once taken, the finally gives it back however the stream ends.
        await self._acquire(key, ctx)
        if batch is not None:
            self._batches.add(batch)
        try:
            async with aclosing(inner.__aiter__()) as it:
                async for event in it:
                    yield event
        finally:
            if batch is not None:
                self._batches.discard(batch)
            self._release(key)

    async def _acquire(self, key: _SlotKey, ctx: RuntimeContext) -> None:
        slots = self._slots.get(key)
        if slots is None:
            slots = self._slots[key] = _Slots(self.limit)
        if slots.free > 0 and not slots.waiters:
            slots.free -= 1  # no await: an uncontended call never yields to the loop here
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        slots.waiters.append(waiter)
        try:
            # The run's wait: an interrupt ends it at once. The max_wait is inside it, so an
            # interrupt that comes as the max_wait passes ends the run interrupted, not refused.
            await ctx.wait(_within(waiter, self.max_wait))
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._release(key)  # handed a slot just as it was cancelled: pass it on
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    slots.waiters.remove(waiter)
                self._forget(key, slots)
            if isinstance(exc, TimeoutError):
                raise RateLimitExceeded(
                    f"{self.limit} call(s) already in flight for key {key[1]!r}; waited {self.max_wait} s",
                    retry_after=None,
                ) from None
            raise

    def _release(self, key: _SlotKey) -> None:
        slots = self._slots[key]
        while slots.waiters:
            waiter = slots.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot goes straight to the first waiter (FIFO, no barging)
                return
        slots.free += 1
        self._forget(key, slots)

    def _forget(self, key: _SlotKey, slots: _Slots) -> None:
        # Idle: per-session keys do not pile up. (A waiter cancelled late may hold an entry that
        # was already dropped.)
        if slots.free == self.limit and not slots.waiters and self._slots.get(key) is slots:
            del self._slots[key]


async def _within(waiter: asyncio.Future[None], max_wait: float | None) -> None:
    """``waiter``, awaited for ``max_wait`` seconds at most (`TimeoutError` then)."""
    async with asyncio.timeout(max_wait):
        await waiter


# -- call limits ---------------------------------------------------------------------------------


class _RunCount:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


ExitBehavior = Literal["end", "error", "continue"]
LimitScope = Literal["run", "tree"]


class _CallLimit(MiddlewareBase):
    roles = frozenset({"call_limit"})
    kind = ""
    point = ExtensionPoint.ON_MODEL_CALL
    behaviours: tuple[str, ...] = ()

    def __init__(self, run_limit: int | None, session_limit: int | None, thread_limit: int | None,
                 exit_behavior: str, state_key: str, scope: str = "run") -> None:
        if thread_limit is not None:
            if session_limit is not None:
                raise ValueError("give session_limit or thread_limit (LangChain's name for it), not both")
            session_limit = thread_limit
        for name, value in (("run_limit", run_limit), ("session_limit", session_limit)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, not {value!r}")
        if run_limit is None and session_limit is None:
            raise ValueError("give at least one of run_limit and session_limit")
        if exit_behavior not in self.behaviours:
            raise ValueError(f"exit_behavior must be one of {', '.join(map(repr, self.behaviours))}, "
                             f"not {exit_behavior!r}")
        if scope not in ("run", "tree"):
            raise ValueError(f'scope must be "run" (run_limit per agent execution) or "tree" (the root execution '
                             f'and its sub-agents together), not {scope!r}')
        self.run_limit, self.session_limit = run_limit, session_limit
        self.scope = scope
        self.exit_behavior = exit_behavior
        self.state_key = state_key
        if session_limit is not None:
            self.session_keys = frozenset({STATE_KEY})
        self._run_key = object()  # this instance's per-execution counter in the RuntimeContext

    def active_points(self) -> frozenset[ExtensionPoint]:
        if self.run_limit is None:
            return frozenset({self.point})
        return frozenset({self.point, ExtensionPoint.ON_AGENT_STATE_READY})

    def on_agent_state_ready(
        self, agent: AgentView, ctx: RuntimeContext, state: AgentState, input_messages: list[Msg]
    ) -> None:
        if self.scope == "tree" and ctx.parent is not None:
            shared = ctx.parent.get(self._run_key)
            if type(shared) is _RunCount:  # a sub-agent's run: its calls count in its root's
                ctx.put(self._run_key, shared)
                return
        ctx.put(self._run_key, _RunCount())  # once per execution: the run count starts at 0

    def session_count(self, state: AgentState | None) -> int:
        """Calls counted so far in the session of ``state``."""
        return 0 if state is None else int(state.metadata.get(STATE_KEY, {}).get(self.state_key, 0))

    def _session_calls(self, ctx: RuntimeContext) -> int:
        """`session_count` of the run's session, whose stored count must be one (`check_counts`)."""
        state = ctx.agent_state
        if state is None:
            return 0
        counts = state.metadata.get(STATE_KEY)
        if counts is None:
            return 0
        n = counts.get(self.state_key, 0) if type(counts) is dict else None
        if not is_count(n):
            check_counts(ctx, state.metadata, STATE_KEY, {self.state_key: "count"}, "session's call counts")
        return int(n or 0)

    def _left(self, ctx: RuntimeContext) -> tuple[float, str, int]:
        """How many calls may still start, and the limit that binds (scope, limit)."""
        left, scope, limit = math.inf, "", 0
        if self.run_limit is not None:
            run = ctx.get(self._run_key)
            left, scope, limit = self.run_limit - (run.n if run is not None else 0), self.scope, self.run_limit
        if self.session_limit is not None:
            s_left = self.session_limit - self._session_calls(ctx)
            if s_left < left:
                left, scope, limit = s_left, "session", self.session_limit
        return max(0, left), scope, limit

    def _count(self, ctx: RuntimeContext, n: int) -> None:
        if self.run_limit is not None:
            run = ctx.get(self._run_key)
            if run is None:  # (a hook run outside an execution: count from here)
                run = _RunCount()
                ctx.put(self._run_key, run)
            run.n += n
        state = ctx.agent_state
        if self.session_limit is not None and state is not None:
            counts = state.metadata.get(STATE_KEY)
            if counts is None:  # (none yet, or a stored null: `_session_calls` read it as no calls)
                counts = state.metadata[STATE_KEY] = {}
            counts[self.state_key] = int(counts.get(self.state_key, 0)) + n

    def _message(self, scope: str, limit: int, what: str) -> str:
        per = {"run": "run", "tree": "run, its sub-agents included"}.get(scope, "session")
        return f"{what} limit reached: at most {limit} per {per}"


class ModelCallLimitMiddleware(_CallLimit):
    """Limits model calls per run (``run_limit``) and per session (``session_limit`` /
    ``thread_limit``). ``exit_behavior``: ``"end"`` (default) or ``"error"``. ``scope``: what
    ``run_limit`` counts — ``"run"`` each execution, ``"tree"`` a root's and its sub-agents'."""

    kind = "model"
    point = ExtensionPoint.ON_MODEL_CALL
    behaviours = ("end", "error")

    def __init__(
        self,
        run_limit: int | None = None,
        session_limit: int | None = None,
        *,
        thread_limit: int | None = None,
        exit_behavior: Literal["end", "error"] = "end",
        state_key: str = "model",
        scope: LimitScope = "run",
    ) -> None:
        super().__init__(run_limit, session_limit, thread_limit, exit_behavior, state_key, scope)

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        inner = next(input)
        return EventStream.defer(lambda: self._admit(ctx, inner))

    def _admit(self, ctx: RuntimeContext, inner: EventStream[Any]) -> Any:
        left, scope, limit = self._left(ctx)
        if left >= 1:
            self._count(ctx, 1)
            return inner
        message = self._message(scope, limit, "model call")
        if self.exit_behavior == "error":
            return EventStream.error(CallLimitExceeded(message, kind="model", scope=scope, limit=limit))
        return EventStream.of(RequestStop(reason=message))


class ToolCallLimitMiddleware(_CallLimit):
    """Limits tool calls — all of them, or those of ``tool_name`` — per run and per session.
    ``exit_behavior``: ``"continue"`` (default: the calls over the limit get an error result, the
    others run), ``"end"`` (the same, then the run stops) or ``"error"`` (no call of the batch
    runs; `CallLimitExceeded` ends the run and every call of the batch gets an error result).
    ``scope``: what ``run_limit`` counts — ``"run"`` each execution, ``"tree"`` a root's and its
    sub-agents' (a call of a sub-agent tool counts too)."""

    kind = "tool"
    point = ExtensionPoint.ON_ACTING
    behaviours = ("continue", "end", "error")

    def __init__(
        self,
        tool_name: str | None = None,
        run_limit: int | None = None,
        session_limit: int | None = None,
        *,
        thread_limit: int | None = None,
        exit_behavior: ExitBehavior = "continue",
        state_key: str | None = None,
        scope: LimitScope = "run",
    ) -> None:
        super().__init__(run_limit, session_limit, thread_limit, exit_behavior,
                         state_key or f"tool:{tool_name or '*'}", scope)
        self.tool_name = tool_name
        self._calls_key = object()  # the calls an execution counted (their blocks, by id) in its RuntimeContext

    def on_acting(self, agent: AgentView, ctx: RuntimeContext, input: ActingInput, next: Next) -> Any:
        return EventStream.defer(lambda: self._act(ctx, input, next, answer_tool(agent.toolkit)))

    def _act(self, ctx: RuntimeContext, input: ActingInput, next: Next, answer: str | None = None) -> Any:
        calls = input.tool_calls
        name = self.tool_name
        # A call counts once, as the model asked for it: a retry of it (the same block, passed
        # again by a `ToolRetryMiddleware` outside) is not a new call, and it is not refused.
        counted: dict[int, ToolUseBlock] | None = ctx.get(self._calls_key)
        if counted is None:
            counted = {}
            ctx.put(self._calls_key, counted)
        matching = [c for c in calls if (c.name == name if name is not None else c.name != answer)
                    and counted.get(id(c)) is not c]
        left, scope, limit = self._left(ctx)
        if len(matching) <= left:
            self._count(ctx, len(matching))
            counted.update((id(c), c) for c in matching)
            return next(input)
        what = "tool call" if name is None else f"{name} call"
        message = self._message(scope, limit, what)
        if self.exit_behavior == "error":
            return EventStream.error(CallLimitExceeded(message, kind="tool", scope=scope, limit=limit, tool_name=name))
        n = int(left)
        self._count(ctx, n)
        counted.update((id(c), c) for c in matching[:n])
        blocked_ids = {c.id for c in matching[n:]}
        allowed = [c for c in calls if c.id not in blocked_ids]
        blocked = [c for c in calls if c.id in blocked_ids]
        stop = RequestStop(reason=message) if self.exit_behavior == "end" else None
        inner = next(input.replace(tool_calls=allowed)) if allowed else None
        return EventStream(lambda: _with_blocked(inner, blocked, message, stop, ctx.reply_id))


async def _with_blocked(
    inner: EventStream[Any] | None, blocked: Sequence[ToolUseBlock], message: str, stop: RequestStop | None,
    reply_id_of: str | None,
) -> AsyncIterator[Any]:
    """The allowed calls' events, then an error result per blocked call (and the stop)."""
    reply_id = reply_id_of or ""
    if inner is not None:
        async with aclosing(inner.__aiter__()) as it:
            async for event in it:
                if not reply_id:
                    reply_id = getattr(event, "reply_id", "") or ""
                yield event
    for call in blocked:
        rid, cid, name = reply_id, call.id, call.name
        yield ToolResultStart(reply_id=rid, tool_call_id=cid, tool_name=name)
        yield ToolResultTextDelta(reply_id=rid, tool_call_id=cid, tool_name=name,
                                  delta=f"Error: {message}; {name} was not called. Do not call it again.")
        yield ToolResultEnd(reply_id=rid, tool_call_id=cid, tool_name=name, state=ToolResultState.ERROR)
    if stop is not None:
        yield stop
