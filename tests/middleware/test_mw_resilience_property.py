"""The resilience built-ins under random compositions and faults, as a seeded random property.

Each case draws a stack (outermost first) of `RetryMiddleware`, `ModelFallbackMiddleware`,
`TimeoutMiddleware`, `HedgeMiddleware`, `ToolRetryMiddleware` and `RateLimitMiddleware` in a
random order, with sometimes a `BudgetMiddleware`, a `ModelCallLimitMiddleware` /
`ToolCallLimitMiddleware`, a `ResponseCacheMiddleware` and a guardrail among them, and runs —
`call()`, `stream()` read whole, consumers that leave at a random event, interrupts at a random
time, several runs at once on one agent's sessions (some sharing a session) — over fake models
whose replies stream thinking, text, tool calls and usage, and whose attempts fail at random points
(a typed error before the first chunk, retryable or not, a rate limit with ``retry_after``, a raise
mid-stream, a stall past a timeout), with a tool that fails, stalls or succeeds at random.

The oracle:

- attempts stay within the stack's bounds (model attempts per request, tool attempts per call);
  every retry's wait is the documented backoff of its error and retry number, and is the wait
  slept; no error the retry's ``retry_on`` refuses is retried;
- every model call the caller sees is one coherent reply: balanced, unique ids, the deltas of a
  call that ended well are the whole reply one attempt made (no delta of another attempt
  interleaved or repeated), those of a cut call a prefix of one attempt's; the final message is
  the last call's reply; a tool call's result shows once (but under a tool retry after the first
  event);
- usage: a run's usage is the sum of every attempt of it whose model reported its usage (at most
  that with a hedge in the stack, whose loser is not counted, as documented);
- call limits (per run and per session, counted by a probe inside the limit), tool-call limits,
  and the run, session and user budgets hold under parallel runs; a timeout ends each stalled
  attempt within its deadline (+ slack), and a run ends with its result or a typed error;
- no task, model stream or coroutine is left open; a session keeps the replies and tool results
  the caller saw, and every session is usable afterwards (a fault-free run on it ends).

A seed fixes a case's draws; the interleaving of its runs also depends on time (the hedge's
delay, the timeouts, the interrupts are real timers), so a failure may need its seed run a few
times to show again.

Knobs: ``RESILIENCE_CASES`` (cases, default 30), ``RESILIENCE_SEED`` (the first seed, default 0).
A failure names its seed: ``RESILIENCE_SEED=<seed> RESILIENCE_CASES=1`` runs that case alone."""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from agentscope_py import ChatUsage, ReActAgent, RuntimeContext, tool
from agentscope_py.errors import (
    AgentInterrupted,
    BadRequestError,
    MalformedStreamError,
    MiddlewareTermination,
    ModelConnectionError,
    ModelError,
    RateLimitError,
    ServerError,
)
from agentscope_py.events import AgentResult
from agentscope_py.extension.base import ExtensionPoint, MiddlewareBase
from agentscope_py.middleware import (
    BudgetMiddleware,
    GuardrailMiddleware,
    HedgeMiddleware,
    InMemoryCacheStore,
    ModelCallLimitMiddleware,
    ModelFallbackMiddleware,
    RateLimitMiddleware,
    ResponseCacheMiddleware,
    RetryMiddleware,
    TimeoutMiddleware,
    ToolCallLimitMiddleware,
    ToolRetryMiddleware,
)
from agentscope_py.model.base import ChatChunk, ModelRequest, ToolCallChunk
from agentscope_py.stream import aclose
from tests.leftovers import nothing_left
from tests.middleware.resilience_helpers import balance, model_calls

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore::agentscope_py.extension.lints.MiddlewareOrderWarning")]

CASES = int(os.environ.get("RESILIENCE_CASES", "30"))
SEED = int(os.environ.get("RESILIENCE_SEED", "0"))
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa"]
FORBIDDEN = "forbidden"
LONG = 30.0  # a stall: far past every deadline a case sets
SLACK = 1.5  # seconds a deadline may be overrun on a loaded machine
ESTIMATE = 10  # a model call's input tokens, and the budget's estimate of them
TYPED = (ModelError, MiddlewareTermination, AgentInterrupted)
RUN: contextvars.ContextVar[int] = contextvars.ContextVar("RUN", default=-1)  # the run an attempt is made for


# -- the models: every attempt's reply is its own (its id is in its text) ----------------------------


@dataclass(frozen=True)
class Reply:
    thinking: str
    text: str
    calls: tuple[tuple[str, str], ...]  # (tool name, argument JSON)

    def usage(self) -> ChatUsage:
        size = len(self.text) + len(self.thinking) + sum(len(a) for _, a in self.calls)
        # (Never more than a budget's estimate, ``ESTIMATE``, and the output it counts, a
        # quarter of the characters rounded up: a budget's limits then hold exactly.)
        return ChatUsage(input_tokens=ESTIMATE, output_tokens=size // 4)


@dataclass
class Attempt:
    aid: int
    model: str
    key: tuple[str, int]  # (question, tool rounds since it)
    fault: str
    reply: Reply
    error: BaseException | None = None
    run: int = -1
    stalled_at: float | None = None
    ended_at: float | None = None
    completed: bool = False
    usage_out: bool = False  # the chunk with its usage went out: the provider billed it


def question_and_round(request: ModelRequest) -> tuple[str, int]:
    msgs = list(request.messages)
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i].role == "user" and msgs[i].text.startswith("Q"):
            rounds = sum(1 for m in msgs[i + 1:] if m.role == "assistant" and m.tool_calls)
            return msgs[i].text, rounds
    raise AssertionError(f"no question in {[m.text for m in msgs]}")


def reply_for(question: str, rounds: int, aid: int, rng: random.Random) -> Reply:
    plan = random.Random(question)  # how many tool rounds a question takes: the same for every attempt
    tool_rounds = plan.choice([0, 0, 1, 2])
    thinking = f"think {aid} " + " ".join(rng.choices(WORDS, k=rng.randint(1, 3))) if rng.random() < 0.4 else ""
    if rounds < tool_rounds:
        calls = tuple((rng.choice(["work", "stream_work"]), json.dumps({"q": f"{question}.{rounds}.{j}.{aid}"}))
                      for j in range(rng.randint(1, 2)))
        return Reply(thinking, f"working {aid}" if rng.random() < 0.3 else "", calls)
    words = [f"{question}/{rounds}", f"a{aid}", *rng.choices(WORDS, k=rng.randint(2, 7))]
    if rng.random() < 0.1:
        words.insert(rng.randint(2, len(words)), FORBIDDEN)
    return Reply(thinking, " ".join(words) + ".", ())


def before_error(rng: random.Random) -> BaseException:
    return rng.choice([
        lambda: ServerError("503 before the first chunk"),
        lambda: RateLimitError("429", retry_after=rng.choice([None, 0.5, 3.0, 100.0])),
        lambda: ModelConnectionError("connection refused"),
        lambda: BadRequestError("400 bad request"),
    ])()


class FaultModel:
    """Streams a reply of its own per attempt in small chunks; the case's rng draws each attempt's
    fault. Every attempt is recorded in ``case.attempts``; ``open`` counts streams not closed."""

    provider = "test"

    def __init__(self, name: str, case: Case) -> None:
        self.name, self.case = name, case
        self.open = 0

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        case = self.case
        rng = case.rng
        question, rounds = question_and_round(request)
        aid = len(case.attempts)
        reply = reply_for(question, rounds, aid, rng)
        fault = case.draw_fault()
        at = rng.randint(0, 6)
        attempt = Attempt(aid, self.name, (question, rounds), fault, reply, run=RUN.get())
        case.attempts.append(attempt)
        chunks: list[ChatChunk] = []
        if reply.thinking:
            mid = len(reply.thinking) // 2
            chunks += [ChatChunk(thinking=reply.thinking[:mid]),
                       ChatChunk(thinking=reply.thinking[mid:], thinking_signature="sig")]
        for i in range(0, len(reply.text), 7):
            chunks.append(ChatChunk(text=reply.text[i:i + 7]))
        for j, (name, args) in enumerate(reply.calls):
            half = len(args) // 2
            chunks.append(ChatChunk(tool_call=ToolCallChunk(index=j, id=f"c{aid}_{j}", name=name,
                                                            arguments=args[:half])))
            chunks.append(ChatChunk(tool_call=ToolCallChunk(index=j, arguments=args[half:])))
        chunks.append(ChatChunk(usage=reply.usage(), finish_reason="tool_calls" if reply.calls else "stop"))
        self.open += 1
        try:
            if fault == "before":
                attempt.error = before_error(rng)
                raise attempt.error
            late = fault == "mid" and rng.random() < 0.2  # after the last chunk: the usage was read
            at = 0 if fault == "stall" and case.stall_first_only else min(at, len(chunks) - 1)
            if late:
                at = len(chunks)
            for i, chunk in enumerate(chunks):
                if i == at and fault == "mid" and i > 0:
                    attempt.error = rng.choice([ServerError("the connection dropped"),
                                                MalformedStreamError("a broken chunk")])
                    raise attempt.error
                if i == at and fault == "stall":
                    attempt.stalled_at = time.monotonic()
                    await asyncio.sleep(LONG)
                await asyncio.sleep(0)
                if chunk.usage is not None:
                    attempt.usage_out = True
                yield chunk
            if late:
                attempt.error = ServerError("the connection dropped after the last chunk")
                raise attempt.error
            attempt.completed = True
        finally:
            attempt.ended_at = time.monotonic()
            self.open -= 1


# -- the tool -------------------------------------------------------------------------------------


def make_tool(case: Case) -> Any:
    @tool
    async def work(q: str, ctx: RuntimeContext) -> str:
        """Do some work."""
        case.tool_attempts.setdefault((ctx.reply_id, q), 0)
        case.tool_attempts[(ctx.reply_id, q)] += 1
        r = case.rng.random()
        if r < case.tool_fail:
            raise RuntimeError(f"work on {q} failed")
        if r < case.tool_fail + case.tool_stall:
            await asyncio.sleep(LONG)
        await asyncio.sleep(0)
        return f"done {q}"

    @tool
    async def stream_work(q: str, ctx: RuntimeContext) -> AsyncIterator[str]:
        """Do some work, streaming its result in parts."""
        case.tool_attempts.setdefault((ctx.reply_id, q), 0)
        case.tool_attempts[(ctx.reply_id, q)] += 1
        r = case.rng.random()
        fail_at = case.rng.randint(0, 2) if r < case.tool_fail else None
        for k in range(3):
            if k == fail_at:
                raise RuntimeError(f"stream_work on {q} failed after {k} part(s)")
            if k == 1 and case.tool_fail <= r < case.tool_fail + case.tool_stall:
                await asyncio.sleep(LONG)
            await asyncio.sleep(0)
            yield f"part {k} of {q}; "

    return [work, stream_work]


class Probe(MiddlewareBase):
    """Records each model call that reaches it, by run (``ctx.reply_id``) and session, as its
    stream is subscribed: put right inside a limit, it counts the calls the limit let through."""

    def __init__(self, name: str, case: Case) -> None:
        self.probe_name, self.case = name, case

    def active_points(self) -> Any:
        return (ExtensionPoint.ON_MODEL_CALL,)

    def on_model_call(self, agent: Any, ctx: RuntimeContext, input: Any, next: Any) -> Any:
        stream = next(input)
        record = self.case.reached.setdefault(self.probe_name, [])

        async def read() -> Any:
            record.append((ctx.session_id, ctx.reply_id))
            it = stream.__aiter__()
            try:
                async for ev in it:
                    yield ev
            finally:
                await aclose(it)

        return read()


# -- a case ---------------------------------------------------------------------------------------


LAYERS = ["retry", "retry", "fallback", "timeout", "hedge", "toolretry", "ratelimit", "budget", "modellimit",
          "toollimit", "cache", "guardrail"]
MODEL_FACTOR_LAYERS = {"retry", "fallback", "hedge"}


@dataclass
class Case:
    seed: int
    rng: random.Random
    p_fault: float = 0.0
    stall_ok: bool = False
    stall_first_only: bool = False
    tool_fail: float = 0.0
    tool_stall: float = 0.0
    now: float = 1000.0  # the rate limit's clock, moved by its sleeps
    rate_rate: float = 0.0
    rate_burst: float = 0.0
    faults_off: bool = False
    notes: list[str] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    tool_attempts: dict[tuple[str | None, str], int] = field(default_factory=dict)
    retries: list[tuple[Any, int, BaseException, float]] = field(default_factory=list)  # (mw, retry, error, delay)
    slept: dict[int, list[float]] = field(default_factory=dict)  # id(mw) -> delays slept
    tool_retries: list[tuple[Any, int, str, float]] = field(default_factory=list)
    reached: dict[str, list[tuple[str, str | None]]] = field(default_factory=dict)  # probe -> (session, run)
    retry_on: dict[int, Any] = field(default_factory=dict)  # id(retry) -> its retry_on

    def draw_fault(self) -> str:
        if self.faults_off or self.rng.random() >= self.p_fault:
            return "ok"
        return self.rng.choice(["before", "before", "mid"] + (["stall"] if self.stall_ok else []))

    def sleeper(self, mw_id: list[int]) -> Any:
        async def sleep(delay: float) -> None:
            self.slept.setdefault(mw_id[0], []).append(delay)
            # (a few milliseconds, so that an interrupt may come during a backoff)
            await asyncio.sleep(self.rng.choice([0, 0, 0.003]))

        return sleep

    async def clock_sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


def expected_delay(mw: Any, retry: int, error: BaseException | None) -> tuple[float, float]:
    """The bounds of the documented wait before retry ``retry`` (1-based) after ``error``."""
    b = mw.backoff
    base = min(b.max_delay, b.initial_delay * b.backoff_factor ** (retry - 1))
    low, high = base * (1 - b.jitter), base * (1 + b.jitter)
    hint = getattr(error, "retry_after", None)
    if isinstance(hint, int | float) and hint > 0:
        low, high = max(low, hint), max(high, hint)
    return min(low, b.max_delay), min(high, b.max_delay)


def _no_forbidden(check: Any) -> str | None:
    return "says the word" if FORBIDDEN in check.text else None


async def _no_forbidden_async(check: Any) -> str | None:
    await asyncio.sleep(0)
    return _no_forbidden(check)


def build_layer(kind: str, case: Case, rng: random.Random, backups: list[Any], timeout: dict[str, float]) -> Any:
    if kind == "retry":
        mw_id: list[int] = [0]
        retry_on = rng.choice([None, None, ServerError, (RateLimitError, ModelConnectionError)])
        mw = RetryMiddleware(
            rng.randint(0, 3), initial_delay=rng.choice([0.5, 1.0]), backoff_factor=rng.choice([1.0, 2.0, 3.0]),
            max_delay=rng.choice([2.0, 10.0, 60.0]), jitter=rng.choice([False, True, 0.1]),
            sleep=case.sleeper(mw_id), rng=random.Random(rng.random()), retry_on=retry_on,
            on_retry=lambda retry, error, delay: case.retries.append((mw, retry, error, delay)),
            **rng.choice([{}, {}, {"buffer": True}, {"after_first_event": True}, {"on_failure": "continue"}]))
        mw_id[0] = id(mw)
        case.retry_on[id(mw)] = retry_on
        return mw
    if kind == "fallback":
        k = rng.randint(1, 2)
        return ModelFallbackMiddleware(*backups[:k], **rng.choice([{}, {}, {"after_first_event": True},
                                                                  {"buffer": True}]))
    if kind == "timeout":
        return TimeoutMiddleware(**timeout)
    if kind == "hedge":
        return HedgeMiddleware(rng.choice([None, backups[2]]), **rng.choice([
            {"after": 0.005}, {"after": 0.02}, {"after": "p50", "min_samples": 1, "floor": 0.001, "ceiling": 0.05}]))
    if kind == "toolretry":
        tool_id: list[int] = [0]
        tmw = ToolRetryMiddleware(
            rng.randint(0, 2), initial_delay=0.5, jitter=rng.choice([False, True]), sleep=case.sleeper(tool_id),
            rng=random.Random(rng.random()), on_failure=rng.choice(["continue", "continue", "raise"]),
            on_retry=lambda retry, call, text, delay: case.tool_retries.append((tmw, retry, text, delay)),
            **rng.choice([{}, {"buffer": True}, {"after_first_event": True}]))
        tool_id[0] = id(tmw)
        return tmw
    if kind == "ratelimit":
        case.rate_rate, case.rate_burst = rng.choice([1.0, 5.0]), rng.choice([1, 3])
        return RateLimitMiddleware(case.rate_rate, case.rate_burst, key=rng.choice(["global", "user"]),
                                   on_limit=rng.choice(["wait", "wait", "reject"]), clock=lambda: case.now,
                                   sleep=case.clock_sleep)
    if kind == "budget":
        return BudgetMiddleware(run_tokens=rng.choice([60, 200, 10_000]), session_tokens=rng.choice([None, 50, 150]),
                                user_tokens=rng.choice([None, 100, 300]), on_exceeded=rng.choice(["stop", "error"]),
                                estimate=lambda input: ESTIMATE)
    if kind == "modellimit":
        return ModelCallLimitMiddleware(run_limit=rng.choice([1, 2, 4]), session_limit=rng.choice([3, 8, None]),
                                        exit_behavior=rng.choice(["end", "error"]))
    if kind == "toollimit":
        return ToolCallLimitMiddleware(run_limit=rng.choice([1, 2, 3]),
                                       exit_behavior=rng.choice(["continue", "end", "error"]))
    if kind == "cache":
        return ResponseCacheMiddleware(InMemoryCacheStore(64))
    if kind == "guardrail":
        return GuardrailMiddleware(**rng.choice([{"stream": _no_forbidden}, {"output": _no_forbidden},
                                                 {"stream": _no_forbidden_async}]),
                                   exit_behavior=rng.choice(["end", "error"]), blocking=rng.random() < 0.4,
                                   refusal=rng.choice([None, "I cannot say."]))
    raise AssertionError(kind)


def model_factor(mws: list[Any]) -> int:
    """The most model attempts one request may take under the stack."""
    n = 1
    for mw in mws:
        if isinstance(mw, RetryMiddleware):
            n *= mw.max_retries + 1
        elif isinstance(mw, ModelFallbackMiddleware):
            n *= len(mw.models) + 1
        elif isinstance(mw, HedgeMiddleware):
            n *= 2
    return n


def outside_of(mws: list[Any], cls: type, kinds: tuple[type, ...]) -> bool:
    """Whether the ``cls`` layer is outside every layer of ``kinds``."""
    at = next(j for j, m in enumerate(mws) if isinstance(m, cls))
    return not any(isinstance(m, kinds) for m in mws[:at])


# -- reading the caller's events --------------------------------------------------------------------


def calls_of(events: list[Any]) -> list[tuple[Any, Any, Reply]]:
    """Each top-level model call: its start, its end, and the reply its events carry."""
    return [(start, end, Reply(thinking, text, calls)) for start, end, thinking, text, calls in model_calls(events)]


def is_prefix(part: Reply, whole: Reply) -> bool:
    if not whole.thinking.startswith(part.thinking) or not whole.text.startswith(part.text):
        return False
    if len(part.calls) > len(whole.calls):
        return False
    return all(n == wn and wa.startswith(a) for (n, a), (wn, wa) in zip(part.calls, whole.calls, strict=False))


# -- the case -----------------------------------------------------------------------------------------


async def run_case(seed: int) -> None:
    rng = random.Random(seed)
    case = Case(seed, rng)
    kinds = [k for k in LAYERS if rng.random() < 0.35]
    rng.shuffle(kinds)
    if "timeout" in kinds:
        timeout = rng.choice([{"first_event_timeout": 0.1}, {"model_timeout": 0.3}, {"model_timeout": 0.3,
                              "tool_timeout": 0.2}, {"run_timeout": 1.0}, {"tool_timeout": 0.2}])
    else:
        timeout = {}
    case.p_fault = rng.choice([0.0, 0.2, 0.4, 0.6])
    case.stall_ok = bool({"first_event_timeout", "model_timeout", "run_timeout"} & set(timeout))
    case.stall_first_only = set(timeout) == {"first_event_timeout"}
    case.tool_fail = rng.choice([0.0, 0.3, 0.6])
    case.tool_stall = 0.2 if {"tool_timeout", "run_timeout"} & set(timeout) else 0.0
    case.notes.append(f"stack (outermost first) {kinds}, timeout {timeout}, model faults p={case.p_fault}, "
                      f"tool fail {case.tool_fail} stall {case.tool_stall}")
    primary = FaultModel("m", case)
    backups = [FaultModel("b1", case), FaultModel("b2", case), FaultModel("h", case)]
    models = [primary, *backups]
    layer_rng = random.Random(f"{seed}/layers")
    mws = [build_layer(k, case, layer_rng, backups, timeout) for k in kinds]
    if rng.random() < 0.5:  # (a probe wraps the stream: the retries' unwrapped paths are then not taken)
        for cls, name in ((ModelCallLimitMiddleware, "limit"), (RateLimitMiddleware, "rate")):
            at = next((j for j, m in enumerate(mws) if isinstance(m, cls)), None)
            if at is not None:
                mws.insert(at + 1, Probe(name, case))
        mws.append(Probe("model", case))
    case.notes.append("layers: " + ", ".join(f"{type(m).__name__}{vars_of(m)}" for m in mws))
    trace = rng.random() < 0.2  # hook tracing's brackets come before a layer's first event
    case.notes.append(f"hook tracing: {trace}")
    agent = (ReActAgent.builder().name("a").model(primary).tools(*make_tool(case)).max_iters(4)
             .middlewares(mws).trace_middleware(trace).build())
    n_runs = rng.randint(2, 7)
    questions = [f"Q{rng.randint(0, 3) if 'cache' in kinds else i}" for i in range(n_runs)]
    modes = [rng.choice(["call", "stream", "stream", "leave", "interrupt"]) for _ in range(n_runs)]
    sessions = [f"s{i}" if rng.random() < 0.7 else "shared" for i in range(n_runs)]
    leave_at = [rng.randint(1, 25) for _ in range(n_runs)]
    case.notes.append(f"runs: {list(zip(questions, modes, sessions, strict=True))}")
    outcomes: list[str] = [""] * n_runs
    errors: list[BaseException | None] = [None] * n_runs
    seen: list[list[Any]] = [[] for _ in range(n_runs)]
    took: list[float] = [0.0] * n_runs

    async def one(i: int) -> None:
        ctx = RuntimeContext(user_id="u", session_id=sessions[i])
        RUN.set(i)
        began = time.monotonic()
        try:
            if modes[i] == "call":
                msg = await agent.call(questions[i], ctx=ctx)
                outcomes[i] = f"done:{msg.generate_reason}"
                seen[i].append(msg)
                return
            if modes[i] == "interrupt":
                asyncio.get_running_loop().call_later(rng.random() * 0.05, agent.interrupt, "u", sessions[i])
            it = agent.stream(questions[i], ctx=ctx).__aiter__()
            try:
                async for ev in it:
                    seen[i].append(ev)
                    if modes[i] == "leave" and len(seen[i]) >= leave_at[i]:
                        outcomes[i] = "left"
                        return
                    if isinstance(ev, AgentResult) and ev.source is None:
                        outcomes[i] = f"done:{ev.result.generate_reason}"
            finally:
                await aclose(it)
            outcomes[i] = outcomes[i] or "ended"
        except TYPED as exc:
            outcomes[i] = type(exc).__name__
            errors[i] = exc
        finally:
            took[i] = time.monotonic() - began

    try:
        async with asyncio.timeout(30):
            i = 0
            while i < n_runs:  # waves of runs at once
                k = rng.randint(1, 3)
                await asyncio.gather(*(one(j) for j in range(i, min(n_runs, i + k))))
                i += k
            await asyncio.sleep(0.02)  # the hedges' cancelled attempts end
        check_case(case, mws, kinds, timeout, questions, modes, sessions, outcomes, errors, seen, took)
        for i in range(n_runs):
            if modes[i] == "stream" and sessions[i] != "shared" and outcomes[i].startswith("done"):
                await check_session(agent, sessions[i], seen[i])
        budget = next((m for m in mws if isinstance(m, BudgetMiddleware)), None)
        # The session and user budgets hold under runs at once: exactly, as the reported usage
        # never passes the estimate and the output counted — unless a retry, fallback or hedge is
        # inside the budget, whose next attempts take their holds past the limit (the call goes
        # on), the order the `limit-outside-retry` lint warns of.
        inside = mws[mws.index(budget) + 1:] if budget is not None else []
        if budget is not None and not any(isinstance(m, RetryMiddleware | ModelFallbackMiddleware | HedgeMiddleware)
                                          for m in inside):
            session_limit = budget.limits.get(("session", "tokens"))
            for session in set(sessions):
                loaded = await agent.state_store.load("u", session)
                spent = budget.session_spent(loaded[0]).tokens if loaded is not None and loaded[0] is not None else 0
                assert session_limit is None or spent <= session_limit, \
                    f"session {session} spent {spent} tokens, its budget {session_limit}"
            user_limit = budget.limits.get(("user", "tokens"))
            spent = (await budget.user_spent("u")).tokens
            assert user_limit is None or spent <= user_limit, f"the user spent {spent} tokens, the budget {user_limit}"
        assert all(m.open == 0 for m in models), f"model streams left open: {[m.open for m in models]}"
        # Every session is usable afterwards: a fault-free run on it ends with a reply (a limit
        # reached may refuse it, as a typed stop).
        case.faults_off, case.tool_fail, case.tool_stall = True, 0.0, 0.0
        async with asyncio.timeout(10):
            for session in sorted(set(sessions)):
                try:
                    msg = await agent.call(f"Q{session}-after", ctx=RuntimeContext(user_id="u", session_id=session))
                except MiddlewareTermination:
                    continue
                assert msg.role == "assistant", f"session {session}: the run after answered {msg}"
        assert all(m.open == 0 for m in models), f"model streams left open: {[m.open for m in models]}"
    except BaseException as exc:
        notes = "\n".join(case.notes)
        attempts = [(a.aid, a.model, a.key, a.fault, type(a.error).__name__ if a.error else None, a.completed)
                    for a in case.attempts]
        raise AssertionError(f"RESILIENCE_SEED={seed}: {exc!r}\n{notes}\noutcomes: {outcomes}\n"
                             f"took: {[round(t, 3) for t in took]}\nattempts: {attempts}") from exc


def vars_of(mw: Any) -> str:
    keep = ("max_retries", "mode", "on_failure", "limit", "run_limit", "session_limit", "blocking", "exit_behavior",
            "refusal", "stream_checks", "output_checks")
    return str({k: getattr(mw, k) for k in keep if hasattr(mw, k) and not callable(getattr(mw, k))})


def check_case(case: Case, mws: list[Any], kinds: list[str], timeout: dict[str, float], questions: list[str],
               modes: list[str], sessions: list[str], outcomes: list[str], errors: list[BaseException | None],
               seen: list[list[Any]], took: list[float]) -> None:
    # -- attempts within bounds ------------------------------------------------------------------
    factor = model_factor(mws)
    per_key: dict[tuple[str, int], int] = {}
    for a in case.attempts:
        per_key[a.key] = per_key.get(a.key, 0) + 1
    for key, n in per_key.items():
        runs = questions.count(key[0])
        assert n <= factor * runs, f"{n} model attempts at {key}, at most {factor} x {runs} run(s)"
    per_run_key: dict[tuple[int, tuple[str, int]], list[Attempt]] = {}
    for a in case.attempts:
        per_run_key.setdefault((a.run, a.key), []).append(a)
    for (run, key), tried in per_run_key.items():
        assert len(tried) <= factor, f"run {run}: {len(tried)} model attempts at {key}, at most {factor}"
        if not {"fallback", "hedge"} & set(kinds):
            # Only retries make attempts again: none after an error no retry takes.
            for a in tried[:-1]:
                refused = all(not (isinstance(a.error, ModelError) and a.error.retryable if spec is None
                                   else isinstance(a.error, spec)) for spec in case.retry_on.values())
                assert a.error is None or not refused, \
                    f"run {run}: {a.error!r} at {key} was tried again ({[t.aid for t in tried]})"
    tool_retry = next((m for m in mws if isinstance(m, ToolRetryMiddleware)), None)
    tool_bound = tool_retry.max_retries + 1 if tool_retry is not None else 1
    for (reply_id, q), n in case.tool_attempts.items():
        assert n <= tool_bound, f"tool call {q} of {reply_id} ran {n} times, at most {tool_bound}"
    tool_limit = next((m for m in mws if isinstance(m, ToolCallLimitMiddleware)), None)
    if tool_limit is not None:
        ran: dict[str | None, int] = {}
        for reply_id, _ in case.tool_attempts:
            ran[reply_id] = ran.get(reply_id, 0) + 1
        for reply_id, n in ran.items():
            assert n <= tool_limit.run_limit, f"run {reply_id} ran {n} tool calls, its limit {tool_limit.run_limit}"
    # The calls a call limit let through, per run and per session, by the probe right inside it.
    limit_mw = next((m for m in mws if isinstance(m, ModelCallLimitMiddleware)), None)
    if "limit" in case.reached and limit_mw is not None:
        per_run: dict[str | None, int] = {}
        per_session: dict[str, int] = {}
        for session, reply_id in case.reached["limit"]:
            per_run[reply_id] = per_run.get(reply_id, 0) + 1
            per_session[session] = per_session.get(session, 0) + 1
        for reply_id, n in per_run.items():
            assert n <= limit_mw.run_limit, f"run {reply_id}: {n} calls past the call limit"
        if limit_mw.session_limit is not None:
            for session, n in per_session.items():
                assert n <= limit_mw.session_limit, f"session {session}: {n} calls past its limit"
    # The calls a rate limit let through: its burst, and its rate over the time its waits moved
    # the clock (every run is one user's: one bucket, whatever the key).
    rate = next((m for m in mws if isinstance(m, RateLimitMiddleware)), None)
    if "rate" in case.reached and rate is not None:
        n = len(case.reached["rate"])
        allowed = case.rate_burst + case.rate_rate * (case.now - 1000.0)
        assert n <= allowed + 1e-6, f"{n} calls past a rate limit allowing {allowed:.2f}"
    # -- backoff: each retry's wait is its documented delay, and is what was slept ---------------
    for mw, retry, error, delay in case.retries:
        assert 1 <= retry <= mw.max_retries, f"retry {retry} of at most {mw.max_retries}"
        spec = case.retry_on[id(mw)]
        matches = isinstance(error, ModelError) and error.retryable if spec is None else isinstance(error, spec)
        assert matches and not isinstance(error, AgentInterrupted), f"an error retry_on={spec} refuses retried: {error!r}"
        low, high = expected_delay(mw, retry, error)
        assert low - 1e-9 <= delay <= high + 1e-9, f"retry {retry} after {error!r} waits {delay}, not in [{low}, {high}]"
    for mw, retry, _text, delay in case.tool_retries:
        assert 1 <= retry <= mw.max_retries, f"tool retry {retry} of at most {mw.max_retries}"
        low, high = expected_delay(mw, retry, None)
        assert low - 1e-9 <= delay <= high + 1e-9, f"tool retry {retry} waits {delay}, not in [{low}, {high}]"
    for mw in mws:
        if isinstance(mw, RetryMiddleware | ToolRetryMiddleware):
            told = sorted(d for m, _, _, d in (case.retries if isinstance(mw, RetryMiddleware) else case.tool_retries)
                          if m is mw)
            slept = sorted(case.slept.get(id(mw), []))
            assert all(slept.count(d) <= told.count(d) for d in slept), f"slept {slept}, the retries said {told}"
            if "interrupt" not in modes:
                assert slept == told, f"slept {slept}, the retries said {told}"
    # -- a timeout ends each stalled attempt within its deadline ---------------------------------
    deadline = min(timeout.get("model_timeout", LONG), timeout.get("first_event_timeout", LONG),
                   timeout.get("run_timeout", LONG))
    for a in case.attempts:
        if a.stalled_at is not None:
            assert a.ended_at is not None, f"attempt {a.aid} stalled and never ended"
            assert a.ended_at - a.stalled_at <= deadline + SLACK, \
                f"attempt {a.aid} stalled {a.ended_at - a.stalled_at:.2f} s past a {deadline} s deadline"
    if "run_timeout" in timeout:
        for i, t in enumerate(took):
            assert t <= timeout["run_timeout"] + SLACK, f"run {i} took {t:.2f} s, its run_timeout {timeout['run_timeout']}"
    # -- each run: ended, coherent -------------------------------------------------------------
    by_aid = {a.aid: a for a in case.attempts}
    whole = {a.reply for a in case.attempts if a.completed}
    limit = next((m for m in mws if isinstance(m, ModelCallLimitMiddleware)), None)
    budget = next((m for m in mws if isinstance(m, BudgetMiddleware)), None)
    for i, outcome in enumerate(outcomes):
        assert outcome, f"run {i} ended with no result and no error"
        events = seen[i]
        if outcome.startswith("done"):
            # Every attempt of the run whose usage went out counts once: the run's usage.
            # (A hedge's loser is not counted, as documented, even when a buffering layer inside
            # it let its model answer whole before the race was decided.)
            result = events[-1] if modes[i] == "call" else next(
                e.result for e in events if isinstance(e, AgentResult) and e.source is None)
            billed = sum((a.reply.usage() for a in case.attempts if a.run == i and a.usage_out), ChatUsage())
            counted = result.usage or ChatUsage()
            if "hedge" in kinds:
                assert counted.input_tokens <= billed.input_tokens and counted.output_tokens <= billed.output_tokens, \
                    f"run {i}: the reply's usage {result.usage}, more than the attempts billed {billed}"
            else:
                assert counted == billed, f"run {i}: the reply's usage {result.usage}, the attempts billed {billed}"
        if modes[i] == "call" or outcome == "left":
            if modes[i] == "call" and outcome.startswith("done"):
                text = events[-1].text
                # (A stop — a guardrail, a budget cutting the call short — keeps what went out.)
                assert not text.startswith("Q") or any(text == r.text for r in whole) or (
                    outcome != "done:model_stop" and any(a.reply.text.startswith(text) for a in case.attempts)), \
                    f"run {i}: call() answered {text!r}, which no attempt completed"
            continue
        assert not balance(events), f"run {i}: unbalanced {balance(events)}: {[e.type for e in events]}"
        ids = [e.id for e in events]
        assert len(ids) == len(set(ids)), f"run {i}: an event id twice"
        blocks = [e.block_id for e in events if e.type.endswith("_block_start")]
        assert len(blocks) == len(set(blocks)), f"run {i}: a block id twice: {blocks}"
        results = [e.tool_call_id for e in events if e.type == "tool_result_start" and e.source is None]
        if not any(isinstance(m, ToolRetryMiddleware) and m.mode == "always" for m in mws):
            # (Only a tool retry after the first event shows a call's failed result, then the next.)
            assert len(results) == len(set(results)), f"run {i}: a tool call's result twice: {results}"
        calls = calls_of(events)
        for start, end, reply in calls:
            if end.discarded:
                continue
            if end.error is None:
                assert reply in whole, f"run {i}: a call carried a reply no attempt completed: {reply}"
                owner = next(a for a in case.attempts if a.completed and a.reply == reply)
                if start.metadata.get("cache") != "hit":
                    assert (start.model, end.model) == (owner.model, owner.model), \
                        f"run {i}: the reply of {owner.model} went out as {start.model}'s, ended as {end.model}'s"
                if "guardrail" in kinds:
                    assert FORBIDDEN not in reply.text or end.metadata.get("cache") == "hit", \
                        f"run {i}: a reply past the guardrail: {reply}"
            elif not reply.text.startswith("The model call failed"):
                assert any(is_prefix(reply, a.reply) for a in by_aid.values()), \
                    f"run {i}: a cut call carried what no attempt streamed: {reply}"
        if outcome.startswith("done"):
            result = next(e.result for e in events if isinstance(e, AgentResult) and e.source is None)
            kept = [(s, e, r) for s, e, r in calls if not e.discarded]
            if result.generate_reason.value == "model_stop" and kept:
                assert result.text == kept[-1][2].text, \
                    f"run {i}: the final message {result.text!r}, the last call's reply {kept[-1][2].text!r}"
        if limit is not None and limit.run_limit is not None:
            n = len([c for c in calls if not c[1].discarded and c[0].metadata.get("cache") != "hit"])
            assert n <= max(limit.run_limit * model_factor(mws), 1), f"run {i}: {n} model calls past the limit"
        if budget is not None:
            run_limit = budget.limits.get(("run", "tokens"))
            if run_limit is not None:
                used = [e.usage.total_tokens if e.usage else 0 for _, e, _ in calls]
                spent = sum(used)
                assert spent <= run_limit + max(used, default=0), \
                    f"run {i}: spent {spent} tokens, the run budget {run_limit}"
    for i, error in enumerate(errors):
        if error is not None:
            assert isinstance(error, TYPED), f"run {i} raised {error!r}"
    # The call limit per run, over the attempts it let through (limits under parallel runs).
    if limit is not None and limit.session_limit is not None:
        for session in set(sessions):
            n = sum(len([c for c in calls_of(seen[i]) if not c[1].discarded and c[0].metadata.get("cache") != "hit"])
                    for i in range(len(seen)) if sessions[i] == session and modes[i] != "call")
            runs = sum(1 for i in range(len(seen)) if sessions[i] == session)
            assert n <= limit.session_limit * model_factor(mws) + runs, \
                f"session {session}: {n} model calls past its limit {limit.session_limit}"


async def check_session(agent: ReActAgent, session: str, seen: list[Any]) -> None:
    """A run that ended with its result in a session of its own: the session keeps the replies
    the caller saw, and its last message is the caller's result."""
    loaded = await agent.state_store.load("u", session)
    assert loaded is not None
    state = loaded[0]
    result = next(e.result for e in reversed(seen) if isinstance(e, AgentResult))
    if result.generate_reason.value != "model_stop":  # (a stop's reply is not remembered: nothing to compare)
        return
    last = state.context[-1]
    assert (last.role, last.text) == (result.role, result.text), \
        f"session {session}: kept {last.role}:{last.text!r}, the caller got {result.role}:{result.text!r}"
    kept = [(m.text, tuple((c.name, c.input) for c in m.tool_calls)) for m in state.context
            if m.role == "assistant"]
    shown = [(reply.text, tuple((name, json.loads(args)) for name, args in reply.calls))
             for _, end, reply in calls_of(seen) if not end.discarded]
    assert kept == shown, f"session {session}: kept {kept}, the caller saw {shown}"
    # Each tool call's result kept is the last one the caller saw (a tool retry's, when it ran).
    results = {b.id: (b.state.value, b.text) for m in state.context if m.role == "tool" for b in m.content
               if b.type == "tool_result"}
    outcome: dict[str, tuple[str, str]] = {}
    for ev in seen:
        if ev.source is None and ev.type == "tool_result_start":
            outcome[ev.tool_call_id] = ("", "")
        elif ev.source is None and ev.type == "tool_result_text_delta":
            outcome[ev.tool_call_id] = ("", outcome[ev.tool_call_id][1] + ev.delta)
        elif ev.source is None and ev.type == "tool_result_end":
            outcome[ev.tool_call_id] = (ev.state.value, outcome[ev.tool_call_id][1])
    assert results == outcome, f"session {session}: kept the tool results {results}, the caller saw {outcome}"


@pytest.mark.parametrize("seed", range(SEED, SEED + CASES))
async def test_the_resilience_built_ins_under_random_faults(seed: int) -> None:
    async with nothing_left(f"RESILIENCE_SEED={seed}"):
        await run_case(seed)


# -- the escapes the property found, each alone ------------------------------------------------------


class LateFailure:
    """Answers whole (its usage included), then its first attempt's connection drops."""

    provider = "test"
    name = "m"

    def __init__(self) -> None:
        self.attempts = 0

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self.attempts += 1
        yield ChatChunk(text=f"attempt {self.attempts}")
        yield ChatChunk(usage=ChatUsage(input_tokens=10, output_tokens=5), finish_reason="stop")
        if self.attempts == 1:
            raise ServerError("the connection dropped after the last chunk")


@pytest.mark.parametrize("mode", ["call", "stream"])
async def test_a_buffered_retry_counts_the_usage_of_the_attempt_it_drops(mode: str) -> None:
    # The dropped attempt's model answered (the provider billed it): the run counts it, as it
    # does with after_first_event=True, where the attempt's discarded ModelCallEnd goes out.
    async def no_sleep(delay: float) -> None:
        pass

    agent = ReActAgent.builder().model(LateFailure()).middleware(
        RetryMiddleware(1, buffer=True, sleep=no_sleep)).build()
    if mode == "call":
        reply = await agent.call("hi")
    else:
        events = await agent.stream("hi").to_list()
        assert [(e.discarded, e.error) for e in events if e.type == "model_call_end"] == [(False, None)]
        reply = events[-2].result
    assert reply.text == "attempt 2"
    assert reply.usage == ChatUsage(input_tokens=20, output_tokens=10)


@pytest.mark.parametrize("mode", ["call", "stream"])
async def test_a_guardrail_tripped_at_the_end_of_a_reply_keeps_the_usage_the_model_reported(mode: str) -> None:
    # An output check trips on the whole reply, whose model answered with its usage: the End
    # that closes the call carries that usage, and the run's usage counts it.
    from agentscope_py import ModelStep, ScriptedModel

    @tool
    def look(q: str) -> str:
        """Look."""
        return q

    usage = ChatUsage(input_tokens=10, output_tokens=5)
    model = ScriptedModel([ModelStep.tool_call("look", {"q": "x"}, usage=usage),
                           ModelStep.text(f"a {FORBIDDEN} word", usage=usage)], name="m")
    agent = ReActAgent.builder().model(model).tools(look).middleware(GuardrailMiddleware(output=_no_forbidden)).build()
    if mode == "call":
        reply = await agent.call("hi")
    else:
        events = await agent.stream("hi").to_list()
        ends = [e for e in events if e.type == "model_call_end"]
        assert [(e.usage, (e.error or "").split(":")[0]) for e in ends] == [(usage, ""), (usage, "GuardrailTripped")]
        reply = events[-2].result
    assert reply.generate_reason.value == "middleware_stop_requested"
    assert reply.usage == ChatUsage(input_tokens=20, output_tokens=10)


class Answers:
    """Streams ``text`` in two chunks, then its usage."""

    provider = "test"
    name = "m"

    def __init__(self, text: str) -> None:
        self.text = text

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        half = len(self.text) // 2
        yield ChatChunk(text=self.text[:half])
        yield ChatChunk(text=self.text[half:])
        yield ChatChunk(usage=ChatUsage(input_tokens=10, output_tokens=5), finish_reason="stop")


@pytest.mark.parametrize("mode", ["call", "stream"])
async def test_a_buffered_retry_cut_after_its_model_answered_counts_that_usage(mode: str) -> None:
    # The retry holds the whole attempt, End and usage included; a guardrail outside trips on its
    # text and closes the call: the held End never goes out, but the model answered.
    agent = ReActAgent.builder().model(Answers(f"a {FORBIDDEN} word")).middlewares(
        [GuardrailMiddleware(stream=_no_forbidden), RetryMiddleware(1, buffer=True)]).build()
    if mode == "call":
        reply = await agent.call("hi")
    else:
        reply = (await agent.stream("hi").to_list())[-2].result
    assert reply.generate_reason.value == "middleware_stop_requested"
    assert reply.usage == ChatUsage(input_tokens=10, output_tokens=5)


@pytest.mark.parametrize("mode", ["call", "stream"])
async def test_a_blocking_output_guardrail_that_trips_counts_the_usage_of_the_call_it_held(mode: str) -> None:
    # Blocking with an output check holds the whole call, its Start too: no End goes out to carry
    # the usage, and the run's usage counts it all the same.
    agent = ReActAgent.builder().model(Answers(f"a {FORBIDDEN} word")).middleware(
        GuardrailMiddleware(output=_no_forbidden, blocking=True)).build()
    if mode == "call":
        reply = await agent.call("hi")
    else:
        events = await agent.stream("hi").to_list()
        assert "model_call_start" not in [e.type for e in events]
        reply = events[-2].result
    assert reply.usage == ChatUsage(input_tokens=10, output_tokens=5)


@pytest.mark.parametrize("store", ["memory", "network"])
async def test_a_budget_outside_a_guardrail_does_not_meter_its_refusal_as_a_model_call(store: str) -> None:
    # The refusal comes after the tripped call's End: no model made it. Metered, it took a hold
    # of a call's estimate past the limit, stopped the run in the guardrail's place, and charged
    # a call no model answered.
    from agentscope_py.errors import GuardrailTripped
    from agentscope_py.middleware import InMemoryBudgetStore

    class OverNetwork:  # (a store that is not this process's: the budget's other meter)
        def __init__(self) -> None:
            self.inner = InMemoryBudgetStore()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    budget = BudgetMiddleware(session_tokens=16, user_tokens=10**6, estimate=lambda input: ESTIMATE,
                              **({"store": OverNetwork()} if store == "network" else {}))
    assert (budget.memory_store is None) == (store == "network")
    guard = GuardrailMiddleware(output=_no_forbidden, exit_behavior="error", refusal="I cannot say.")
    agent = ReActAgent.builder().model(Answers(f"a {FORBIDDEN} word")).middlewares([budget, guard]).build()
    ctx = RuntimeContext(user_id="u", session_id="s")
    events: list[Any] = []
    with pytest.raises(GuardrailTripped):
        async for ev in agent.stream("hi", ctx=ctx):
            events.append(ev)
    assert [e.delta for e in events if e.type == "text_block_delta"][-1] == "I cannot say."
    loaded = await agent.state_store.load("u", "s")
    assert loaded is not None and loaded[0] is not None
    assert budget.session_spent(loaded[0]).calls == 1 and budget.session_spent(loaded[0]).tokens == 15
