"""Every limit holds, as a seeded random property: random agents (1-4 parallel tool calls a round,
a sub-agent tool that inherits the middleware, several rounds) under random limit stacks with
small limits, with retries and hedges inside or outside them, flaky models, raising hooks,
interrupts and consumers that leave, several runs at once of one user's sessions (the same
session or different ones), two agents sharing the stores.

The oracle counts what happened — the model calls each model received, the tool bodies that
ran, the tokens the models reported, the calls in flight the model saw, and (a probe right
inside each gate) the calls each gate let through — and checks each limit's documented
semantics: never more than the limit passed; every run ends the documented way or with a typed
error; the counts kept in `AgentState.metadata` equal what passed, read back from the store; no
slot, hold or session is left taken.

Knobs: ``LIMIT_CASES`` (cases per test, default 30), ``LIMIT_SEED`` (the first seed, default 0).
A failure names its seed: ``LIMIT_SEED=<seed> LIMIT_CASES=1`` runs that case alone."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import math
import os
import random
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import ChatUsage, MiddlewareBase, ReActAgent, RuntimeContext
from agentscope_py.agent import InMemoryStateStore, SqliteStateStore
from agentscope_py.errors import (
    BudgetExceeded,
    CallLimitExceeded,
    HedgeError,
    ModelError,
    RateLimitExceeded,
)
from agentscope_py.events import AgentResult, RequestStop
from agentscope_py.middleware import (
    BudgetMiddleware,
    ConcurrencyLimitMiddleware,
    HedgeMiddleware,
    InMemoryBudgetStore,
    ModelCallLimitMiddleware,
    RateLimitMiddleware,
    RedisBucketStore,
    RedisBudgetStore,
    RetryMiddleware,
    ToolCallLimitMiddleware,
    ToolRetryMiddleware,
)
from agentscope_py.model.base import ChatChunk, ModelRequest, ToolCallChunk
from agentscope_py.stream import EventStream, aclose
from agentscope_py.tool import tool

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore::agentscope_py.extension.lints.MiddlewareOrderWarning")]

CASES = int(os.environ.get("LIMIT_CASES", "30"))
SEED = int(os.environ.get("LIMIT_SEED", "0"))
E_IN = 10  # every call's input tokens: the budget's estimate and what the models report agree


class Boom(Exception):
    """A fault a hook raises (injected by the test)."""


# -- what happened ----------------------------------------------------------------------------------


@dataclass
class Ledger:
    """What the models and tools saw, by execution label (``L:<run>`` or ``L:<run>/<sub>``)."""

    calls: Counter[str] = field(default_factory=Counter)  # model calls received
    tools: Counter[str] = field(default_factory=Counter)  # `work` bodies that ran
    tokens: Counter[str] = field(default_factory=Counter)  # tokens reported (input + output)
    now: int = 0
    peak: int = 0


def label_of(messages: Any) -> str:
    for msg in reversed(messages):
        if msg.role == "user" and "L:" in msg.text:
            text = msg.text
            return text[text.index("L:"):].split()[0]
    raise AssertionError(f"no label in {[m.text for m in messages]}")


class LimitModel:
    """Decides each call from (seed, label, call number): a few rounds of 1-4 parallel tool calls
    (``work``, and ``sub`` at the root), then an answer; sometimes fails before its first chunk
    (a retryable `ModelError`). Reports ``E_IN`` input tokens and, for an answer, exactly the
    output the budget counts, so no call overruns its hold."""

    def __init__(self, ledger: Ledger, seed: int, name: str, *, subs: bool, flaky: float, slow: float) -> None:
        self.ledger, self.seed, self.name, self.subs = ledger, seed, name, subs
        self.flaky, self.slow = flaky, slow
        self.provider = "test"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        ledger = self.ledger
        label = label_of(request.messages)
        n = ledger.calls[label]
        ledger.calls[label] += 1
        rng = random.Random(f"{self.seed}/{label}/{n}")
        ledger.now += 1
        ledger.peak = max(ledger.peak, ledger.now)
        try:
            await asyncio.sleep(rng.random() * self.slow if rng.random() < 0.5 else 0)
            if rng.random() < self.flaky:
                raise ModelError("flaky", retryable=True)
            rounds = len([m for m in request.messages if m.role == "assistant" and m.tool_calls])
            if rounds < rng.randint(0, 3):
                for j in range(rng.randint(1, 4)):
                    if self.subs and rng.random() < 0.3:
                        name, args = "sub", {"task": f"do {label}/{n}.{j}"}
                    else:
                        name, args = "work", {"tag": label}
                    yield ChatChunk(tool_call=ToolCallChunk(index=j, id=f"c{uuid.uuid4().hex[:8]}", name=name,
                                                            arguments=json.dumps(args)))
                    await asyncio.sleep(0)
                out = 0
            else:
                out = rng.randint(1, 16)
                for _ in range(out):
                    yield ChatChunk(text="xxxx")  # 4 characters: one output token as the budget counts
                    await asyncio.sleep(0)
            yield ChatChunk(usage=ChatUsage(input_tokens=E_IN, output_tokens=out))
            ledger.tokens[label] += E_IN + out
        finally:
            ledger.now -= 1


def work_tool(ledger: Ledger, slow: float, rng: random.Random, flaky: float) -> Any:
    @tool
    async def work(tag: str) -> str:
        """Do some work."""
        ledger.tools[tag] += 1
        await asyncio.sleep(slow * rng.random())
        if rng.random() < flaky:
            raise RuntimeError("the work failed")
        return "worked"

    return work


class Probe(MiddlewareBase):
    """Right inside a gate: counts the calls that passed it (subscribed), by execution label and
    by session; at ``on_acting``, the tool calls (of ``tool_name``, or all)."""

    def __init__(self, acting: bool = False, tool_name: str | None = None) -> None:
        self.acting, self.tool_name = acting, tool_name
        self.by_label: Counter[str] = Counter()
        self.by_session: Counter[tuple[str, str, str]] = Counter()  # (agent, user, session)
        self.seen: dict[int, Any] = {}  # the tool calls counted, by id

    def active_points(self) -> Any:
        from agentscope_py import ExtensionPoint

        return frozenset({ExtensionPoint.ON_ACTING if self.acting else ExtensionPoint.ON_MODEL_CALL})

    def _passed(self, agent: Any, ctx: RuntimeContext, label: str, n: int) -> None:
        self.by_label[label] += n
        self.by_session[(agent.name, ctx.user_id, ctx.session_id)] += n

    def on_model_call(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        inner = next(input)
        label = label_of(input.messages)

        def go() -> EventStream[Any]:
            self._passed(agent, ctx, label, 1)
            return inner

        return EventStream.defer(go)

    def on_acting(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        def go() -> EventStream[Any]:
            # (A retried call — the same block again — is the call the model asked for, once.)
            calls = [c for c in input.tool_calls if (self.tool_name is None or c.name == self.tool_name)
                     and self.seen.get(id(c)) is not c]
            self.seen.update((id(c), c) for c in calls)
            self._passed(agent, ctx, acting_label(input.tool_calls), len(calls))
            return next(input)

        return EventStream.defer(go)


class Flight(Probe):
    """Right inside a concurrency limit: the most calls (model calls, tool batches or runs) in
    flight at once per key, as the limit keys them."""

    def __init__(self, point: str, key: str) -> None:
        super().__init__()
        self.point, self.key = point, key
        self.now: Counter[Any] = Counter()
        self.peak: Counter[Any] = Counter()
        self.units: Counter[Any] = Counter()  # the streams of each unit in flight
        # A limit at on_acting or on_agent stays with the agent it is on (`ConcurrencyLimitMiddleware`).
        self.inherit_to_subagents = point == "on_model_call"

    def active_points(self) -> Any:
        from agentscope_py import ExtensionPoint

        return frozenset({ExtensionPoint(self.point)})

    def _flown(self, ctx: RuntimeContext, next: Any, input: Any) -> Any:
        key = {"global": "*", "user": ctx.user_id, "session": (ctx.user_id, ctx.session_id)}[self.key]
        inner = next(input)
        return EventStream(lambda: self._in_flight(key, ctx, inner))

    async def _in_flight(self, key: Any, ctx: RuntimeContext, inner: EventStream[Any]) -> AsyncIterator[Any]:
        # (An acting pass inside one of its run in flight — a tool retry's — is that batch.)
        unit = (key, id(ctx)) if self.point == "on_acting" else object()
        self.units[unit] += 1
        if self.units[unit] == 1:
            self.now[key] += 1
            self.peak[key] = max(self.peak[key], self.now[key])
        try:
            async with contextlib.aclosing(inner.__aiter__()) as it:
                async for ev in it:
                    yield ev
        finally:
            self.units[unit] -= 1
            if not self.units[unit]:
                del self.units[unit]
                self.now[key] -= 1

    def on_model_call(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        return self._flown(ctx, next, input)

    def on_acting(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        return self._flown(ctx, next, input)

    def on_agent(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        return self._flown(ctx, next, input)


class RateProbe(MiddlewareBase):
    """Right inside a rate limit, at each of its points: what started, as ``(time, tokens)`` by
    ``(point, key)`` as the limit keys its buckets — the time read from the case's clock as the
    call is subscribed, the tokens the limit charges it (``cost`` per call, per tool call of a
    batch)."""

    def __init__(self, points: list[str], key: str, cost: float, clock: Callable[[], float]) -> None:
        self.points, self.key, self.cost, self.clock = points, key, cost, clock
        self.started: dict[tuple[str, Any], list[tuple[float, float]]] = {}

    def active_points(self) -> Any:
        from agentscope_py import ExtensionPoint

        return frozenset(ExtensionPoint(p) for p in self.points)

    def _started(self, point: str, ctx: RuntimeContext, tokens: float, next: Any, input: Any) -> Any:
        key = {"global": "*", "user": ctx.user_id, "session": (ctx.user_id, ctx.session_id)}[self.key]

        def go() -> EventStream[Any]:
            self.started.setdefault((point, key), []).append((self.clock(), tokens))
            return next(input)

        return EventStream.defer(go)

    def on_model_call(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        return self._started("on_model_call", ctx, self.cost, next, input)

    def on_acting(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        return self._started("on_acting", ctx, self.cost * max(1, len(input.tool_calls)), next, input)

    def on_agent(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        return self._started("on_agent", ctx, self.cost, next, input)


def rate_escape(started: list[tuple[float, float]], rate: float, burst: float) -> str | None:
    """The first window whose starts took more than a token bucket lets through: ``burst`` (full
    at the window's start) plus what ``rate`` refills over it, plus what a call bigger than the
    bucket (which goes once it is full) puts it in debt by. None when every window holds."""
    started = sorted(started)
    for i, (t0, _) in enumerate(started):
        total = big = 0.0
        for t1, tokens in started[i:]:
            total += tokens
            big = max(big, tokens)
            most = burst + rate * (t1 - t0) + max(0.0, big - burst)
            if total > most + 1e-6:
                return f"{total:g} tokens started in [{t0:.4f}, {t1:.4f}], at most {most:g}: {started}"
    return None


def acting_label(calls: Any) -> str:
    """The label of the execution whose batch ``calls`` is (read from the calls' arguments)."""
    call = calls[0]
    if call.name == "work":
        return str(call.input["tag"])
    return str(call.input["task"]).split()[1].rsplit("/", 1)[0]


class Raiser(MiddlewareBase):
    """Raises `Boom` now and then at a tool batch or a model call (a hook that fails), before or
    after the inner layers' first event."""

    def __init__(self, rng: random.Random, p: float) -> None:
        self.rng, self.p = rng, p

    def _maybe(self, input: Any, next: Any) -> Any:
        if self.rng.random() >= self.p:
            return next(input)
        if self.rng.random() < 0.5:
            return EventStream.error(Boom("hook failed"))
        inner = next(input)
        return EventStream(lambda: _fail_after_first(inner))

    def on_acting(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        return self._maybe(input, next)

    def on_model_call(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        return self._maybe(input, next)


async def _fail_after_first(inner: EventStream[Any]) -> AsyncIterator[Any]:
    async with contextlib.aclosing(inner.__aiter__()) as it:
        async for ev in it:
            yield ev
            raise Boom("hook failed mid-stream")


# -- a case -----------------------------------------------------------------------------------------

Factory = Callable[[], MiddlewareBase]


@dataclass
class Gate:
    """A limit in the stack, the probe right inside it, and how many model requests one call
    that passed it may become (retries and hedges inside it)."""

    kind: str
    mws: list[MiddlewareBase]  # one per agent (the same instance unless the stores are what is shared)
    probes: list[Any]  # `Probe`s (a `Flight`, `RateProbe`s)
    amp: int = 1
    wide: int = 1
    tool_amp: int = 1  # how many times one tool call that passed may run (tool retries)

    def by_label(self) -> Counter[str]:
        return sum((p.by_label for p in {id(p): p for p in self.probes}.values() if isinstance(p, Probe)), Counter())

    def by_session(self) -> Counter[tuple[str, str, str]]:
        return sum((p.by_session for p in {id(p): p for p in self.probes}.values()), Counter())


def _no_sleep(seconds: float) -> Any:
    return asyncio.sleep(0)


def draw_limit(rng: random.Random) -> dict[str, Any]:
    run = rng.choice([None, 0, 1, 2, 3, 5])
    session = rng.choice([None, 1, 3, 6]) if run is not None else rng.choice([1, 3, 6])
    return {"run_limit": run, "session_limit": session, "scope": rng.choice(["run", "tree"])}


@dataclass
class Case:
    seed: int
    rng: random.Random
    redis: tuple[str, str] | None  # (url, prefix): agents share Redis stores instead of instances
    ledger: Ledger = field(default_factory=Ledger)
    gates: list[Gate] = field(default_factory=list)
    stacks: list[list[MiddlewareBase]] = field(default_factory=list)
    closers: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    which: list[int] = field(default_factory=list)  # each run's agent
    now: float = 1000.0  # the rate limits' clock
    alongside: bool = False  # another process runs this case on the same Redis stores

    def build_stacks(self, n_agents: int) -> None:
        rng = self.rng
        units: list[tuple[str, Any]] = []  # (kind, params)
        if rng.random() < 0.6:
            units.append(("model_limit", {**draw_limit(rng), "exit_behavior": rng.choice(["end", "error"])}))
        if rng.random() < 0.6:
            units.append(("tool_limit", {**draw_limit(rng), "exit_behavior": rng.choice(["continue", "end", "error"]),
                                         "tool_name": rng.choice([None, "work"])}))
        if rng.random() < 0.35 and self.redis is None:
            units.append(("concurrency", {"limit": rng.randint(1, 2), "max_wait": rng.choice([None, None, 0.02]),
                                          "point": rng.choice(["on_model_call", "on_model_call", "on_acting", "on_agent"]),
                                          "key": rng.choice(["global", "user", "session"])}))
        if rng.random() < (0.9 if self.redis else 0.45):
            points = (rng.sample(["on_model_call", "on_acting", "on_agent"], rng.randint(1, 3))
                      if rng.random() < 0.7 else ["on_model_call"])
            units.append(("rate", {"burst": rng.randint(1, 8), "wait": not self.alongside and rng.random() < 0.5,
                                   "rate": rng.choice([5.0, 50.0]), "max_wait": rng.choice([None, 0.1]),
                                   "points": points, "key": rng.choice(["global", "user", "session"]),
                                   "cost": rng.choice([1.0, 1.0, 2.0])}))
        if rng.random() < (0.9 if self.redis else 0.4):
            limits = {k: rng.randint(15, 150) for k in ("run_tokens", "session_tokens", "user_tokens")
                      if rng.random() < 0.5}
            if self.redis or not limits:
                limits["user_tokens"] = rng.randint(30, 200)
            units.append(("budget", {**limits, "on_exceeded": rng.choice(["stop", "error"])}))
        if rng.random() < 0.4:
            units.append(("retry", {"max_retries": rng.randint(1, 2)}))
        if rng.random() < 0.25:
            units.append(("hedge", {}))
        if rng.random() < 0.3:
            units.append(("tool_retry", {"max_retries": rng.randint(1, 2)}))
        if rng.random() < 0.2:
            units.append(("raiser", {"p": 0.15}))
        rng.shuffle(units)
        self.notes.append(f"stack (outermost first): {units}")
        shared: dict[str, Any] = {}
        if self.redis is not None:
            url, prefix = self.redis
            shared["budget_store"] = RedisBudgetStore(url, prefix=f"{prefix}:budget")
            shared["bucket_store"] = RedisBucketStore(url, prefix=f"{prefix}:rate", clock=self.clock)
            self.count_asking(shared["bucket_store"])
            self.closers += [shared["budget_store"], shared["bucket_store"]]
        else:
            shared["budget_store"] = InMemoryBudgetStore()
        self.stacks = [[] for _ in range(n_agents)]
        for kind, params in units:
            if kind in ("retry", "hedge", "raiser", "tool_retry"):
                per_agent = [self.layer(kind, params)] * n_agents
                for stack, mw in zip(self.stacks, per_agent, strict=True):
                    stack.append(mw)
                continue
            own = self.redis is not None and kind in ("rate", "budget")  # two instances, one store
            first = self.gate(kind, params, shared)
            mws = [first] + [self.gate(kind, params, shared) if own else first for _ in range(n_agents - 1)]
            probe: MiddlewareBase
            if kind == "concurrency":
                probe = Flight(params["point"], params["key"])
                probes = [probe] * n_agents
            elif kind == "rate":
                probe = RateProbe(params["points"], params["key"], params["cost"], self.clock)
                probes = [probe] + [RateProbe(params["points"], params["key"], params["cost"], self.clock) if own
                                    else probe for _ in range(n_agents - 1)]
            else:
                acting = kind == "tool_limit"
                probe = Probe(acting, params.get("tool_name"))
                probes = [probe] + [Probe(acting, params.get("tool_name")) if own else probe
                                    for _ in range(n_agents - 1)]
            self.gates.append(Gate(kind, mws, probes))
            for stack, mw, pr in zip(self.stacks, mws, probes, strict=True):
                stack += [mw, pr]
        # A gate's amplification: the retries and hedges below it (in flight at once: the hedges);
        # a tool call runs again for a tool retry anywhere (it counts once, as the model asked for it).
        order = self.stacks[0]
        for g in self.gates:
            g.tool_amp = math.prod(1 + mw.max_retries for mw in order if isinstance(mw, ToolRetryMiddleware))
            for mw in order[order.index(g.mws[0]) + 1:]:
                if isinstance(mw, RetryMiddleware):
                    g.amp *= 1 + mw.max_retries
                elif isinstance(mw, HedgeMiddleware):
                    g.amp *= 2
                    g.wide *= 2

    sleepers: list[tuple[float, int, asyncio.Future[None]]] = field(default_factory=list)  # a heap
    keeper: asyncio.Task[None] | None = None
    slept: int = 0
    asking: int = 0  # reservations on their way to Redis and back

    def clock(self) -> float:
        return self.now

    def count_asking(self, store: RedisBucketStore) -> None:
        reserve_at = store.reserve_at

        async def asking(*args: Any) -> Any:
            self.asking += 1
            try:
                return await reserve_at(*args)
            finally:
                self.asking -= 1

        store.reserve_at = asking  # type: ignore[method-assign]

    async def sleep(self, seconds: float) -> None:
        """Sleeps in the case's time: the sleepers wake in the order of their deadlines, the clock
        set to each one's as it wakes, so a call's start is stamped at the time it waited for."""
        woken = asyncio.get_running_loop().create_future()
        heapq.heappush(self.sleepers, (self.now + seconds, self.slept, woken))
        self.slept += 1
        if self.keeper is None or self.keeper.done():
            self.keeper = asyncio.ensure_future(self.keep_time())
        await woken

    async def keep_time(self) -> None:
        while self.sleepers:
            # (A little real time first: the tasks the last wake let go reach their next wait.)
            await asyncio.sleep(0.0005)
            if self.asking:
                # (No time passes while a reservation is on its way: the wait it answers counts
                # from the clock it read, and the sleep that follows, from the clock then.)
                continue
            deadline, _, woken = heapq.heappop(self.sleepers)
            if not woken.done():  # (a cancelled sleeper moves no time)
                self.now = max(self.now, deadline)
                woken.set_result(None)

    def layer(self, kind: str, params: dict[str, Any]) -> MiddlewareBase:
        if kind == "retry":
            return RetryMiddleware(params["max_retries"], initial_delay=0.001, jitter=False, sleep=_no_sleep)
        if kind == "hedge":
            return HedgeMiddleware(None, after=0.002)
        if kind == "tool_retry":
            return ToolRetryMiddleware(params["max_retries"], initial_delay=0.001, jitter=False, sleep=_no_sleep)
        return Raiser(random.Random(self.rng.random()), params["p"])

    def gate(self, kind: str, params: dict[str, Any], shared: dict[str, Any]) -> MiddlewareBase:
        if kind == "model_limit":
            return ModelCallLimitMiddleware(**params)
        if kind == "tool_limit":
            return ToolCallLimitMiddleware(**params)
        if kind == "concurrency":
            return ConcurrencyLimitMiddleware(params["limit"], max_wait=params["max_wait"], points=[params["point"]],
                                              key=params["key"])
        if kind == "rate":
            # Time is the case's clock (`now`), which only the waits move: a waiting call sleeps
            # by moving it (a bucket shared by processes reads the same clock in Redis).
            args: dict[str, Any] = {"points": params["points"], "key": params["key"], "cost": params["cost"]}
            if params["wait"]:
                args |= {"rate": params["rate"], "max_wait": params["max_wait"], "sleep": self.sleep}
            else:
                args |= {"rate": 1e-6, "on_limit": "reject"}
            if self.redis is not None:
                return RateLimitMiddleware(burst=params["burst"], store=shared["bucket_store"], **args)
            return RateLimitMiddleware(burst=params["burst"], clock=self.clock, **args)
        assert kind == "budget"
        return BudgetMiddleware(**params, store=shared["budget_store"], estimate=lambda input: E_IN)



OUTCOMES = (CallLimitExceeded, BudgetExceeded, RateLimitExceeded, ModelError, HedgeError, Boom)


async def run_case(seed: int, redis: tuple[str, str] | None = None, tmp: Path | None = None,
                   alongside: bool = False) -> dict[str, Any]:
    """One case; with ``alongside`` (another process runs the same case on the same Redis
    stores), the rate limits only reject (the processes' clocks are their own) and what the
    processes share is left to the caller to check: it gets the calls each rate limit passed, the
    tokens the models reported and the budgets' limits."""
    rng = random.Random(seed)
    case = Case(seed, rng, redis, alongside=alongside)
    n_agents = rng.randint(1, 2) if redis is None else 2
    case.build_stacks(n_agents)
    ledger = case.ledger
    kind = rng.choice(["memory", "json", "sqlite"] if tmp is not None else ["memory", "json"])
    store: Any = (SqliteStateStore(tmp / f"s{seed}.db") if kind == "sqlite"
                  else InMemoryStateStore(as_json=kind == "json"))
    case.notes.append(f"state store: {kind}")
    if kind == "sqlite":
        case.closers.append(store)
    slow = rng.choice([0.0, 0.002])
    flaky = rng.choice([0.0, 0.0, 0.2])
    agents = []
    sub_session = rng.choice(["fresh", "fresh", "derived", "shared"])
    case.notes.append(f"sub-agent sessions: {sub_session}")
    for a, stack in enumerate(case.stacks):
        sub_model = LimitModel(ledger, seed, f"sub{a}", subs=False, flaky=flaky, slow=slow)
        sub = (ReActAgent.builder().name(f"sub{a}").model(sub_model).max_iters(3)
               .tools(work_tool(ledger, slow, random.Random(rng.random()), flaky)).build())
        model = LimitModel(ledger, seed, f"root{a}", subs=True, flaky=flaky, slow=slow)
        agents.append(ReActAgent.builder().name(f"root{a}").model(model).state_store(store)
                      .tools(work_tool(ledger, slow, random.Random(rng.random()), flaky), sub.as_tool("sub", session=sub_session))
                      .max_iters(rng.randint(2, 6)).middlewares(stack).build())
    n_runs = rng.randint(1, 6)
    sessions = [rng.choice(["s0", "s0", "s1", "s2"]) for _ in range(n_runs)]
    which = case.which = [rng.randrange(n_agents) for _ in range(n_runs)]
    if kind != "sqlite":
        # Each agent in sessions of its own: two agents (or processes) on one session are serialized
        # by the session queues of the SQLite and Redis stores, not by the in-memory store.
        sessions = [f"{s}-a{w}" for s, w in zip(sessions, which, strict=True)]
    modes = [rng.choice(["call", "stream", "leave", "interrupt"]) for _ in range(n_runs)]
    leave_after = [rng.randint(1, 30) for _ in range(n_runs)]
    case.notes.append(f"runs: {list(zip(which, sessions, modes, strict=True))}")
    outcomes: list[str] = [""] * n_runs

    async def one(i: int) -> None:
        agent, ctx = agents[which[i]], RuntimeContext(user_id="u", session_id=sessions[i])
        try:
            if modes[i] == "call":
                msg = await agent.call(f"L:r{i}", ctx=ctx)
                outcomes[i] = f"done:{msg.metadata.get('generate_reason', '')}"
                return
            if modes[i] == "interrupt":
                asyncio.get_running_loop().call_later(rng.random() * 0.01, agent.interrupt, "u", sessions[i])
            events = agent.stream(f"L:r{i}", ctx=ctx)
            n = 0
            it = events.__aiter__()
            try:
                async for ev in it:
                    n += 1
                    if modes[i] == "leave" and n >= leave_after[i]:
                        outcomes[i] = "left"
                        return
                    if isinstance(ev, AgentResult) and ev.source is None:
                        outcomes[i] = f"done:{ev.result.generate_reason}"
                    if isinstance(ev, RequestStop) and ev.source is None:
                        outcomes[i] = "stopped"
            finally:
                await aclose(it)
        except OUTCOMES as exc:
            outcomes[i] = type(exc).__name__

    try:
        async with asyncio.timeout(20):
            # Two waves: the second's runs find the first's counts in their sessions.
            half = rng.randint(0, n_runs)
            await asyncio.gather(*(one(i) for i in range(half)))
            await asyncio.gather(*(one(i) for i in range(half, n_runs)))
            await asyncio.sleep(0.01)  # the hedges' cancelled attempts end
        check(case, agents, sessions, outcomes)
        await check_stored(case, store, sessions)
        return {"rate": [({repr(b): [sum(t for _, t in s), max(t for _, t in s)] for b, s in rate_started(g).items()},
                          g.mws[0].burst) for g in case.gates if g.kind == "rate"],
                "budget": [(g.mws[0].limits.get(("user", "tokens")), g.wide) for g in case.gates if g.kind == "budget"],
                "reported": sum(ledger.tokens.values())}
    except BaseException as exc:
        notes = "\n".join(case.notes)
        raise AssertionError(f"LIMIT_SEED={seed} ({'redis' if redis else 'memory'}): {exc!r}\n{notes}\n"
                             f"outcomes: {outcomes}\nledger: {ledger}") from exc
    finally:
        if case.keeper is not None:
            case.keeper.cancel()
        for closer in case.closers:
            await closer.close()


def rate_started(g: Gate) -> dict[tuple[str, Any], list[tuple[float, float]]]:
    """What started inside a rate limit (its instances on the agents), by bucket."""
    out: dict[tuple[str, Any], list[tuple[float, float]]] = {}
    for probe in {id(p): p for p in g.probes}.values():
        for bucket, started in probe.started.items():
            out.setdefault(bucket, []).extend(started)
    return out


def root_of(label: str) -> str:
    return label.split("/")[0]


def trees(counts: Counter[str]) -> Counter[str]:
    out: Counter[str] = Counter()
    for label, n in counts.items():
        out[root_of(label)] += n
    return out


def check(case: Case, agents: list[ReActAgent], sessions: list[str], outcomes: list[str]) -> None:
    ledger = case.ledger
    kinds = {g.kind: g for g in case.gates}
    for g in case.gates:
        mw: Any = g.mws[0]
        passed = g.by_label()
        if g.kind in ("model_limit", "tool_limit"):
            if mw.run_limit is not None:
                per = passed if mw.scope == "run" else trees(passed)
                over = {k: n for k, n in per.items() if n > mw.run_limit}
                assert not over, f"{g.kind} run_limit={mw.run_limit} scope={mw.scope}: passed {over}"
            if mw.session_limit is not None:
                over = {k: n for k, n in g.by_session().items() if n > mw.session_limit}
                assert not over, f"{g.kind} session_limit={mw.session_limit}: passed {over}"
        if g.kind == "model_limit":
            over = {k: (n, passed[k]) for k, n in ledger.calls.items() if n > passed[k] * g.amp}
            assert not over, f"model calls received beyond those the model limit passed (x{g.amp}): {over}"
        if g.kind == "tool_limit":
            over = {k: (n, passed[k]) for k, n in ledger.tools.items() if n > passed[k] * g.tool_amp}
            assert not over, f"tool bodies run beyond those the tool limit passed: {over}"
        if g.kind == "concurrency":
            flight = g.probes[0]
            assert isinstance(flight, Flight)
            if flight.point == "on_model_call" and flight.key != "session":
                assert ledger.peak <= mw.limit * g.wide, f"{ledger.peak} model calls in flight, limit {mw.limit}"
            over = {k: n for k, n in flight.peak.items() if n > mw.limit}
            assert not over, f"{flight.point} in flight per {flight.key}: {over}, limit {mw.limit}"
            assert not mw._slots, f"slots left taken or waited for: {mw._slots}"
        if g.kind == "rate":
            for (point, key), started in rate_started(g).items():
                escape = rate_escape(started, mw.rate, mw.burst)
                assert escape is None, f"rate limit at {point}, key {key!r}: {escape}"
        if g.kind == "budget" and g.wide == 1:
            # (A hedge inside reads its attempts ahead of the budget, which cuts a call at its own
            # layer: what the model made past the cut is not what the budget charged. Its charges
            # are checked against the limits in `check_stored`.)
            user = mw.limits.get(("user", "tokens"))
            if user is not None:
                assert sum(ledger.tokens.values()) <= user, f"user tokens {ledger.tokens} > {user}"
            run = mw.limits.get(("run", "tokens"))
            if run is not None:
                over = {k: n for k, n in trees(ledger.tokens).items() if n > run}
                assert not over, f"run_tokens={run}: {over}"
            session = mw.limits.get(("session", "tokens"))
            if session is not None:
                per: Counter[str] = Counter()
                for root, n in trees(ledger.tokens).items():
                    per[sessions[int(root[3:])]] += n
                over = {k: n for k, n in per.items() if n > session}
                assert not over, f"session_tokens={session}: {over}"
    # The agents' own limit: max_iters rounds, then one summary call (each call, the attempts the
    # retries and hedges in the stack make of it).
    amp = math.prod(1 + mw.max_retries if isinstance(mw, RetryMiddleware) else 2 if isinstance(mw, HedgeMiddleware)
                    else 1 for mw in case.stacks[0])
    for label, n in ledger.calls.items():
        i, sub = int(label[3:].split("/")[0]), "/" in label
        iters = 3 if sub else agents[case.which[i]].max_iters
        assert n <= (iters + 1) * amp, f"{label}: {n} model calls, max_iters {iters} (x{amp})"
    errors = {"CallLimitExceeded": any(g.kind in ("model_limit", "tool_limit") and g.mws[0].exit_behavior == "error"
                                       for g in case.gates),
              "BudgetExceeded": "budget" in kinds and kinds["budget"].mws[0].on_exceeded == "error",
              "RateLimitExceeded": "rate" in kinds or "concurrency" in kinds,
              "ModelError": True, "HedgeError": "hedge" in str(case.notes), "Boom": "raiser" in str(case.notes)}
    for i, outcome in enumerate(outcomes):
        assert outcome, f"run {i} ended with no result, no stop and no error"
        assert outcome.startswith(("done:", "left", "stopped")) or errors.get(outcome), f"run {i}: {outcome}"
    for agent in agents:
        assert not agent._runtime.gates.active, f"a session left locked: {agent._runtime.gates.active}"
        for s in set(sessions):
            assert agent.busy_error("u", s) is None


async def check_stored(case: Case, store: Any, sessions: list[str]) -> None:
    """The counts kept in each session's state, read back from the store, equal what passed."""
    for s in set(sessions):
        loaded = await store.load("u", s)
        state = loaded[0] if loaded is not None else None
        metadata = state.metadata if state is not None else {}
        for g in case.gates:
            mw: Any = g.mws[0]
            if g.kind in ("model_limit", "tool_limit") and mw.session_limit is not None:
                stored = metadata.get("call_limits", {}).get(mw.state_key, 0)
                passed = sum(n for (name, _, session), n in g.by_session().items() if session == s and "root" in name)
                assert stored == passed, f"{g.kind} of session {s}: stored {stored}, passed {passed}"
            session = mw.limits.get(("session", "tokens")) if g.kind == "budget" else None
            if session is not None:
                stored = metadata.get(mw.name_key, {}).get("tokens", 0)
                reported = sum(n for root, n in trees(case.ledger.tokens).items() if sessions[int(root[3:])] == s)
                assert stored <= session, f"budget of session {s}: charged {stored} > {session}"
                assert g.wide > 1 or reported <= stored, f"budget of session {s}: charged {stored}, reported {reported}"
    for g in case.gates:
        if g.kind == "budget":
            mw = g.mws[0]
            held = await mw.store.held("u")
            assert case.alongside or tuple(held) == (0, 0), f"holds left: {held}"
            user = mw.limits.get(("user", "tokens"))
            if user is not None:
                charged = (await mw.store.get("u")).tokens
                assert charged <= user, f"user charged {charged} > {user}"
                assert g.wide > 1 or sum(case.ledger.tokens.values()) <= charged


@pytest.mark.parametrize("seed", range(SEED, SEED + CASES))
async def test_every_limit_holds(seed: int, tmp_path: Path) -> None:
    await run_case(seed, tmp=tmp_path)


@pytest.mark.parametrize("seed", range(SEED, SEED + max(1, CASES // 4)))
async def test_every_limit_holds_across_agents_sharing_redis(seed: int, redis_url: str, redis_prefix: str) -> None:
    await run_case(seed, (redis_url, redis_prefix))


@pytest.mark.parametrize("seed", range(SEED, SEED + max(1, CASES // 10)))
async def test_every_limit_holds_across_processes_sharing_redis(seed: int, redis_url: str,
                                                                redis_prefix: str) -> None:
    # Two processes run the same case at once (tests/middleware/limits_proc.py): the rate limits'
    # buckets and the budgets' user totals are in Redis, shared by both.
    script = str(Path(__file__).with_name("limits_proc.py"))
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, script, redis_url, redis_prefix, str(seed),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        for _ in range(2)]
    for p in procs:
        assert p.stdout is not None and (await asyncio.wait_for(p.stdout.readline(), 30)).strip() == b"ready"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(b"go\n")
        await p.stdin.drain()
    reports = []
    for p in procs:
        out, err = await asyncio.wait_for(p.communicate(), 60)
        assert p.returncode == 0, err.decode()[-3000:]
        reports.append(json.loads(out.decode().splitlines()[-1]))
    for (a, burst), (b, _) in zip(reports[0]["rate"], reports[1]["rate"], strict=True):
        # (The rate limits only reject, refilling nothing: a bucket lets through its burst, or one
        # call bigger than it once it is full.)
        for bucket in a.keys() | b.keys():
            (ta, ma), (tb, mb) = a.get(bucket, (0, 0)), b.get(bucket, (0, 0))
            assert ta + tb <= max(burst, ma, mb), (
                f"LIMIT_SEED={seed}: the processes' rate limits at {bucket} passed {ta} + {tb} tokens, burst {burst}")
    store = RedisBudgetStore(redis_url, prefix=f"{redis_prefix}:budget")
    try:
        assert await store.held("u") == (0, 0.0), f"LIMIT_SEED={seed}"
        for limit, wide in reports[0]["budget"]:
            charged = (await store.get("u")).tokens
            assert limit is None or charged <= limit, f"LIMIT_SEED={seed}: charged {charged} > {limit}"
            reported = reports[0]["reported"] + reports[1]["reported"]
            assert limit is None or wide > 1 or reported <= charged, f"LIMIT_SEED={seed}: {reported} > {charged}"
    finally:
        await store.close()
