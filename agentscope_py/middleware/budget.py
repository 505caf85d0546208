"""`BudgetMiddleware`: token and cost limits per run, per session and per user.

Where the totals live:

* **run** — in the `RuntimeContext` (reset when each execution's state is ready);
  a sub-agent that inherits this instance (`agent.as_tool`) shares its caller's run totals, and
  counts in the root's session: one budget for the whole tree;
* **session** — in ``AgentState.metadata[name]`` (``{"tokens", "cost", "calls"}``), so with a
  SQLite or Redis state store it survives restarts and is shared by every process of the session;
* **user** — in a `BudgetStore`: `InMemoryBudgetStore` (this process; the default) or
  `RedisBudgetStore` (shared by processes and hosts; atomic increments).

Checks, at ``on_model_call``:

* **before** each call: ``spent + estimate > limit`` for any scope refuses the call; the estimate
  is ``ceil(characters / 4)`` input tokens over the messages (text, thinking, tool arguments and
  results) and the tool schemas (pass ``estimate=`` for your own), priced as input tokens;
* **after** each call, from ``ModelCallEnd.usage`` (``None``, unknown, counts the estimate): the
  totals grow and the ModelCallEnd leaving this layer carries ``metadata[name]`` =
  ``{"call": {...}, "run": {...}, "session": {...}, "user": {...}, "exceeded": reason|None}``.
  A call that crosses a limit completes (its reply is kept, its tool calls run); the next call —
  in this run, or later in the session or for the user — is refused before the model is called.

Refusing: ``on_exceeded="stop"`` emits ``Custom(name="budget_exceeded", value={scope, kind, limit,
spent, estimate, reason})`` and ``RequestStop(reason)``: the run ends with
MIDDLEWARE_STOP_REQUESTED. ``on_exceeded="error"`` raises `BudgetExceeded(reason)`.

Cost: a price table of `ModelPrice` (USD per million tokens: input, output, cached input, cache
writes) per model name — `DEFAULT_PRICES` (list prices at the time of writing) updated with
``prices=``. A name matches exactly, else the longest entry it starts with (``gpt-4o-2024-08-06``
→ ``gpt-4o``), after a ``provider:`` or ``provider/`` prefix is dropped. A model without a price
costs 0 (logged once) — or, with ``strict=True``, is an error: ``models=`` named at construction
are checked there (`ValueError`), any other at its first call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial as _partial
from typing import TYPE_CHECKING, Any, Literal, cast

from .._fast_events import with_metadata
from ..errors import BudgetExceeded
from ..events import Custom, ModelCallEnd, RequestStop
from ..message import ChatUsage, Msg
from ..stream import EventStream
from .base import ExtensionPoint, MiddlewareBase, ModelCallInput, Next, publish_metric
from .budget_estimate import estimate_tokens
from .budget_stores import BudgetStore, InMemoryBudgetStore, RedisBudgetStore, RunTotals, Spend

if TYPE_CHECKING:
    from ..agent.context import RuntimeContext
    from ..agent.react import ReActAgent
    from ..agent.state import AgentState

__all__ = [
    "DEFAULT_PRICES", "BudgetMiddleware", "BudgetStore", "InMemoryBudgetStore", "ModelPrice", "RedisBudgetStore",
    "RunTotals", "Spend", "estimate_tokens",
]

log = logging.getLogger(__name__)
OnExceeded = Literal["stop", "error"]


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
        cached = usage.cache_read_tokens
        written = usage.cache_write_tokens
        plain = max(0, usage.input_tokens - cached - written)
        read_price = self.input if self.cached_input is None else self.cached_input
        write_price = self.input if self.cache_write is None else self.cache_write
        return (plain * self.input + cached * read_price + written * write_price
                + usage.output_tokens * self.output) / 1_000_000


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
        self._sync_store = getattr(self.store, "sync", False) is True
        self.estimate = estimate or estimate_tokens
        self.name_key = name
        self._run_key = f"agentscope.{name}.run"
        self._user_seen: dict[str, Spend] = {}
        self._warned: set[str] = set()
        self._price_of: dict[str, ModelPrice | None] = {}
        self._cost_limited = any(kind == "cost" for _, kind in self.limits)
        self._limit_list = tuple((scope, kind, limit, kind == "tokens") for (scope, kind), limit in self.limits.items())
        self._run_limited = any(scope == "run" for scope, _ in self.limits)
        self._session_limited = any(scope == "session" for scope, _ in self.limits)
        if strict:
            for model in models:
                model_name = model if isinstance(model, str) else getattr(model, "name", repr(model))
                if self.price(model_name) is None:
                    raise ValueError(f"strict budget: no price for model {model_name!r} "
                                     f"(known: {', '.join(sorted(table))}); pass prices={{...}}")
        self._needs_user = any(scope == "user" for scope, _ in self.limits)

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
                "user": self._user_seen.get(ctx.user_id) or Spend()}

    def session_spent(self, state: AgentState) -> Spend:
        raw = state.metadata.get(self.name_key) or {}
        return Spend(int(raw.get("tokens", 0)), float(raw.get("cost", 0.0)), int(raw.get("calls", 0)))

    async def user_spent(self, user_id: str) -> Spend:
        return await self.store.get(user_id)

    # -- hooks -----------------------------------------------------------------------------------

    def on_agent_state_ready(
        self, agent: ReActAgent, ctx: RuntimeContext, state: AgentState, input_messages: list[Msg]
    ) -> None:
        parent = ctx.parent
        shared = parent.get(self._run_key) if parent is not None else None
        # Inherited by a sub-agent (this instance runs in a caller's run too): one budget for the
        # tree, the root run's totals (whose context holds the session the scope counts in).
        # (type(), not isinstance(): RunTotals is a Mapping, whose isinstance is Python-level code)
        totals = shared if type(shared) is RunTotals else RunTotals(self, ctx)
        ctx.put(self._run_key, totals)
        publish_metric(ctx, self.name_key, totals)  # AgentRun.metrics[name]

    def on_model_call(self, agent: ReActAgent, ctx: RuntimeContext, input: ModelCallInput, next: Next) -> Any:
        model_name = str(getattr(input.model, "name", ""))
        price = self._price_of.get(model_name, _UNSEEN)  # self.price(), inlined: one frame less per call
        if price is _UNSEEN:
            price = self.price(model_name)
        if price is None and self.strict:
            problem = f"strict budget: no price for model {model_name!r}; pass prices={{...}}"
            return EventStream.error(ValueError(problem))
        est_tokens = self.estimate(input)
        if price is not None:
            est_cost = est_tokens * price.input / 1_000_000
        else:
            est_cost = 0.0
            if self._cost_limited and model_name not in self._warned:
                self._warned.add(model_name)
                log.warning("%s: no price for model %r: its calls count as cost 0", self.name, model_name)
        run = ctx.get(self._run_key)  # this execution's totals, read once per call
        if run is None:  # (a hook driven by hand, outside a run: no state-ready hook made them)
            run = RunTotals(self, ctx)
            ctx.put(self._run_key, run)
        if not self._needs_user:
            refused = self._check(ctx, run, None, est_tokens, est_cost)
            if refused is not None:
                return self._refuse(refused)
            # A C partial over a bound method: no per-call object of ours, no closure cells.
            return next(input).map(_partial(self._after, ctx, run, price, est_tokens, est_cost))
        if self._sync_store:
            user = self.store.get_nowait(ctx.user_id)  # type: ignore[attr-defined]
            refused = self._check(ctx, run, user, est_tokens, est_cost)
            if refused is not None:
                return self._refuse(refused)
            return next(input).map(_partial(self._after, ctx, run, price, est_tokens, est_cost))
        inner = next(input)

        async def call() -> Any:
            refused = self._check(ctx, run, await self.store.get(ctx.user_id), est_tokens, est_cost)
            if refused is not None:
                if self.on_exceeded == "error":
                    raise _exceeded(refused)
                for ev in self._refuse(refused):
                    yield ev
                return
            async with _closing(inner.__aiter__()) as it:
                async for ev in it:
                    if ev.__class__ is ModelCallEnd and ev.source is None:
                        tokens, cost = _measure(ev, price, est_tokens, est_cost)
                        user = await self.store.add(ctx.user_id, tokens, cost)
                        ev = self._account(ctx, run, ev, tokens, cost, user)
                    yield ev

        return EventStream(call)

    # -- internals -------------------------------------------------------------------------------

    def _check(
        self, ctx: RuntimeContext, run: RunTotals, user: Spend | None, est_tokens: int, est_cost: float
    ) -> dict[str, Any] | None:
        # On every call: reads the totals in place (no Spend is built unless a limit is hit).
        if user is not None:
            self._user_seen[ctx.user_id] = user
        session: Any = None
        if self._session_limited:
            state = run._ctx.agent_state  # the tree's root session
            session = state.metadata.get(self.name_key) if state is not None else None
        for scope, kind, limit, tokens_kind in self._limit_list:
            if scope == "run":
                spent: float = run.tokens if tokens_kind else run.cost
            elif scope == "session":
                spent = session.get(kind, 0) if isinstance(session, dict) else 0
            else:
                spent = 0 if user is None else (user.tokens if tokens_kind else user.cost)
            estimate = est_tokens if tokens_kind else est_cost
            if spent + estimate > limit:
                unit = "tokens" if tokens_kind else "USD"
                reason = (f"budget exceeded: {scope} {kind} limit {limit} {unit}; spent {spent:g}, "
                          f"this call ~{estimate:g} more (estimated)")
                return {"scope": scope, "kind": kind, "limit": limit, "spent": spent, "estimate": estimate,
                        "reason": reason}
        return None

    def _refuse(self, info: dict[str, Any]) -> Any:
        if self.on_exceeded == "error":
            return EventStream.error(_exceeded(info))
        return (Custom(name="budget_exceeded", value=info), RequestStop(reason=info["reason"]))

    def _after(self, ctx: RuntimeContext, run: RunTotals, price: ModelPrice | None, est_tokens: int,
               est_cost: float, ev: Any) -> Any:
        """The fused map of a call (in-memory store): at the call's own ModelCallEnd, count the
        actual usage (the estimate when unknown) and annotate the event; every other event passes
        after one class test."""
        if ev.__class__ is not _ModelCallEnd or ev.source is not None:
            return ev
        usage = ev.usage  # _measure(), inlined
        if usage is None:  # unknown: count what the call was estimated to cost
            tokens, cost = est_tokens, est_cost
        else:
            tokens, cost = usage.input_tokens + usage.output_tokens, price.cost(usage) if price is not None else 0.0
        user = self.store.add_nowait(ctx.user_id, tokens, cost) if self._needs_user else None  # type: ignore[attr-defined]
        return self._account(ctx, run, ev, tokens, cost, user)

    def _account(self, ctx: RuntimeContext, run: RunTotals, ev: ModelCallEnd, tokens: int, cost: float,
                 user: Spend | None) -> ModelCallEnd:
        """Grow the run's and the session's totals (the user's is grown by the store) and return
        ``ev`` annotated. The totals are grown in place: no Spend, and no dict but the
        annotation's own."""
        run.tokens = r_tokens = run.tokens + tokens  # in place: the run's own totals
        run.cost = r_cost = run.cost + cost
        run.calls = r_calls = run.calls + 1
        state = run._ctx.agent_state  # (a sub-agent's calls count in its tree's root session)
        name = self.name_key
        if state is not None:
            raw = state.metadata.get(name)
            if not isinstance(raw, dict):
                raw = state.metadata[name] = {"tokens": 0, "cost": 0.0, "calls": 0}
            raw["tokens"] = s_tokens = raw["tokens"] + tokens  # in place: the state is this session's own
            raw["cost"] = s_cost = raw["cost"] + cost
            raw["calls"] = s_calls = raw["calls"] + 1
        else:
            s_tokens, s_cost, s_calls = 0, 0.0, 0
        if user is not None:
            self._user_seen[ctx.user_id] = user
            u_tokens, u_cost, u_calls = user.tokens, user.cost, user.calls
        else:
            u_tokens, u_cost, u_calls = 0, 0.0, 0
        exceeded = None
        for scope, kind, limit, tokens_kind in self._limit_list:  # the first limit crossed, in order
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
        return with_metadata(ev, {**ev.metadata, name: {
            "call": {"tokens": tokens, "cost": cost, "estimated": ev.usage is None},
            "run": {"tokens": r_tokens, "cost": r_cost, "calls": r_calls},
            "session": {"tokens": s_tokens, "cost": s_cost, "calls": s_calls},
            "user": {"tokens": u_tokens, "cost": u_cost, "calls": u_calls},
            "exceeded": exceeded,
        }})


def _exceeded(info: Mapping[str, Any]) -> BudgetExceeded:
    return BudgetExceeded(info["reason"], scope=info["scope"], kind=info["kind"], limit=info["limit"],
                          spent=info["spent"], estimate=info["estimate"])


_MISSING: Any = object()
_ModelCallEnd = ModelCallEnd  # (a module global: read per event by the fused map)


def _measure(ev: ModelCallEnd, price: ModelPrice | None, est_tokens: int, est_cost: float) -> tuple[int, float]:
    usage = ev.usage
    if usage is None:  # unknown: count what the call was estimated to cost
        return est_tokens, est_cost
    cost = price.cost(usage) if price is not None else 0.0
    return usage.input_tokens + usage.output_tokens, cost


class _closing:
    """``contextlib.aclosing`` for any async iterator (typed loosely: ours have ``aclose``)."""

    def __init__(self, it: Any) -> None:
        self.it = it

    async def __aenter__(self) -> Any:
        return self.it

    async def __aexit__(self, *exc: object) -> None:
        close = getattr(self.it, "aclose", None)
        if close is not None:
            await close()
