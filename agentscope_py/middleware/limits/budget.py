"""`BudgetMiddleware`: token and cost limits per run, per session and per user.

Where the totals live:

* **run** — in the `RuntimeContext` (reset when each execution's state is ready);
  a sub-agent that inherits this instance (`agent.as_tool`) shares its caller's run totals, and
  counts in the root's session: one budget for the whole tree;
* **session** — in ``AgentState.metadata[name]`` (``{"tokens", "cost", "calls"}``), so with a
  SQLite or Redis state store it survives restarts and is shared by every process of the session;
* **user** — in a `BudgetStore`: `InMemoryBudgetStore` (this process; the default) or
  `RedisBudgetStore` (shared by processes and hosts; one Lua script checks and holds).

Each model call, at ``on_model_call`` (`CallHold`):

* **before** it: the call **holds** its estimate in every limited scope, granted only if ``spent +
  held + estimate <= limit`` (``held``: what the calls in flight hold), atomically; else it is
  refused and the model is not called. The estimate is ``ceil(characters / 4)`` input tokens over
  the messages (text, thinking, tool arguments and results) and the tool schemas (pass
  ``estimate=`` for your own), priced as input tokens;
* **while it streams**: its output (text, thinking and tool-call argument deltas, ``ceil(characters
  / 4)`` tokens, priced as output) grows its hold the same way; a delta that would take a scope
  over its limit is not let out: the call is cut short there (its request closed, its open blocks
  ended, ``ModelCallEnd(error="BudgetExceeded: …")``) and refused as below. (Under a budget that
  limits only the run's tokens, a call alone in flight holds its estimate only and compares each
  delta with the room the limit leaves it; a call that takes meanwhile first has it hold what it
  let out: `_SyncCall.sync`.)
* **at its end**, from ``ModelCallEnd.usage`` (``None``, unknown, counts the estimate and the
  output counted): the hold is settled — dropped, and the actual usage charged — and the
  ModelCallEnd leaving this layer carries ``metadata[name]`` = ``{"call": {...}, "run": {...},
  "session": {...}, "user": {...}, "exceeded": reason|None}``. A call that fails, is cancelled or
  whose consumer leaves settles what was counted (a model that answered was paid), or releases the
  hold when no model answered. The price is that of the model that served the call
  (``ModelCallEnd.model``, else its ``ModelCallStart.model``): a fallback inside or outside this
  layer is priced as itself.

In a ``call()`` that nothing observes, a budget whose holds are all in this process makes its call
make no events: the model call hands its reply's parts to the budget's call, which meters them as
it meters the events and hands them on to the loop's builder (`_SyncCall.building`); the note on
``ModelCallEnd`` is then not made (no event carries it), the totals are the same.

The guarantee: with N calls in flight, the spend stays within ``limit`` plus the sum of those
calls' overruns of their estimates (a call's overrun: its reported usage beyond the estimate and
the output counted — a tokenizer counting differently, hidden reasoning tokens); one call at a
time, within ``limit`` plus that call's overrun; with usage as counted, within ``limit``.

Refusing: ``on_exceeded="stop"`` emits ``Custom(name="budget_exceeded", value={scope, kind, limit,
spent, held, estimate, stage, reason})`` and ``RequestStop(reason)``: the run ends with
MIDDLEWARE_STOP_REQUESTED. ``on_exceeded="error"`` raises `BudgetExceeded(reason)`.

Cost: a price table of `ModelPrice` (USD per million tokens: input, output, cached input, cache
writes) per model name — `DEFAULT_PRICES` (list prices at the time of writing) updated with
``prices=``. A name matches exactly, else the longest entry it starts with (``gpt-4o-2024-08-06``
→ ``gpt-4o``), after a ``provider:`` or ``provider/`` prefix is dropped. A model without a price
costs 0 (logged once) — or, with ``strict=True``, is an error: ``models=`` named at construction
are checked there (`ValueError`), any other at its first call.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar, cast

from ..._bracket_kinds import BRACKET_TYPES, OpenBrackets
from ..._stream.context import InContext
from ..._stream.operators import Maps, MapSource, Recovery, apply_maps, iterate, maps_of
from ..._trusted import with_metadata
from ...errors import BudgetExceeded
from ...events import (
    Custom,
    ModelCallEnd,
    ModelCallStart,
    RequestStop,
    TextBlockDelta,
    ThinkingBlockDelta,
    ToolCallDelta,
)
from ...extension.base import ExtensionPoint, MiddlewareBase, ModelCallInput, Next, publish_metric
from ...message import ChatUsage, Msg
from ...stream import EventStream, aclose
from ._session_counts import check_counts
from .budget_estimate import estimate_tokens
from .budget_stores import (
    BudgetStore,
    InMemoryBudgetStore,
    RedisBudgetStore,
    Reservation,
    RunTotals,
    Spend,
    new_hold_id,
)

if TYPE_CHECKING:
    from ..._context import RuntimeContext
    from ..._replies import ReplyParts
    from ..._state import AgentState
    from ...extension.base import AgentView

__all__ = [
    "DEFAULT_PRICES", "BudgetMiddleware", "BudgetStore", "InMemoryBudgetStore", "ModelPrice", "RedisBudgetStore",
    "Reservation", "RunTotals", "Spend", "estimate_tokens",
]

log = logging.getLogger("agentscope_py.middleware.budget")
T = TypeVar("T")
OnExceeded = Literal["stop", "error"]


_SESSION_FIELDS = {"tokens": "count", "cost": "amount", "calls": "count"}  # metadata[name], the session's totals


def _are_totals(raw: Any) -> bool:
    """``check_counts``' test of ``_SESSION_FIELDS``, inline: it runs at the start of every run."""
    if type(raw) is not dict:
        return False
    tokens, cost, calls = raw.get("tokens"), raw.get("cost"), raw.get("calls")
    return (type(tokens) is int and tokens >= 0 and type(calls) is int and calls >= 0
            and (type(cost) is float or type(cost) is int) and 0 <= cost < math.inf)


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """USD per million tokens. ``cached_input`` (cache reads) and ``cache_write`` default to
    ``input``. ``input_tokens`` counts the whole prompt, cached parts included (as `ChatUsage`)."""

    input: float
    output: float
    cached_input: float | None = None
    cache_write: float | None = None

    def __post_init__(self) -> None:
        for field_name in ("input", "output", "cached_input", "cache_write"):
            value = getattr(self, field_name)
            if value is not None and not (isinstance(value, int | float) and value >= 0):
                raise ValueError(f"ModelPrice.{field_name} must be a number >= 0, got {value!r}")

    def cost(self, usage: ChatUsage) -> float:
        return self._cost_of(usage.__dict__)

    def _cost_of(self, usage: Mapping[str, int]) -> float:
        """`cost` of a `ChatUsage`'s fields (its ``__dict__``: one read of the model, where each
        of its attributes read is one)."""
        cached = usage["cache_read_tokens"]
        written = usage["cache_write_tokens"]
        plain = max(0, usage["input_tokens"] - cached - written)
        read_price = self.input if self.cached_input is None else self.cached_input
        write_price = self.input if self.cache_write is None else self.cache_write
        return (plain * self.input + cached * read_price + written * write_price
                + usage["output_tokens"] * self.output) / 1_000_000


DEFAULT_PRICES: Mapping[str, ModelPrice] = {
    "gpt-4o": ModelPrice(2.50, 10.00, 1.25),
    "gpt-4o-mini": ModelPrice(0.15, 0.60, 0.075),
    "gpt-4.1": ModelPrice(2.00, 8.00, 0.50),
    "gpt-4.1-mini": ModelPrice(0.40, 1.60, 0.10),
    "claude-sonnet-4": ModelPrice(3.00, 15.00, 0.30, 3.75),
    "claude-opus-4": ModelPrice(15.00, 75.00, 1.50, 18.75),
    "claude-3-5-haiku": ModelPrice(0.80, 4.00, 0.08, 1.00),
}


_UNSEEN: Any = object()


class BudgetMiddleware(MiddlewareBase):
    """Token (input + output) and cost (USD) limits per run, session and user; see the module
    docstring. Every limit is optional (None: unlimited) and must be >= 0."""
    roles = frozenset({"budget"})

    def __init__(
        self,
        *,
        run_tokens: int | None = None,
        run_cost: float | None = None,
        session_tokens: int | None = None,
        session_cost: float | None = None,
        user_tokens: int | None = None,
        user_cost: float | None = None,
        on_exceeded: OnExceeded = "stop",
        prices: Mapping[str, ModelPrice] | None = None,
        strict: bool = False,
        models: Sequence[Any] = (),
        store: BudgetStore | None = None,
        estimate: Callable[[ModelCallInput], int] | None = None,
        name: str = "budget",
    ) -> None:
        limits = {("run", "tokens"): run_tokens, ("run", "cost"): run_cost,
                  ("session", "tokens"): session_tokens, ("session", "cost"): session_cost,
                  ("user", "tokens"): user_tokens, ("user", "cost"): user_cost}
        for (scope, kind), limit in limits.items():
            number = isinstance(limit, int | float) and not isinstance(limit, bool)
            if limit is not None and not (number and limit >= 0):
                raise ValueError(f"{scope}_{kind} must be a number >= 0 or None (no limit), got {limit!r}")
        if on_exceeded not in ("stop", "error"):
            raise ValueError(f'on_exceeded must be "stop" or "error", got {on_exceeded!r}')
        table = dict(DEFAULT_PRICES)
        for model, price in (prices or {}).items():
            if not isinstance(price, ModelPrice):
                raise ValueError(f"prices[{model!r}] must be a ModelPrice, got {price!r}")
            table[model] = price
        self.prices: Mapping[str, ModelPrice] = table
        self.strict = strict
        self.on_exceeded: OnExceeded = on_exceeded
        self.limits = {key: limit for key, limit in limits.items() if limit is not None}
        self.store: BudgetStore = store if store is not None else InMemoryBudgetStore()
        missing = [m for m in ("get", "add", "reserve", "settle", "release")
                   if not callable(getattr(self.store, m, None))]
        if missing:
            raise TypeError(f"store {self.store!r} lacks {', '.join(missing)}: a BudgetStore holds each call's "
                            "estimate while it runs (InMemoryBudgetStore and RedisBudgetStore do)")
        self.estimate = estimate or estimate_tokens
        self.name_key = name
        self.session_keys = frozenset({name})  # the session's totals
        self._run_key = f"agentscope.{name}.run"
        self._user_seen: dict[str, Spend] = {}
        self._warned: set[str] = set()
        self._price_of: dict[str, ModelPrice | None] = {}
        self._cost_limited = any(kind == "cost" for _, kind in self.limits)
        self._limit_list = tuple((scope, kind, limit, kind == "tokens") for (scope, kind), limit in self.limits.items())
        self._run_limited = any(scope == "run" for scope, _ in self.limits)
        self._session_limited = any(scope == "session" for scope, _ in self.limits)
        self.local_limited = self._run_limited or self._session_limited  # (else only the store checks)
        # (in whole tokens: the totals it is compared with are integers, so ``total > limit`` is
        # ``total > floor(limit)``; then a call alone's room in characters is four times its room)
        run_tokens_limit = self.limits.get(("run", "tokens"))
        self._run_max_tokens: float = math.inf if run_tokens_limit is None else math.floor(run_tokens_limit)
        self._run_max_cost: float = self.limits.get(("run", "cost"), math.inf)
        if strict:
            for model in models:
                model_name = model if isinstance(model, str) else getattr(model, "name", repr(model))
                if self.price(model_name) is None:
                    raise ValueError(f"strict budget: no price for model {model_name!r} "
                                     f"(known: {', '.join(sorted(table))}); pass prices={{...}}")
        self.needs_user = any(scope == "user" for scope, _ in self.limits)
        self.user_limits = (self.limits.get(("user", "tokens")), self.limits.get(("user", "cost")))
        # The user's holds in this process: every step of a hold is synchronous (`CallHold.*_now`).
        self.memory_store = (self.store if self.needs_user and isinstance(self.store, InMemoryBudgetStore)
                             else None)
        self._sync = not self.needs_user or self.memory_store is not None
        self._beyond_run = self._session_limited or self.needs_user  # (a scope other than the run's limited)
        # Only the run's tokens limited (or nothing): a call alone in flight checks its output
        # against the room it has by comparing integers (`_SyncCall.take_estimate`).
        self.run_tokens_only = not self._beyond_run and not self._cost_limited

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_MODEL_CALL, ExtensionPoint.ON_AGENT_STATE_READY})

    # -- reading ---------------------------------------------------------------------------------

    def price(self, model: str) -> ModelPrice | None:
        """The price of ``model`` (exact name, else the longest prefix entry), or None."""
        known = self._price_of.get(model, _UNSEEN)
        if known is not _UNSEEN:
            return cast("ModelPrice | None", known)
        found = self._look_up(model)
        if len(self._price_of) < 1024:
            self._price_of[model] = found
        return found

    def _look_up(self, model: str) -> ModelPrice | None:
        for sep in (":", "/"):
            if sep in model:
                model = model.split(sep, 1)[1]
        found = self.prices.get(model)
        if found is not None:
            return found
        best = max((k for k in self.prices if model.startswith(k + "-")), key=len, default=None)
        return None if best is None else self.prices[best]

    def spent(self, ctx: RuntimeContext) -> dict[str, Spend]:
        """``{"run", "session", "user"}`` totals for ``ctx`` (after or during its run): the run's,
        its session's (from ``ctx.agent_state``) and its user's as of this middleware's last update
        (``await user_spent(...)`` reads the store)."""
        run = ctx.get(self._run_key)
        state = ctx.agent_state
        return {"run": run.spend() if isinstance(run, RunTotals) else Spend(),
                "session": self.session_spent(state) if state is not None else Spend(),
                "user": self.user_seen(ctx.user_id)}

    def user_seen(self, user_id: str) -> Spend:
        """``user_id``'s totals as of this middleware's last update (``await user_spent(...)``
        reads the store)."""
        return self._user_seen.get(user_id) or Spend()

    def session_spent(self, state: AgentState) -> Spend:
        raw = state.metadata.get(self.name_key) or {}
        return Spend(int(raw.get("tokens", 0)), float(raw.get("cost", 0.0)), int(raw.get("calls", 0)))

    async def user_spent(self, user_id: str) -> Spend:
        return await self.store.get(user_id)

    # -- hooks -----------------------------------------------------------------------------------

    def on_agent_state_ready(
        self, agent: AgentView, ctx: RuntimeContext, state: AgentState, input_messages: list[Msg]
    ) -> None:
        parent = ctx.parent
        shared = parent.get(self._run_key) if parent is not None else None
        # Inherited by a sub-agent (this instance runs in a caller's run too): one budget for the
        # tree, the root run's totals (whose context holds the session the scope counts in).
        # (type(), not isinstance(): RunTotals is a Mapping, whose isinstance is Python-level code)
        if type(shared) is RunTotals:
            totals = shared
        else:  # (the root run's: its session holds the totals the scope counts in)
            totals = RunTotals(self, ctx)
            raw = state.metadata.get(self.name_key)
            if raw is not None and not _are_totals(raw):
                check_counts(ctx, state.metadata, self.name_key, _SESSION_FIELDS, "session's budget totals")
        ctx.put(self._run_key, totals)
        publish_metric(ctx, self.name_key, totals)  # AgentRun.metrics[name]

    def on_model_call(self, agent: AgentView, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        model_name = str(getattr(input.model, "name", ""))
        price = self._price_of.get(model_name, _UNSEEN)
        if price is _UNSEEN:
            price = self.price(model_name)
        if price is None and self.strict:
            problem = f"strict budget: no price for model {model_name!r}; pass prices={{...}}"
            return EventStream.error(ValueError(problem))
        est_tokens = self.estimate(input)
        run = ctx.get(self._run_key)  # this execution's totals, read once per call
        if run is None:  # (a hook driven by hand, outside a run: no state-ready hook made them)
            run = RunTotals(self, ctx)
            ctx.put(self._run_key, run)
        # The hold is taken when the stream is subscribed (a stream built and never run holds
        # nothing); the inner stream is built here, in the hook's context (`_SyncCall`, `_Metered`).
        if self._sync:
            return EventStream(_SyncCall(self, ctx, run, next(input), model_name, price, est_tokens))
        return EventStream(_Metered((self, ctx, run, next(input), model_name, price, est_tokens)))

    # -- the metered call ------------------------------------------------------------------------

    async def _metered(self, ctx: RuntimeContext, run: RunTotals, inner: EventStream[Any], model: str,
                       price: ModelPrice | None, est_tokens: int) -> Any:
        """A metered call whose user holds are in a store across the network, as a stream layer of
        its own (`_SyncCall` is the one for holds in this process)."""
        in_rate = 0.0 if price is None else price.input / 1_000_000
        out_rate = 0.0 if price is None else price.output / 1_000_000
        hold = CallHold(self, ctx, run)
        chars = 0  # output characters counted in the running attempt
        out_held = 0  # output tokens its hold covers
        attempt = False  # a ModelCallStart seen without its End: a model answered
        released = OpenBrackets(top_only=True)  # what this layer let out: closed here if the call is cut short
        it: Any = None
        done = False
        failed: Exception | None = None  # the error ending the call, if one does
        try:  # (from the first take: a cancellation while the store answers releases what it took)
            refused = await hold.take(est_tokens, est_tokens * in_rate)
            if refused is not None:
                for ev in self._refusal(refused):
                    yield ev
                return
            it = inner.__aiter__()
            while True:
                try:
                    ev = await it.__anext__()
                except StopAsyncIteration:
                    done = True
                    break
                cls = ev.__class__
                if cls in _OUTPUT_DELTAS:
                    if ev.source is None and attempt:  # (`_SyncCall.see`: output of a model call only)
                        # Counted once its hold is there: a call cut while the store answers (an
                        # interrupt) is charged what it let out, not the delta it was holding for.
                        counted = chars + len(ev.delta)
                        need = -(-counted // 4) - out_held
                        if need > 0:
                            # A step ahead: a long reply asks the store once per step; if the step
                            # does not fit, exactly what is needed. (In this process, `_SyncCall`
                            # holds exactly: a step held ahead by each call in flight cuts calls
                            # short while the spend is still below the limit.)
                            ahead = need + _STEP
                            refused = await hold.take(ahead, ahead * out_rate, "stream")
                            if refused is not None:
                                ahead = need
                                refused = await hold.take(need, need * out_rate, "stream")
                            if refused is not None:
                                await aclose(it)  # the model request ends now
                                done, attempt = True, False
                                out = -(-chars // 4)  # what was let out (not this delta)
                                for closing in await self._cut(ctx, run, hold, released, est_tokens + out,
                                                               est_tokens * in_rate + out * out_rate, refused):
                                    yield closing
                                for stop in self._refusal(refused):
                                    yield stop
                                return
                            out_held += ahead
                        chars = counted
                elif cls in _BRACKETS and ev.source is None:
                    released.see(ev)
                    if cls is ModelCallStart:
                        attempt = True
                        if ev.model != model:  # a fallback (inside this layer) served this attempt
                            model, price = ev.model, self.price(ev.model)
                            out_rate = 0.0 if price is None else price.output / 1_000_000
                        if not hold.active:  # a retry's next attempt: the model has its input already
                            await hold.take(est_tokens, est_tokens * in_rate, force=True)
                        chars = out_held = 0
                    elif cls is _ModelCallEnd:
                        attempt = False
                        ev = await self._settle(ctx, run, hold, ev, ev.model or model, est_tokens, chars)
                        chars = out_held = 0
                yield ev
        except Exception as exc:
            failed = exc
            raise
        finally:
            if it is not None and not done:
                await aclose(it)
            if attempt:  # failed, cancelled or left by its consumer mid-call: what was counted was spent
                out = -(-chars // 4)
                tokens, cost = est_tokens + out, est_tokens * in_rate + out * out_rate
                self._charge(run, tokens, cost, hold)
                await _after(hold.settle_user(tokens, cost), failed)
            elif hold.active or hold.id is not None:  # no model answered: nothing is charged
                await _after(hold.release(), failed)

    def _measure(self, usage: ChatUsage | None, model: str, est_tokens: int, chars: int) -> tuple[int, float]:
        """A call's tokens and cost at its ModelCallEnd, priced as the model that served it: its
        usage, or (unknown) its estimate and its output counted."""
        price = self._price_of.get(model, _UNSEEN)
        if price is _UNSEEN:
            price = self.price(model)
        if price is None:
            if self.strict:
                raise ValueError(f"strict budget: no price for model {model!r} (it served the call); "
                                 "pass prices={...}")
            if self._cost_limited and model not in self._warned:
                self._warned.add(model)
                log.warning("%s: no price for model %r: its calls count as cost 0", self.name, model)
        if usage is None:
            out = -(-chars // 4)
            cost = 0.0 if price is None else (est_tokens * price.input + out * price.output) / 1_000_000
            return est_tokens + out, cost
        fields = usage.__dict__
        return fields["input_tokens"] + fields["output_tokens"], price._cost_of(fields) if price is not None else 0.0

    def settle_now(self, ctx: RuntimeContext, run: RunTotals, hold: CallHold, ev: ModelCallEnd, model: str,
                   est_tokens: int, chars: int) -> ModelCallEnd:
        """At a call's own ModelCallEnd: charge its usage, drop its hold, and annotate the event
        (holds in this process)."""
        tokens, cost = self._measure(ev.usage, model, est_tokens, chars)
        totals = self._charge(run, tokens, cost, hold)  # the run's and session's totals and holds, in one step
        user = hold.settle_user_now(tokens, cost) if self.memory_store is not None else None
        return self._annotate(ctx, ev, tokens, cost, totals, user)

    async def _settle(self, ctx: RuntimeContext, run: RunTotals, hold: CallHold, ev: ModelCallEnd, model: str,
                      est_tokens: int, chars: int) -> ModelCallEnd:
        """`settle_now` with the user's hold in a store across the network."""
        tokens, cost = self._measure(ev.usage, model, est_tokens, chars)
        totals = self._charge(run, tokens, cost, hold)
        return self._annotate(ctx, ev, tokens, cost, totals, await hold.settle_user(tokens, cost))

    def cut_now(self, ctx: RuntimeContext, run: RunTotals, hold: CallHold, released: OpenBrackets,
                tokens: int, cost: float, refused: dict[str, Any]) -> list[Any]:
        """The Ends of a call cut short by its own output: its open blocks', then its ModelCallEnd
        (annotated: what was counted is charged); the refusal follows them (holds in this process)."""
        closing, totals = self._close_and_charge(run, hold, released, tokens, cost, refused)
        user = hold.settle_user_now(tokens, cost)
        return [self._annotate(ctx, ev, tokens, cost, totals, user) if ev.__class__ is _ModelCallEnd else ev
                for ev in closing]

    async def _cut(self, ctx: RuntimeContext, run: RunTotals, hold: CallHold, released: OpenBrackets,
                   tokens: int, cost: float, refused: dict[str, Any]) -> list[Any]:
        """`cut_now` with the user's hold in a store across the network."""
        closing, totals = self._close_and_charge(run, hold, released, tokens, cost, refused)
        user = await hold.settle_user(tokens, cost)
        return [self._annotate(ctx, ev, tokens, cost, totals, user) if ev.__class__ is _ModelCallEnd else ev
                for ev in closing]

    def _close_and_charge(self, run: RunTotals, hold: CallHold, released: OpenBrackets, tokens: int, cost: float,
                          refused: dict[str, Any]) -> tuple[list[Any], Any]:
        """The Ends of what the cut call let out, and the run's totals once what it counted is charged."""
        closing = released.close(f"BudgetExceeded: {refused['reason']}", discarded=self.on_exceeded == "error",
                                 failed=True)
        totals = self._charge(run, tokens, cost, hold)
        return closing, totals

    def _refusal(self, info: dict[str, Any]) -> tuple[Any, ...]:
        """The refusal's events (``on_exceeded="stop"``); raises `BudgetExceeded` (``"error"``)."""
        if self.on_exceeded == "error":
            raise _exceeded(info)
        return (Custom(name="budget_exceeded", value=info), RequestStop(reason=info["reason"]))

    # -- the checks ------------------------------------------------------------------------------

    def check_local(self, run: RunTotals, tokens: int, cost: float, stage: str = "before") -> dict[str, Any] | None:
        """The refusal of holding ``tokens`` / ``cost`` more in the run's and the root session's
        scopes (``spent + held + request > limit``), or None. No Spend is built unless refused."""
        session: Any = None
        if self._session_limited:
            state = run._state  # the tree's root session
            session = state.metadata.get(self.name_key) if state is not None else None
        for scope, kind, limit, tokens_kind in self._limit_list:
            if scope == "run":
                spent: float = run.tokens if tokens_kind else run.cost
            elif scope == "session":
                spent = session.get(kind, 0) if isinstance(session, dict) else 0
            else:
                continue  # the store checks the user's, in its own atomic step
            held = run.held_tokens if tokens_kind else run.held_cost
            if spent + held + (tokens if tokens_kind else cost) > limit:
                return _info(scope, kind, limit, spent, held, tokens if tokens_kind else cost, stage)
        return None

    def user_refusal(self, answer: Reservation, tokens: int, cost: float, stage: str = "before") -> dict[str, Any]:
        """The refusal the store's ``answer`` means (the user limit it crossed)."""
        spent = answer.spent
        for kind, limit in zip(("tokens", "cost"), self.user_limits, strict=True):
            if limit is None:
                continue
            if kind == "tokens" and spent.tokens + answer.held_tokens + tokens > limit:
                return _info("user", kind, limit, spent.tokens, answer.held_tokens, tokens, stage)
            if kind == "cost" and spent.cost + answer.held_cost + cost > limit:
                return _info("user", kind, limit, spent.cost, answer.held_cost, cost, stage)
        # (a store that refused on arithmetic of its own, e.g. Redis' floats: the first user limit)
        kind, limit = next((k, v) for k, v in zip(("tokens", "cost"), self.user_limits, strict=True) if v is not None)
        if kind == "tokens":
            return _info("user", kind, limit, spent.tokens, answer.held_tokens, tokens, stage)
        return _info("user", kind, limit, spent.cost, answer.held_cost, cost, stage)

    def saw_user(self, user_id: str, spent: Spend) -> None:
        self._user_seen[user_id] = spent

    # -- the accounting --------------------------------------------------------------------------

    def _charge(self, run: RunTotals, tokens: int, cost: float,
                hold: CallHold) -> tuple[int, float, int, int, float, int]:
        """Grow the run's and the session's totals in place (no Spend) by a call's usage, and drop
        its hold there (`CallHold.drop_local`), in one step: the new totals."""
        run.tokens = r_tokens = run.tokens + tokens  # in place: the run's own totals
        run.cost = r_cost = run.cost + cost
        run.calls = r_calls = run.calls + 1
        hold.drop_local()
        state = run._state  # (a sub-agent's calls count in its tree's root session)
        if state is None:
            return r_tokens, r_cost, r_calls, 0, 0.0, 0
        name = self.name_key
        raw = state.metadata.get(name)
        if not isinstance(raw, dict):
            raw = state.metadata[name] = {"tokens": 0, "cost": 0.0, "calls": 0}
        raw["tokens"] = s_tokens = raw["tokens"] + tokens  # in place: the state is this session's own
        raw["cost"] = s_cost = raw["cost"] + cost
        raw["calls"] = s_calls = raw["calls"] + 1
        return r_tokens, r_cost, r_calls, s_tokens, s_cost, s_calls

    def _annotate(self, ctx: RuntimeContext, ev: ModelCallEnd, tokens: int, cost: float,
                  totals: tuple[int, float, int, int, float, int], user: Spend | None) -> ModelCallEnd:
        """``ev`` with ``metadata[name]``: the call, the totals after it, the first limit crossed."""
        r_tokens, r_cost, r_calls, s_tokens, s_cost, s_calls = totals
        if user is not None:
            u_tokens, u_cost, u_calls = user.tokens, user.cost, user.calls
        else:
            u_tokens, u_cost, u_calls = 0, 0.0, 0
        exceeded = None
        # (only the run's scope limited and within its limits, the common case: none is crossed)
        limits = (self._limit_list if self._beyond_run or r_tokens > self._run_max_tokens or r_cost > self._run_max_cost
                  else ())
        for scope, kind, limit, tokens_kind in limits:  # the first limit crossed, in order
            if scope == "run":
                spent: float = r_tokens if tokens_kind else r_cost
            elif scope == "session":
                spent = s_tokens if tokens_kind else s_cost
            else:
                spent = u_tokens if tokens_kind else u_cost
            if spent > limit:
                exceeded = f"{scope} {kind} limit {limit} crossed: spent {spent:g}"
                break
        # A copy: events are immutable, and an inner layer (a cache recording, an audit) may hold
        # this very object (`with_metadata`: model_copy's result, without its generic machinery).
        note = {
            "call": {"tokens": tokens, "cost": cost, "estimated": ev.usage is None},
            "run": {"tokens": r_tokens, "cost": r_cost, "calls": r_calls},
            "session": {"tokens": s_tokens, "cost": s_cost, "calls": s_calls},
            "user": {"tokens": u_tokens, "cost": u_cost, "calls": u_calls},
            "exceeded": exceeded,
        }
        metadata = ev.metadata
        return with_metadata(ev, {**metadata, self.name_key: note} if metadata else {self.name_key: note})


class CallHold:
    """One model call's hold on the budget's limits, from before the call until it is settled or
    released: the tokens and cost it holds (``tokens``, ``cost``; ``active`` while it holds).

    A check that reads the spend before a call and adds the usage after it lets every call that runs
    at once pass: ten sub-agents started by one model turn each see the spend before any of them ends.
    So a call first **takes** its estimate in every limited scope — granted only if the spend plus
    every hold of the calls in flight plus the request stays within each limit, in one step (no await
    between the run's and the session's check and their hold; the user's in the store's own atomic
    step) — then grows its hold as its output streams, and at its end the hold is **settled** (dropped,
    and the actual usage charged) or **released** (dropped, nothing charged).

    Where holds live: the run's and the root session's in the tree's `RunTotals` (``held_tokens``,
    ``held_cost``: a session runs one execution at a time, so its calls in flight are that tree's); the
    user's in the `BudgetStore`, under this hold's id.

    Each step has a synchronous form (``*_now``) for a budget whose holds are all in this process (no
    user limit, or an `InMemoryBudgetStore`): no coroutine per step, and nothing between the check and
    the hold."""

    # (No __slots__: what a hold starts from is a class attribute, not set per call.)
    tokens = 0
    cost = 0.0
    active = False
    id: str | None = None  # the store's hold, made at the first take with a user limit
    # The output characters the call counts with no take: what its hold covers, or, while it is
    # the run's call alone in flight (`RunTotals._alone`), the room it has (`_SyncCall`).
    free: float = 0

    def __init__(self, budget: BudgetMiddleware, ctx: RuntimeContext, run: RunTotals) -> None:
        self.budget = budget
        self.ctx = ctx
        self.run = run

    # -- taking ----------------------------------------------------------------------------------

    def _refused_locally(self, tokens: int, cost: float, stage: str) -> dict[str, Any] | None:
        """The refusal of holding ``tokens`` / ``cost`` more in the run and the session, if any.
        Within the run's limits with no session limit (the common case), two comparisons decide;
        else `BudgetMiddleware.check_local` does (and spells out a refusal)."""
        run, budget = self.run, self.budget
        if (budget._session_limited or run.tokens + run.held_tokens + tokens > budget._run_max_tokens
                or run.cost + run.held_cost + cost > budget._run_max_cost):
            return budget.check_local(run, tokens, cost, stage)
        return None

    def take_now(self, tokens: int, cost: float, stage: str = "before", force: bool = False) -> dict[str, Any] | None:
        """Hold ``tokens`` / ``cost`` more in every limited scope; or, when that would cross a
        limit, hold nothing and answer the refusal (``stage``: before the call or while it
        streams). ``force``: hold without checking (what a call already made spends). For a
        budget whose holds are all in this process: nothing comes between the checks and the
        holds, so the store is asked first and the run's hold taken only when it grants."""
        run, budget = self.run, self.budget
        self._alone_holds_first()
        if not force and budget.local_limited:
            refused = self._refused_locally(tokens, cost, stage)
            if refused is not None:
                return refused
        memory = budget.memory_store
        if memory is not None:
            if self.id is None:
                self.id = new_hold_id()
            max_tokens, max_cost = (None, None) if force else budget.user_limits
            answer = memory.reserve_nowait(self.ctx.user_id, self.id, tokens, cost, max_tokens, max_cost)
            budget.saw_user(self.ctx.user_id, answer.spent)
            if not answer.granted:
                if not self.active:  # (its first take: the store holds nothing under this id)
                    self.id = None
                return budget.user_refusal(answer, tokens, cost, stage)
        if not self.active:
            self.active = True
            run.holds += 1
        run.held_tokens += tokens
        run.held_cost += cost
        self.tokens += tokens
        self.cost += cost
        return None

    async def take(self, tokens: int, cost: float, stage: str = "before", force: bool = False) -> dict[str, Any] | None:
        """`take_now` with the user's hold in a store across the network."""
        refused = self._take_local(tokens, cost, stage, force)
        if refused is not None:
            return refused
        if self.id is None:
            self.id = new_hold_id()
        limits = (None, None) if force else self.budget.user_limits
        try:  # (the run's wait: an interrupt ends it at once; the hold, made or not, is released)
            answer = await self.ctx.wait(self.budget.store.reserve(self.ctx.user_id, self.id, tokens, cost, *limits))
        except BaseException:
            self._undo_local(tokens, cost)
            raise
        return self._answered(answer, tokens, cost, stage)

    def _take_local(self, tokens: int, cost: float, stage: str, force: bool) -> dict[str, Any] | None:
        """The run's and session's check and hold (first: calls checked while a store answers
        see it)."""
        run, budget = self.run, self.budget
        self._alone_holds_first()
        if not force and budget.local_limited:
            refused = self._refused_locally(tokens, cost, stage)
            if refused is not None:
                return refused
        if not self.active:
            run.holds += 1
        run.held_tokens += tokens
        run.held_cost += cost
        return None

    def _alone_holds_first(self) -> None:
        """Before this call takes: the run's call in flight alone, if another, holds the output it
        let out (`_SyncCall.sync`), so this take's check counts it."""
        alone = self.run._alone
        if alone is not None and alone is not self:
            alone.sync()

    def _answered(self, answer: Reservation, tokens: int, cost: float, stage: str) -> dict[str, Any] | None:
        budget = self.budget
        budget.saw_user(self.ctx.user_id, answer.spent)
        if not answer.granted:
            self._undo_local(tokens, cost)
            if not self.active:  # (its first take: the store holds nothing under this id)
                self.id = None
            return budget.user_refusal(answer, tokens, cost, stage)
        self._took(tokens, cost)
        return None

    def _took(self, tokens: int, cost: float) -> None:
        self.tokens += tokens
        self.cost += cost
        self.active = True

    def _undo_local(self, tokens: int, cost: float) -> None:
        run = self.run
        run.held_tokens -= tokens
        run.held_cost -= cost
        if not self.active:  # (its first take: the call holds nothing)
            self._left(run)

    # -- settling and releasing ------------------------------------------------------------------

    def drop_local(self) -> None:
        """Drop the run's and session's hold (in the step that charges them)."""
        self.free = 0
        if not self.active:
            return
        run = self.run
        run.holds -= 1
        if run.holds <= 0:  # no call in flight: the sums start over (`_left`), and none is alone
            run.holds, run.held_tokens, run.held_cost, run._alone = 0, 0, 0.0, None
        else:  # (a call alone is the one call holding: it is not this one)
            run.held_tokens -= self.tokens
            run.held_cost -= self.cost
        self.tokens, self.cost, self.active = 0, 0.0, False

    @staticmethod
    def _left(run: RunTotals) -> None:
        run.holds -= 1
        if run.holds <= 0:  # no call in flight: the sums start over (no float residue kept)
            run.holds, run.held_tokens, run.held_cost = 0, 0, 0.0

    def settle_user_now(self, tokens: int, cost: float) -> Spend | None:
        """Drop the user's hold and charge the call there (after `drop_local`); in this process."""
        memory = self.budget.memory_store
        if memory is None:
            return None
        hold_id, self.id = self.id, None
        user_id = self.ctx.user_id
        user = (memory.add_nowait(user_id, tokens, cost) if hold_id is None
                else memory.settle_nowait(user_id, hold_id, tokens, cost))
        self.budget.saw_user(user_id, user)
        return user

    async def settle_user(self, tokens: int, cost: float) -> Spend:
        """`settle_user_now` with a store across the network."""
        hold_id, self.id = self.id, None
        store, user_id = self.budget.store, self.ctx.user_id
        if hold_id is None:  # (every take was refused: no hold, the usage is charged all the same)
            user = await _to_its_end(store.add(user_id, tokens, cost))
        else:
            user = await _to_its_end(store.settle(user_id, hold_id, tokens, cost))
        self.budget.saw_user(user_id, user)
        return user

    def release_now(self) -> None:
        """Drop the hold everywhere and charge nothing (a call that never reached a model); in
        this process."""
        self.drop_local()
        hold_id, self.id = self.id, None
        memory = self.budget.memory_store
        if hold_id is not None and memory is not None:
            memory.release_nowait(self.ctx.user_id, hold_id)

    async def release(self) -> None:
        """`release_now` with a store across the network."""
        self.drop_local()
        hold_id, self.id = self.id, None
        if hold_id is not None:
            await _to_its_end(self.budget.store.release(self.ctx.user_id, hold_id))


async def _to_its_end(end: Awaitable[T]) -> T:
    """A settle or release in a store across the network, run to its end even when the call's
    task is cancelled while it waits (a cancellation at its end — a hedge's loser ended, a
    shutdown — may come twice): cut in the middle, it would leave the hold in the store until its
    lease ends. The cancellation still ends this wait; the store's answer then goes nowhere, and
    its failure is logged."""
    task = asyncio.ensure_future(end)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_log_unheard)
        raise


def _log_unheard(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("budget: a hold's settle or release failed after its call was cancelled: %s: %s",
                    type(task.exception()).__name__, task.exception())


async def _after(end: Awaitable[Any], failed: Exception | None) -> None:
    """Await a call's settle or release in the store. When an error already ends the call (the
    store failing mid-call, as often as not), a failure here too is logged: the caller sees the
    first error, which says what went wrong, not the cleanup's."""
    if failed is None:
        await end
        return
    try:
        await end
    except Exception as exc:
        log.warning("budget: ending a failed call's hold failed too (%s: %s); the call's error is %s: %s",
                    type(exc).__name__, exc, type(failed).__name__, failed)


class _Metered(MapSource):
    """A metered call's stream factory, for a budget whose user holds are in a store across the
    network (`BudgetMiddleware._metered`; `_SyncCall` is the one for holds in this process).
    Subscribing it reads no context of its own — the inner stream was built by next() inside the
    hook and carries its own, and the budget's code uses none — so the middleware chain adds no
    context wrapper (no context switch per event)."""

    __slots__ = ("args",)

    context_free = True

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.args = args

    def with_maps(self, maps: Maps) -> AsyncIterator[Any]:
        budget, ctx, run, inner, model, price, est_tokens = self.args
        it: AsyncIterator[Any] = budget._metered(ctx, run, inner, model, price, est_tokens)
        return apply_maps(it, maps) if maps else it


class _SyncCall(CallHold, MapSource):
    """A metered call whose holds are all in this process (`BudgetMiddleware._sync`): its hold
    (a `CallHold`), and its stream's factory (subscribing it reads no context of its own, as
    `_Metered`), at no async layer of its own: the per-event work — counting the output, growing
    the hold, settling it at the call's ModelCallEnd — is a map fused into the inner stream
    (`see`, run where the model call's buffer is drained), and `_SyncCallIterator` hands on the
    inner stream's awaitables. It steps in only to end a call cut short (`see` puts the first
    closing event in place of the refused delta; the rest follow from `pending`), and `finish`
    settles what was counted or releases the hold however the stream ended. (This object does not
    refer to the iterator, which refers to it: no reference cycle, so the iterator goes as soon as
    its consumer lets it go.) A stream subscribed again is a call of its own (`again`).

    Read with no events (`building`: a ``call()`` that nothing observes), this object is the
    reply the model call hands its parts to (`_replies.ReplyParts`): it meters each part as `see`
    meters its event and hands it on to the round's builder (``reply``), and a cut hands that
    builder what the closing events would (`_cut_unread`)."""

    # (What most calls leave as it starts is a class attribute, as `CallHold`'s, not set per call.)
    context_free = True
    reply: ReplyParts
    chars = 0  # output characters counted in the running attempt
    out_held = 0  # output tokens its hold covers
    attempt = False  # a ModelCallStart seen without its End: a model answered
    pending: list[Any] | None = None  # the rest of a cut: closing events, then the refusal
    error: BaseException | None = None  # ... or the refusal raised (on_exceeded="error")
    maps: Maps = ()
    subscribed = False
    # Read with no events (`building`): ``reply``, the builder the parts go on to (set there);
    # the thinking block open there (a cut closes it).
    thinking_id: str | None = None
    resumed = False  # failed before its first event: what follows is a layer outside's next attempt
    in_rate = out_rate = 0.0  # USD per input and output token (no price: none)

    def __init__(self, budget: BudgetMiddleware, ctx: RuntimeContext, run: RunTotals, inner: EventStream[Any],
                 model: str, price: ModelPrice | None, est_tokens: int) -> None:
        self.budget = budget  # (`CallHold.__init__`'s, inline: one call fewer per model call)
        self.ctx = ctx
        self.run = run
        self.inner = inner
        self.model = model
        self.priced = (model, price)  # (what `again` starts from: a fallback changes ``model``)
        if price is not None:
            self.in_rate, self.out_rate = price.input / 1_000_000, price.output / 1_000_000
        self.est_tokens = est_tokens
        # The top-level Starts and Ends let out, in order: what a cut closes (`_cut` reads which are
        # open from them). A list append per bracket, where tracking them as they pass would be a
        # call per bracket for what only a cut needs.
        self.brackets: list[Any] = []

    def again(self) -> _SyncCall:
        """This call afresh, for another subscription of its stream."""
        model, price = self.priced
        return _SyncCall(self.budget, self.ctx, self.run, self.inner, model, price, self.est_tokens)

    def with_maps(self, maps: Maps) -> AsyncIterator[Any]:
        if self.subscribed:
            return self.again().with_maps(maps)
        self.subscribed = True
        return self.start(maps)

    def recovering(self, maps: Maps, recovery: Recovery) -> AsyncIterator[Any] | None:
        """`with_maps`, a failure before the first event handed to ``recovery`` by the model
        call's own stream (a retry outside then adds no iterator of its own around this call):
        ``inner`` subscribed by its `MapSource.recovering` (``see`` and the maps before it among
        the failing stream's own); None, holding nothing, when it cannot or the call is refused (a
        refusal then goes as it goes without recovery: through the caller's own iterator, which
        judges a `BudgetExceeded` raised)."""
        if self.subscribed:
            return self.again().recovering(maps, recovery)
        inner = self.inner
        factory, own = inner._factory, maps_of(inner._steps)
        if own is None or not isinstance(factory, MapSource):
            return None
        if self.take_estimate() is not None:
            return None
        self.subscribed = True
        n, passes, resume = recovery
        recovered = factory.recovering((*own, self.see, *maps),
                                       (len(own) + 1 + n, passes, partial(self._resumed, resume)))
        if recovered is None:
            self.release_now()
            self.subscribed = False
            return None
        self.maps = maps
        return _SyncCallIterator(recovered, self)

    def building(
        self, reply: ReplyParts, alone: Callable[[], bool], recovery: Recovery | None = None,
    ) -> AsyncIterator[Any] | None:
        """The call read with no events (`MapSource.building`), when its inner stream can be read
        so: the hold taken, and this object the reply the inner call hands its parts to, metering
        them on their way to ``reply`` (`begin` … `end`), read through `_UnreadIterator`. A
        failure before anything reached ``reply`` goes to ``recovery`` once the hold is gone, as
        `recovering` hands it on. None, holding nothing, when the inner stream cannot be read so or
        the call is refused (the consumer subscribes this stream as usual: `start` gives the
        refusal, as it does to a call read as events)."""
        if self.subscribed:
            return self.again().building(reply, alone, recovery)
        inner = self.inner
        factory = inner._factory
        if inner._steps or not isinstance(factory, MapSource):
            return None
        if self.take_estimate() is not None:
            return None
        if recovery is not None:
            n, passes, resume = recovery
            recovery = (n, passes, partial(self._resumed, resume))
        it = factory.building(self, alone, recovery)
        if it is None:
            self.release_now()
            return None
        self.subscribed = True
        self.reply = reply
        return _UnreadIterator(it, self)

    def quiet_building(self) -> bool:
        """Quiet when its inner stream is (`MapSource.quiet_building`): `_UnreadIterator` yields
        the inner read's items, those a layer outside resumes with, and a refusal."""
        inner = self.inner
        factory = inner._factory
        return not inner._steps and isinstance(factory, MapSource) and factory.quiet_building()

    # The parts of the call read with no events (`building`), metered as `see` meters their events.

    def begin(self, model: str) -> None:
        self.attempt = True
        if model != self.model:  # a fallback (inside this layer) served this attempt
            self.model = model
            price = self.budget.price(model)
            self.out_rate = 0.0 if price is None else price.output / 1_000_000
        if self.chars:
            self._restart()
        if not self.active:  # a retry's next attempt: the model has its input already
            self.take_now(self.est_tokens, self.est_tokens * self.in_rate, force=True)
        self.thinking_id = None
        self.reply.begin(model)

    def text(self, block_id: str, delta: str) -> None:
        self._count(delta)
        self.reply.text(block_id, delta)

    def thinking(self, block_id: str, delta: str) -> None:
        self.thinking_id = block_id
        self._count(delta)
        self.reply.thinking(block_id, delta)

    def signed(self, block_id: str, signature: str | None) -> None:
        self.thinking_id = None
        self.reply.signed(block_id, signature)

    def tool_call(self, call_id: str, name: str, delta: str | None = None) -> None:
        if delta is not None:
            self._count(delta)
        self.reply.tool_call(call_id, name, delta)

    def end(self, usage: ChatUsage | None, finish_reason: str | None, discarded: bool,
            error: str | None = None) -> None:
        # `settle_now`'s charge, and no ``metadata[name]`` note, which only a ModelCallEnd would carry
        self.attempt = False
        budget = self.budget
        tokens, cost = budget._measure(usage, self.model, self.est_tokens, self.chars)
        budget._charge(self.run, tokens, cost, self)
        if budget.memory_store is not None:
            self.settle_user_now(tokens, cost)
        self.chars = self.out_held = 0
        self.reply.end(usage, finish_reason, discarded, error)

    def _count(self, delta: str) -> None:
        """An output delta: its characters counted, the hold grown to cover them (`see`), or the call cut."""
        self.chars = chars = self.chars + len(delta)
        if chars > self.free:
            refused = self.grow(len(delta))
            if refused is not None:
                self._cut_unread(delta, refused)

    def _cut_unread(self, delta: str, refused: dict[str, Any]) -> NoReturn:
        """`_cut` for a call read with no events: ``delta`` is not handed on; what was counted
        before it is charged; the builder is handed what the closing events would hand it (an
        open thinking block's End, with no signature; the ModelCallEnd that says why, discarded
        with ``on_exceeded="error"``); the refusal is left for `_UnreadIterator`; and the read ends
        (`_Cut`, raised through the model call, which closes its request as it unwinds)."""
        self.attempt = False
        out = -(-(self.chars - len(delta)) // 4)
        tokens, cost = self.est_tokens + out, self.est_tokens * self.in_rate + out * self.out_rate
        budget, reply = self.budget, self.reply
        budget._charge(self.run, tokens, cost, self)
        self.settle_user_now(tokens, cost)
        if self.thinking_id is not None:
            reply.signed(self.thinking_id, None)
        reply.end(None, None, budget.on_exceeded == "error", f"BudgetExceeded: {refused['reason']}")
        try:
            self.pending = list(budget._refusal(refused))
        except BudgetExceeded as exc:
            self.pending, self.error = [], exc
        raise _Cut(self)

    def _resumed(self, resume: Callable[[Exception], AsyncIterator[Any]], error: Exception) -> AsyncIterator[Any]:
        """The call failed before its first event: its hold goes before the next attempt is made
        (the attempt of a layer outside: its items are not this call's)."""
        self.finish()
        self.resumed = True
        return resume(error)

    # The output's holds. Each output delta is counted (``chars``); past what the hold covers
    # (``free``) the hold grows to cover it, or the call is cut. A call alone in flight, in a
    # budget that limits only the run's tokens, holds its estimate only, and ``free`` is the room
    # the limit leaves it: while no other call takes, the check a take would make is that one
    # comparison. A take by another call first has it hold its output (`sync`), so from there on
    # every check sees it, as it would had each delta been held as it came.

    def take_estimate(self) -> dict[str, Any] | None:
        """Hold the estimate (`take_now`); the call alone in flight of a budget that limits only
        the run's tokens counts its output against its room from here (``free``)."""
        run, budget, est = self.run, self.budget, self.est_tokens
        cost = est * self.in_rate
        if run.holds or not budget.run_tokens_only:
            return self.take_now(est, cost)
        # Alone: nothing is held in the run (nor to be had held first), and one comparison is
        # `take_now`'s check; a refusal goes there to be spelt out.
        room = budget._run_max_tokens - run.tokens - est  # (whole tokens, or inf)
        if room < 0:
            return self.take_now(est, cost)
        run.holds, run.held_tokens, run.held_cost, run._alone = 1, est, cost, self
        self.tokens, self.cost, self.active = est, cost, True
        self.free = 4 * room  # a delta is refused when ceil(chars / 4) > room, that is chars > 4 * room
        return None

    def sync(self, pending: int = 0) -> None:
        """Hold the output counted (but ``pending`` characters, a delta not checked yet), which
        went out within the room this call had alone, and leave that: each delta from here takes
        its hold."""
        self.run._alone = None
        self._hold_output(self.chars - pending, force=True)

    def grow(self, n: int) -> dict[str, Any] | None:
        """The output counted past ``free`` (the last ``n`` characters the delta that crossed it):
        the hold grown to cover it, or the refusal (nothing held)."""
        if self.run._alone is self:
            self.sync(n)
        return self._hold_output(self.chars)

    def _hold_output(self, chars: int, force: bool = False) -> dict[str, Any] | None:
        """The hold grown to cover ``chars`` output characters (``ceil(chars / 4)`` tokens), and
        ``free`` to what it covers; or the refusal (nothing held)."""
        need = -(-chars // 4) - self.out_held
        if need > 0:
            refused = self.take_now(need, need * self.out_rate, "stream", force)
            if refused is not None:
                return refused
            self.out_held += need
        self.free = 4 * self.out_held
        return None

    def _restart(self) -> None:
        """An attempt starts after one that ended with no End of its own: that one's output stays
        held until the call settles, and this one's is counted afresh."""
        if self.run._alone is self:
            self.sync()
        self.chars = self.out_held = 0
        self.free = 0

    def start(self, maps: Maps) -> AsyncIterator[Any]:
        """Take the hold (or refuse) and subscribe the inner stream with ``see`` and ``maps`` fused."""
        refused = self.take_estimate()
        if refused is not None:
            try:
                events = self.budget._refusal(refused)
            except BudgetExceeded as exc:
                return EventStream.error(exc).__aiter__()
            return apply_maps(iterate(events), maps) if maps else iterate(events)
        self.maps = maps
        # ``inner.map(self.see)``, then ``maps``, subscribed: a `MapSource` with only maps of its
        # own (the model call's prefetch) takes them all at once, as `EventStream.__aiter__` would
        # give them, with no stream made per map on the way (as `FirstFailure` subscribes).
        inner = self.inner
        factory, own = inner._factory, maps_of(inner._steps)
        if own is not None and isinstance(factory, MapSource):
            it = factory.with_maps((*own, self.see, *maps))
            return _SyncCallIterator(it, self) if _model_calls_own(factory) else _EndingIterator(it, self)
        stream = inner.map(self.see)
        for fn in maps:
            stream = stream.map(fn)
        return _EndingIterator(stream.__aiter__(), self)

    def see(self, ev: Any) -> Any:
        cls = ev.__class__
        if cls in _OUTPUT_DELTAS:
            # Only a model call's output is metered: text a layer inside adds after the call's End
            # (a guardrail's refusal) is no model's, and would otherwise be held as a call's.
            if ev.source is None and self.attempt:
                self.chars = chars = self.chars + len(ev.delta)
                if chars > self.free:
                    refused = self.grow(len(ev.delta))
                    if refused is not None:
                        return self._cut(ev, refused)
        elif cls in _BRACKETS and ev.source is None:
            self.brackets.append(ev)
            if cls is ModelCallStart:
                self.attempt = True
                if ev.model != self.model:  # a fallback (inside this layer) served this attempt
                    self.model = ev.model
                    price = self.budget.price(ev.model)
                    self.out_rate = 0.0 if price is None else price.output / 1_000_000
                if self.chars:
                    self._restart()
                if not self.active:  # a retry's next attempt: the model has its input already
                    self.take_now(self.est_tokens, self.est_tokens * self.in_rate, force=True)
            elif cls is _ModelCallEnd:
                self.attempt = False
                ev = self.budget.settle_now(self.ctx, self.run, self, ev, ev.model or self.model,
                                            self.est_tokens, self.chars)
                self.chars = self.out_held = 0
        return ev

    def _cut(self, ev: Any, refused: dict[str, Any]) -> Any:
        self.attempt = False
        out = -(-(self.chars - len(ev.delta)) // 4)  # what was let out (not this delta)
        released = OpenBrackets(top_only=True)
        for bracket in self.brackets:
            released.see(bracket)
        closing = self.budget.cut_now(self.ctx, self.run, self, released, self.est_tokens + out,
                                      self.est_tokens * self.in_rate + out * self.out_rate, refused)
        try:
            stop: list[Any] = list(self.budget._refusal(refused))
        except BudgetExceeded as exc:
            stop, self.error = [], exc
        self.pending = [*closing[1:], *stop]
        return closing[0]  # (in the refused delta's place: the maps outside see it in order)

    def finish(self) -> None:
        if self.attempt:  # failed, cancelled or left by its consumer mid-call: what was counted was spent
            self.attempt = False
            out = -(-self.chars // 4)
            tokens, cost = self.est_tokens + out, self.est_tokens * self.in_rate + out * self.out_rate
            self.budget._charge(self.run, tokens, cost, self)
            self.settle_user_now(tokens, cost)
        elif self.active or self.id is not None:  # no model answered: nothing is charged
            self.release_now()


class _SyncCallIterator:
    """`_SyncCall`'s stream: the inner iterator's awaitables, handed on; after a cut, the rest of
    it; on ``aclose`` (and when dropped unclosed), the call's `finish`. (Weakly referable, as an
    async generator is: `EventStream.aclose` closes the stream's latest iteration through a weak
    reference.)"""

    __slots__ = ("__weakref__", "call", "it", "open")

    def __init__(self, it: Any, call: _SyncCall) -> None:
        self.it = it
        self.call = call
        self.open = True  # the inner stream, until a cut or aclose closes it

    def __aiter__(self) -> _SyncCallIterator:
        return self

    def __anext__(self) -> Any:
        if self.call.pending is None:
            return self.it.__anext__()
        return self._after_cut()

    async def _after_cut(self) -> Any:
        if self.open:
            self.open = False
            await aclose(self.it)  # the model request ends now
        call = self.call
        pending = call.pending
        if pending:
            ev = pending.pop(0)
            for fn in call.maps:
                ev = fn(ev)
            return ev
        error, call.error = call.error, None
        if error is not None:
            raise error
        raise StopAsyncIteration

    async def aclose(self) -> None:
        try:
            if self.open:
                self.open = False
                await aclose(self.it)
        finally:
            self.call.finish()

    def __del__(self) -> None:
        if self.open:  # (closed: a cut, ``aclose`` or the end of a read that catches it settled the call)
            self.call.finish()


def _model_calls_own(factory: MapSource) -> bool:
    """Whether ``factory`` is the model call's own stream (in its context, perhaps), which ends
    with the call's ModelCallEnd or fails: only such a source applies maps with a failure's
    recovery (`MapSource.recovering`)."""
    while type(factory) is InContext:
        inner = factory.factory
        if not isinstance(inner, MapSource):
            return False
        factory = inner
    return type(factory).recovering is not MapSource.recovering


class _EndingIterator(_SyncCallIterator):
    """`_SyncCall`'s stream when its inner stream is not the model call's own (a hook inside
    makes it, `_model_calls_own`): such a hook may end the stream with no model call made — a limit inside that
    refuses the call ends it with its stop —, so the stream's end finishes the call, as `aclose`
    does. A consumer that reads a stream to its end does not close it, and the hold would
    otherwise wait until the iterator is collected: later still when a reference cycle holds it
    (a retry outside keeps its failed attempts' errors, whose tracebacks refer to the attempts).
    One coroutine per event, on a stream that already passes through that hook's layer."""

    __slots__ = ()

    def __anext__(self) -> Any:
        return self._next()

    async def _next(self) -> Any:
        call = self.call
        if call.pending is not None:
            return await self._after_cut()
        try:
            return await self.it.__anext__()
        except StopAsyncIteration:
            self.open = False
            call.finish()
            raise


class _UnreadIterator(_SyncCallIterator):
    """`_SyncCall.building`'s stream: the inner read, which hands the parts on and yields nothing
    (or the events of a stream it cannot read so, metered by `see`, as `start` meters them); its
    end settles the call (`finish`), and so does a failure, after the inner stream is closed
    (`aclose`). A cut by the call's own output (`_Cut`, raised through the inner read) ends the
    read, and the closing and refusal follow (`_after_cut`); a cut by a budget outside ends it
    too, on its way out. An iterator rather than an async generator: no hook of the loop's runs
    when it starts, and a call that is not cut takes one step of it."""

    __slots__ = ()

    async def __anext__(self) -> Any:
        call = self.call
        if call.pending is not None:
            return await self._after_cut()
        try:
            ev = await self.it.__anext__()
        except StopAsyncIteration:
            self.open = False
            call.finish()
            raise
        except _Cut as cut:
            if cut.args[0] is call:
                return await self._after_cut()
            await self.aclose()  # (a budget outside cut the call: it ends this read too)
            raise
        except BaseException:
            await self.aclose()
            raise
        return ev if call.resumed else call.see(ev)


class _Cut(BaseException):
    """Raised by a call read with no events when its output crosses a limit (`_SyncCall._cut_unread`):
    it ends the model call's read as a consumer that leaves ends it (no failure recorded, the
    request closed), up to the `_UnreadIterator` of the call that raised it (its one argument),
    which takes it (a budget inside that one ends its read too, on the way). A BaseException, as
    GeneratorExit is: no layer between them treats it as a failure to retry."""


def _info(scope: str, kind: str, limit: float, spent: float, held: float, estimate: float,
          stage: str) -> dict[str, Any]:
    """A refusal: ``stage`` ``"before"`` the call (its estimate did not fit) or ``"stream"`` (its
    output grew past what fits: it is cut short)."""
    unit = "tokens" if kind == "tokens" else "USD"
    in_flight = f", {held:g} held by calls in flight" if held else ""
    more = "this call ~" if stage == "before" else "this call's output ~"
    cut = "" if stage == "before" else "; the call is cut short"
    reason = (f"budget exceeded: {scope} {kind} limit {limit} {unit}; spent {spent:g}{in_flight}, "
              f"{more}{estimate:g} more (estimated){cut}")
    return {"scope": scope, "kind": kind, "limit": limit, "spent": spent, "held": held, "estimate": estimate,
            "stage": stage, "reason": reason}


def _exceeded(info: Mapping[str, Any]) -> BudgetExceeded:
    return BudgetExceeded(info["reason"], scope=info["scope"], kind=info["kind"], limit=info["limit"],
                          spent=info["spent"], estimate=info["estimate"])


_ModelCallEnd = ModelCallEnd
_OUTPUT_DELTAS = frozenset({TextBlockDelta, ThinkingBlockDelta, ToolCallDelta})  # what a call's output counts
_BRACKETS = BRACKET_TYPES  # (the Starts and Ends a cut closes; among them the call's own)
_STEP = 64  # output tokens a hold grows by ahead of the reply, with a store across the network
