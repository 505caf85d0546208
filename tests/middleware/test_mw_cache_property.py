"""`ResponseCacheMiddleware` under random compositions and faults, as a seeded random property.

Each case draws a cache (over the in-memory, SQLite or Redis store, sometimes behind a store whose
get and set fail or stall), other middleware inside and outside it in a random order (retries,
a fallback, a timeout, a hedge, a budget, a guardrail, PII redaction), one or two agents sharing
the store, and runs — `call()`, `stream()` read whole, consumers that leave at a random event,
interrupts, identical requests at once — of a model whose replies (thinking, text, tool calls,
usage) are a function of the request, and whose attempts fail at random points (before the first
chunk, mid-stream, a stall past a timeout).

The oracle: a successful model call a caller sees (hit or miss) carries a whole reply the model
made for that request (as the layers in the stack rewrite it); a hit is marked, replays no usage
and keeps the recorded usage in its metadata; every entry the store holds at the end is a whole,
successful reply the model made (never a cut, failed, timed-out or tripped one); every stream is
balanced; a run ends with its result, a stop or a typed error, never a hang; the session keeps
the reply the caller got; no task, connection or file is left open.

Knobs: ``CACHE_CASES`` (cases, default 40), ``CACHE_SEED`` (the first seed, default 0). A
failure names its seed: ``CACHE_SEED=<seed> CACHE_CASES=1`` runs that case alone."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import sqlite3
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import ChatUsage, ReActAgent, RuntimeContext, tool
from agentscope_py.errors import AgentInterrupted, MiddlewareTermination, ModelError, ModelTimeoutError, ServerError
from agentscope_py.events import AgentResult, ModelCallEnd, ModelCallStart
from agentscope_py.middleware import (
    BudgetMiddleware,
    GuardrailMiddleware,
    HedgeMiddleware,
    InMemoryCacheStore,
    ModelFallbackMiddleware,
    PIIRedactionMiddleware,
    RedisCacheStore,
    ResponseCacheMiddleware,
    RetryMiddleware,
    SqliteCacheStore,
    TimeoutMiddleware,
    ToolResultCacheMiddleware,
)
from agentscope_py.middleware.caching.cache import whole_reply
from agentscope_py.middleware.caching.cache_stores import decode_events
from agentscope_py.model.base import ChatChunk, ModelRequest, ToolCallChunk
from agentscope_py.stream import aclose
from tests.leftovers import nothing_left
from tests.middleware.resilience_helpers import model_calls

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore::agentscope_py.extension.lints.MiddlewareOrderWarning")]

CASES = int(os.environ.get("CACHE_CASES", "40"))
SEED = int(os.environ.get("CACHE_SEED", "0"))
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa"]
EMAIL = "ada@example.com"
FORBIDDEN = "forbidden"
REFUSAL = "I cannot say."
LONG = 30.0  # a stall: far past every deadline a case sets


# -- the model: replies are a function of the request, faults are per attempt ------------------------


@dataclass(frozen=True)
class Reply:
    thinking: str
    text: str
    calls: tuple[tuple[str, str], ...]  # (tool name, argument JSON)

    def usage(self) -> ChatUsage:
        return ChatUsage(input_tokens=10, output_tokens=1 + (len(self.text) + len(self.thinking)) // 4)


def question_and_round(request: ModelRequest) -> tuple[str, int]:
    """The last user message's text and the tool rounds since it."""
    msgs = list(request.messages)
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i].role == "user" and msgs[i].text.startswith("Q"):
            rounds = sum(1 for m in msgs[i + 1:] if m.role == "assistant" and m.tool_calls)
            return msgs[i].text, rounds
    raise AssertionError(f"no question in {[m.text for m in msgs]}")


def reply_for(question: str, rounds: int) -> Reply:
    rng = random.Random(f"{question}/{rounds}")
    thinking = f"think {question} {rounds} " + " ".join(rng.choices(WORDS, k=rng.randint(1, 3))) \
        if rng.random() < 0.4 else ""
    if rounds < rng.choice([0, 0, 1, 2]):
        calls = tuple(("lookup", json.dumps({"q": f"{question}.{rounds}.{j}"})) for j in range(rng.randint(1, 2)))
        return Reply(thinking, f"looking {question} {rounds}" if rng.random() < 0.3 else "", calls)
    words = [question, str(rounds), *rng.choices(WORDS, k=rng.randint(2, 7))]
    if rng.random() < 0.25:
        words.insert(rng.randint(2, len(words)), EMAIL)
    if rng.random() < 0.2:
        words.insert(rng.randint(2, len(words)), FORBIDDEN)
    return Reply(thinking, " ".join(words) + ".", ())


class Faults:
    """Draws each model attempt's fault (``ok``, ``before``, ``mid``, ``stall``) from the case's rng."""

    def __init__(self, rng: random.Random, p: float, stall: str | None) -> None:
        self.rng, self.p, self.stall = rng, p, stall  # stall: None, "first" (before the first chunk), "any"

    def draw(self) -> tuple[str, int]:
        r = self.rng.random()
        at = self.rng.randint(0, 6)
        if r >= self.p:
            return "ok", at
        kinds = ["before", "mid"] + (["stall"] if self.stall else [])
        kind = self.rng.choice(kinds)
        return kind, 0 if kind == "stall" and self.stall == "first" else at


class PropModel:
    """Streams `reply_for` the request in small chunks; its attempts fail as `Faults` draws.
    ``completed`` holds every reply it streamed to its end."""

    provider = "test"

    def __init__(self, name: str, faults: Faults, completed: set[Reply], counts: dict[str, int]) -> None:
        self.name, self.faults, self.completed, self.counts = name, faults, completed, counts
        self.open = 0

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        question, rounds = question_and_round(request)
        reply = reply_for(question, rounds)
        fault, at = self.faults.draw()
        self.counts["calls"] = self.counts.get("calls", 0) + 1
        chunks: list[ChatChunk] = []
        if reply.thinking:
            mid = len(reply.thinking) // 2
            chunks += [ChatChunk(thinking=reply.thinking[:mid]), ChatChunk(thinking=reply.thinking[mid:],
                                                                           thinking_signature="sig")]
        text = reply.text
        for i in range(0, len(text), 7):
            chunks.append(ChatChunk(text=text[i:i + 7]))
        for j, (name, args) in enumerate(reply.calls):
            half = len(args) // 2
            chunks.append(ChatChunk(tool_call=ToolCallChunk(index=j, id=f"c{j}", name=name, arguments=args[:half])))
            chunks.append(ChatChunk(tool_call=ToolCallChunk(index=j, arguments=args[half:])))
        chunks.append(ChatChunk(usage=reply.usage(), finish_reason="tool_calls" if reply.calls else "stop"))
        self.open += 1
        try:
            if fault == "before":
                raise ServerError("503 before the first chunk")
            for i, chunk in enumerate(chunks):
                if i == min(at, len(chunks) - 1):
                    if fault == "mid" and i > 0:
                        raise ServerError("the connection dropped")
                    if fault == "stall":
                        await asyncio.sleep(LONG)
                await asyncio.sleep(0)
                yield chunk
            self.completed.add(reply)
        finally:
            self.open -= 1


@tool(read_only=True)
async def lookup(q: str) -> str:
    """Look something up."""
    await asyncio.sleep(0)
    return f"found {q}"


# -- stores -------------------------------------------------------------------------------------------


class FaultyStore:
    """A store whose get and set fail (``OSError``) or stall now and then, over another store."""

    sync = False

    def __init__(self, inner: Any, rng: random.Random, p: float, stall: float) -> None:
        self.inner, self.rng, self.p, self.stall = inner, rng, p, stall
        self.faults: list[str] = []

    async def _fault(self, op: str) -> None:
        r = self.rng.random()
        if r < self.p / 2:
            self.faults.append(f"{op}:raise")
            raise OSError(f"the store failed to {op}")
        if r < self.p:
            self.faults.append(f"{op}:stall")
            await asyncio.sleep(self.stall)

    async def get(self, key: str) -> Any:
        await self._fault("get")
        return await self.inner.get(key)

    async def set(self, key: str, events: Any, ttl: float | None) -> None:
        await self._fault("set")
        await self.inner.set(key, events, ttl)


async def stored_entries(kind: str, store: Any, where: Any) -> list[Any]:
    """Every entry the store holds, as events."""
    if kind == "memory":
        return [tuple(events) for events, _ in store._entries.values()]
    if kind == "sqlite":
        conn = sqlite3.connect(where)
        try:
            if not conn.execute("SELECT name FROM sqlite_master WHERE name = 'response_cache'").fetchall():
                return []
            rows = conn.execute("SELECT events FROM response_cache").fetchall()
        finally:
            conn.close()
        return [decode_events(row[0]) for row in rows]
    from redis.asyncio import Redis

    url, prefix = where
    client = Redis.from_url(url)
    try:
        out = []
        async for key in client.scan_iter(match=f"{prefix}:*"):
            data = await client.get(key)
            if data is not None:
                out.append(decode_events(data))
        return out
    finally:
        await client.aclose()


# -- reading a call's reply back from its events ------------------------------------------------------


def calls_of(events: list[Any]) -> list[tuple[Any, Any, Reply]]:
    """Each top-level model call: its start, its end, and the reply its events carry."""
    return [(start, end, Reply(thinking, text, calls)) for start, end, thinking, text, calls in model_calls(events)]


def shapes_of(events: list[Any]) -> list[tuple[tuple[str, Any], ...]]:
    """Each top-level model call's events in ``events``, as (type, delta) pairs: its stream's shape."""
    out: list[tuple[tuple[str, Any], ...]] = []
    call: list[tuple[str, Any]] | None = None
    for ev in events:
        if ev.source is not None:
            continue
        if type(ev) is ModelCallStart:
            call = []
        if call is not None:
            call.append((ev.type, getattr(ev, "delta", None)))
        if type(ev) is ModelCallEnd and call is not None:
            out.append(tuple(call))
            call = None
    return out


def balance(events: list[Any]) -> dict[str, int]:
    count: dict[str, int] = {}
    for e in events:
        for kind in ("text_block", "thinking_block", "tool_call", "tool_result", "model_call"):
            if e.type == f"{kind}_start":
                count[kind] = count.get(kind, 0) + 1
            elif e.type == f"{kind}_end":
                count[kind] = count.get(kind, 0) - 1
    return {k: n for k, n in count.items() if n}


# -- a case -------------------------------------------------------------------------------------------

LAYERS = ["retry", "fallback", "timeout", "hedge", "budget", "guardrail", "pii", "toolcache"]
TYPED = (ModelError, MiddlewareTermination, TimeoutError, AgentInterrupted)


@dataclass
class Case:
    seed: int
    rng: random.Random
    notes: list[str] = field(default_factory=list)
    completed: set[Reply] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=dict)
    closers: list[Any] = field(default_factory=list)


def layer(kind: str, rng: random.Random, backup: Any, timeout: dict[str, float]) -> Any:
    if kind == "retry":
        return RetryMiddleware(rng.randint(1, 2), initial_delay=0.001, jitter=False, sleep=_no_sleep,
                               **rng.choice([{}, {"buffer": True}, {"after_first_event": True},
                                             {"on_failure": "continue"}]))
    if kind == "fallback":
        return ModelFallbackMiddleware(backup)
    if kind == "timeout":
        return TimeoutMiddleware(**timeout)
    if kind == "hedge":
        return HedgeMiddleware(None, after=0.005)
    if kind == "budget":
        return BudgetMiddleware(run_tokens=rng.choice([40, 200, 10_000]), session_tokens=10**6,
                                on_exceeded=rng.choice(["stop", "error"]))
    if kind == "guardrail":
        checks = rng.choice([{"stream": _no_forbidden}, {"output": _no_forbidden}, {"stream": _no_forbidden_async}])
        return GuardrailMiddleware(**checks, exit_behavior=rng.choice(["end", "error"]),
                                   refusal=rng.choice([None, REFUSAL]), blocking=rng.random() < 0.5)
    if kind == "toolcache":
        return ToolResultCacheMiddleware(rng.choice([None, InMemoryCacheStore(8)]))
    if kind == "pii":
        return PIIRedactionMiddleware("email", strategy=rng.choice(["redact", "redact", "block"]))
    raise AssertionError(kind)


def timeout_of(rng: random.Random) -> dict[str, float]:
    return rng.choice([{"first_event_timeout": 0.1}, {"model_timeout": 0.3}])


def _no_forbidden(check: Any) -> str | None:
    return "says the word" if FORBIDDEN in check.text else None


async def _no_forbidden_async(check: Any) -> str | None:
    await asyncio.sleep(0)
    return _no_forbidden(check)


async def _no_sleep(seconds: float) -> None:
    await asyncio.sleep(0)


def expected(reply: Reply, pii: bool) -> Reply:
    if not pii:
        return reply
    return Reply(reply.thinking.replace(EMAIL, "[REDACTED_EMAIL]"), reply.text.replace(EMAIL, "[REDACTED_EMAIL]"),
                 reply.calls)


async def run_case(seed: int, tmp: Path, redis: tuple[str, str] | None) -> None:
    rng = random.Random(seed)
    case = Case(seed, rng)
    kinds = ["memory", "sqlite"] + (["redis"] if redis is not None else [])
    store_kind = rng.choice(kinds)
    layers = [k for k in LAYERS if rng.random() < 0.35] if rng.random() < 0.8 else []  # (alone: a call read unseen)
    cache_at = rng.randint(0, len(layers))
    stack_kinds = [*layers[:cache_at], "cache", *layers[cache_at:]]
    rng.shuffle(stack_kinds) if rng.random() < 0.5 else None
    cache_at = stack_kinds.index("cache")
    outside = set(stack_kinds[:cache_at])
    timeout_outside = "timeout" in outside
    faulty = rng.random() < 0.3
    interrupted_only = faulty and rng.random() < 0.3  # a long stall that only the runs' interrupts end
    stall = LONG if faulty and (interrupted_only or (timeout_outside and rng.random() < 0.5)) else 0.01
    timeout = timeout_of(rng) if "timeout" in stack_kinds else {}
    model_faults = Faults(rng, rng.choice([0.0, 0.2, 0.4]),
                          stall=None if not timeout else "first" if "first_event_timeout" in timeout else "any")
    n_agents = rng.choice([1, 1, 2])
    case.notes.append(f"store {store_kind}{f' (faulty, stall {stall})' if faulty else ''}, agents {n_agents}, "
                      f"stack (outermost first) {stack_kinds}, model faults p={model_faults.p}")
    base: Any
    where: Any = None
    if store_kind == "memory":
        base = InMemoryCacheStore(64)
    elif store_kind == "sqlite":
        where = str(tmp / f"cache{seed}.db")
        base = SqliteCacheStore(where)
        case.closers.append(base)
    else:
        assert redis is not None
        where = (redis[0], f"{redis[1]}:cache{seed}")
        base = RedisCacheStore(redis[0], prefix=where[1])
        case.closers.append(base)
    store = FaultyStore(base, rng, 0.3, stall) if faulty else base
    pii_present = "pii" in stack_kinds
    guardrail_present = "guardrail" in stack_kinds
    agents = []
    models = []
    caches = []
    for a in range(n_agents):
        model = PropModel("m", model_faults, case.completed, case.counts)
        backup = PropModel("backup", model_faults, case.completed, case.counts)
        models += [model, backup]
        # Two agents: two caches (two processes, say) over one SQLite file or Redis prefix, or
        # one in-memory store.
        mws = []
        layer_rng = random.Random(f"{seed}/layers")
        for kind in stack_kinds:
            if kind == "cache":
                cache = ResponseCacheMiddleware(
                    store if store_kind == "memory" or a == 0 or faulty else
                    SqliteCacheStore(where) if store_kind == "sqlite" else RedisCacheStore(redis[0], prefix=where[1]),
                    ttl=rng.choice([None, 60.0]))
                if cache.store is not store:
                    case.closers.append(cache.store)
                caches.append(cache)
                mws.append(cache)
            else:
                mws.append(layer(kind, layer_rng, backup, timeout))
        agents.append(ReActAgent.builder().name(f"a{a}").model(model).tools(lookup).max_iters(3)
                      .middlewares(mws).build())
    n_runs = rng.randint(2, 7)
    questions = [f"Q{rng.randint(0, 2)}" for _ in range(n_runs)]
    modes = [rng.choice(["call", "stream", "stream", "leave", "interrupt"]) for _ in range(n_runs)]
    if interrupted_only:
        modes = ["interrupt"] * n_runs
    which = [rng.randrange(n_agents) for _ in range(n_runs)]
    # (A run waiting for its session behind another is not running yet: an interrupt then passes it by.)
    sessions = [f"s{i}" if interrupted_only or rng.random() < 0.8 else "shared" for i in range(n_runs)]
    leave_at = [rng.randint(1, 20) for _ in range(n_runs)]
    case.notes.append(f"runs: {list(zip(which, questions, modes, sessions, strict=True))}")
    outcomes: list[str] = [""] * n_runs
    seen: list[list[Any]] = [[] for _ in range(n_runs)]

    async def one(i: int) -> None:
        agent = agents[which[i]]
        ctx = RuntimeContext(user_id="u", session_id=f"{sessions[i]}-a{which[i]}")
        try:
            if modes[i] == "call":
                msg = await agent.call(questions[i], ctx=ctx)
                outcomes[i] = f"done:{msg.generate_reason}"
                seen[i].append(msg)
                return
            if modes[i] == "interrupt":
                asyncio.get_running_loop().call_later(rng.random() * 0.02, agent.interrupt, "u", ctx.session_id)
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

    try:
        async with asyncio.timeout(20):
            i = 0
            while i < n_runs:  # waves of runs at once (identical requests among them)
                k = rng.randint(1, 3)
                await asyncio.gather(*(one(j) for j in range(i, min(n_runs, i + k))))
                i += k
            await asyncio.sleep(0.01)  # the hedges' cancelled attempts end
        budget = "outside" if "budget" in outside else "inside" if "budget" in stack_kinds else None
        check_case(case, outcomes, seen, modes, pii_present, guardrail_present, budget)
        entries = await stored_entries(store_kind, base, where)
        for events in entries:
            problem = whole_reply(events)
            assert problem is None, f"a stored entry is not a whole reply: {problem}: {[e.type for e in events]}"
            (_, _, reply), = calls_of(list(events))
            want = {expected(r, pii_present and "pii" not in outside) for r in case.completed}
            assert reply in want, f"a stored reply the model never completed: {reply}"
            if guardrail_present and "guardrail" not in outside:
                assert FORBIDDEN not in reply.text, f"a reply the guardrail blocked was stored: {reply}"
        want = {expected(r, pii_present) for r in case.completed}
        for agent, i in ((agents[w], j) for j, w in enumerate(which)):
            if modes[i] in ("stream", "call") and sessions[i] != "shared" and outcomes[i].startswith("done"):
                await check_session(agent, f"{sessions[i]}-a{which[i]}", seen[i], modes[i], want)
            if (modes[i] == "stream" and outcomes[i] == "done:model_stop"
                    and not {"hedge", "retry", "fallback"} & set(stack_kinds)):
                ends = [end for _, end, _ in calls_of(seen[i])]
                result = next(e.result for e in seen[i] if isinstance(e, AgentResult))
                if all(end.error is None and not end.discarded for end in ends):
                    total = sum((end.usage or ChatUsage() for end in ends), ChatUsage())
                    assert result.usage == total, f"run {i}: the reply's usage {result.usage}, the calls' {total}"
                    if "budget" in stack_kinds and sessions[i] != "shared":  # a hit is charged nothing
                        loaded = await agents[which[i]].state_store.load("u", f"{sessions[i]}-a{which[i]}")
                        assert loaded is not None
                        charged = loaded[0].metadata.get("budget", {}).get("tokens", 0)  # (inside: only misses)
                        assert charged == total.input_tokens + total.output_tokens, \
                            f"run {i}: the budget charged {charged}, the calls reported {total}"
        assert all(m.open == 0 for m in models), f"model streams left open: {[m.open for m in models]}"
    except BaseException as exc:
        notes = "\n".join(case.notes)
        faults = store.faults if faulty else []
        raise AssertionError(f"CACHE_SEED={seed}: {exc!r}\n{notes}\noutcomes: {outcomes}\n"
                             f"store faults: {faults}\nhits/misses: {[(c.hits, c.misses) for c in caches]}") from exc
    finally:
        for closer in case.closers:
            await closer.close()


def check_case(case: Case, outcomes: list[str], seen: list[list[Any]], modes: list[str], pii: bool,
               guardrail: bool, budget: str | None) -> None:
    want = {expected(r, pii) for r in case.completed}
    texts = {r.text for r in want} | {REFUSAL}
    missed: dict[Reply, set[Any]] = {}  # the shapes of the streams of the misses, by reply
    for i in range(len(outcomes)):
        if modes[i] != "call":
            for (start, end, reply), shape in zip(calls_of(seen[i]), shapes_of(seen[i]), strict=True):
                if start.metadata.get("cache") != "hit" and end.error is None and not end.discarded:
                    missed.setdefault(reply, set()).add(shape)
    for i, outcome in enumerate(outcomes):
        assert outcome, f"run {i} ended with no result and no error"
        events = seen[i]
        if modes[i] == "call":
            if outcome == "done:model_stop":  # (a run that answered: the last reply's text)
                text = events[-1].text
                assert text in texts or text.startswith("The model call failed"), \
                    f"run {i}: call() answered {text!r}, which the model never completed"
                if guardrail:
                    assert FORBIDDEN not in text, f"run {i}: call() answered past the guardrail: {text!r}"
            continue
        if outcome == "left":
            continue
        assert not balance(events), f"run {i}: unbalanced {balance(events)}: {[e.type for e in events]}"
        rids = {e.reply_id for e in events if e.source is None and getattr(e, "reply_id", None) is not None}
        assert len(rids) == 1, f"run {i}: events of several reply ids {rids}"
        ids = [e.id for e in events]
        assert len(ids) == len(set(ids)), f"run {i}: an event id twice"
        blocks = [e.block_id for e in events if e.type.endswith("_block_start")]
        assert len(blocks) == len(set(blocks)), f"run {i}: a block id twice: {blocks}"
        for (start, end, reply), shape in zip(calls_of(events), shapes_of(events), strict=True):
            hit = start.metadata.get("cache") == "hit"
            if end.error is not None or end.discarded:
                # (A hit cut short — an interrupt, a layer outside failing — is ended by the
                # runtime's closing guarantee, not replayed: its End carries no mark.)
                assert not hit or end.metadata.get("cache") is None, f"run {i}: a replayed hit failed"
                continue
            assert (end.metadata.get("cache") == "hit") == hit, f"run {i}: a hit's brackets marked apart"
            assert reply in want, f"run {i}: {'a hit' if hit else 'a call'} carried a reply never completed: " \
                                  f"{reply}\ncompleted: {want}"
            if guardrail:
                assert FORBIDDEN not in reply.text, f"run {i}: a reply past the guardrail: {reply}"
            raw = next(r for r in case.completed if expected(r, pii) == reply)
            if hit:
                assert end.usage == ChatUsage(), f"run {i}: a hit reported usage {end.usage}"
                assert reply not in missed or shape in missed[reply], \
                    f"run {i}: a hit streamed {shape}, the misses of its reply {missed[reply]}"
                assert end.metadata.get("cached_usage") == raw.usage().model_dump(), \
                    f"run {i}: a hit's cached_usage {end.metadata.get('cached_usage')}"
                note = end.metadata.get("budget")
                if budget == "outside":  # a hit spends nothing: the budget outside charges it nothing
                    assert note is not None and note["call"]["tokens"] == 0, f"run {i}: a hit charged {note}"
                else:  # the budget inside never saw the hit, and the recorded call's note is not replayed
                    assert note is None, f"run {i}: a hit carries a budget note {note}"
            else:
                assert end.usage == raw.usage(), f"run {i}: a miss's usage {end.usage}"


async def check_session(agent: ReActAgent, session: str, seen: list[Any], mode: str, want: set[Reply]) -> None:
    """A run that ended with its result: the session's last message is the reply the caller got."""
    loaded = await agent.state_store.load("u", session)
    assert loaded is not None
    state = loaded[0]
    result = seen[-1] if mode == "call" else next(e.result for e in reversed(seen) if isinstance(e, AgentResult))
    last = state.context[-1]
    assert (last.role, last.text) == (result.role, result.text), \
        f"session {session}: kept {last.role}:{last.text!r}, the caller got {result.role}:{result.text!r}"
    kept = [(m.text, tuple((c.name, c.input) for c in m.tool_calls)) for m in state.context if m.role == "assistant"]
    if mode == "stream" and result.generate_reason == "model_stop":
        # The turn kept: each assistant message is a reply the caller saw go out whole.
        shown = [(reply.text, tuple((name, json.loads(args)) for name, args in reply.calls))
                 for _, end, reply in calls_of(seen) if not end.discarded]
        assert kept == shown, f"session {session}: kept {kept}, the caller saw {shown}"
    if mode == "call" and result.generate_reason == "model_stop":
        # Each assistant message kept is a reply the model made (a hit handed as parts included).
        made = [(r.text, tuple((name, json.loads(args)) for name, args in r.calls)) for r in want]
        for text, calls in kept:
            assert (text, calls) in made or text.startswith("The model call failed") or text == REFUSAL, \
                f"session {session}: kept {(text, calls)}, which the model never made"


@pytest.mark.parametrize("seed", range(SEED, SEED + CASES))
async def test_the_response_cache_under_random_faults(seed: int, tmp_path: Path, request: Any) -> None:
    redis = None
    if os.environ.get("REDIS_URL"):
        redis = (os.environ["REDIS_URL"], request.getfixturevalue("redis_prefix"))
    async with nothing_left(f"CACHE_SEED={seed}"):
        await run_case(seed, tmp_path, redis)



# -- the escapes the property found, each alone ------------------------------------------------------


class StallingStore:
    """An async store whose ``get`` or ``set`` never answers (a hung connection); ``waiting`` is
    set when one of them starts to wait."""

    sync = False

    def __init__(self, stall_get: bool, stall_set: bool) -> None:
        self.stall_get, self.stall_set = stall_get, stall_set
        self.inner = InMemoryCacheStore()
        self.waiting = asyncio.Event()

    async def _stall(self) -> None:
        self.waiting.set()
        await asyncio.sleep(3600)

    async def get(self, key: str) -> Any:
        if self.stall_get:
            await self._stall()
        return await self.inner.get(key)

    async def set(self, key: str, events: Any, ttl: float | None) -> None:
        if self.stall_set:
            await self._stall()
        await self.inner.set(key, events, ttl)


def scripted_agent(store: Any, *outer: Any) -> tuple[ReActAgent, Any]:
    from agentscope_py import ModelStep, ScriptedModel

    model = ScriptedModel([ModelStep.text("the answer", chunks=2)] * 3, name="m")
    agent = ReActAgent.builder().model(model).middlewares([*outer, ResponseCacheMiddleware(store)]).build()
    return agent, model


@pytest.mark.parametrize("stall", ["get", "set"])
async def test_a_stalled_store_is_given_up_at_the_deadline_of_a_timeout_outside(stall: str) -> None:
    # The deadline of a TimeoutMiddleware outside the cache travels inward on the record, kept by
    # the model call around its reads: the cache's wait for its store is no read of the model's,
    # so a store that never answered held the call (and the run) for good. The deadline holds
    # across the read and the call: a read given up at it leaves the model no time, and the call
    # is the model's timeout, without a request.
    store = StallingStore(stall == "get", stall == "set")
    agent, model = scripted_agent(store, TimeoutMiddleware(model_timeout=0.2))
    async with asyncio.timeout(5):
        if stall == "get":
            with pytest.raises(ModelTimeoutError, match=r"did not finish within 0\.2 s"):
                await agent.call("hi")
            assert model.requests == [] and len(store.inner) == 0
            return
        reply = await agent.call("hi")
    assert reply.text == "the answer" and len(model.requests) == 1
    assert len(store.inner) == 0  # a write given up: nothing stored


async def test_an_interrupt_ends_a_stalled_store_write() -> None:
    # The write waits through the run's wait, as the read does: the stream ends only after it.
    store = StallingStore(False, True)
    agent, _ = scripted_agent(store)
    ctx = RuntimeContext(user_id="u", session_id="w")
    running = asyncio.create_task(agent.stream("hi", ctx=ctx).to_list())
    async with asyncio.timeout(5):
        await store.waiting.wait()
        agent.interrupt("u", "w")
        events = await running
    result = next(e.result for e in events if isinstance(e, AgentResult))
    assert result.generate_reason == "interrupted" and not balance(events)
    assert [e.type for e in events if e.type.startswith("model_call")] == ["model_call_start", "model_call_end"]


@pytest.mark.parametrize("stall", ["get", "set"])
async def test_a_stalled_tool_cache_store_is_given_up_at_the_tool_deadline(stall: str) -> None:
    from agentscope_py import ModelStep, ScriptedModel
    from agentscope_py.middleware import ToolResultCacheMiddleware

    store = StallingStore(stall == "get", stall == "set")
    model = ScriptedModel([ModelStep.tool_call("lookup", {"q": "x"}), ModelStep.text("done")], name="m")
    agent = (ReActAgent.builder().model(model).tools(lookup)
             .middlewares([TimeoutMiddleware(tool_timeout=0.2), ToolResultCacheMiddleware(store)]).build())
    async with asyncio.timeout(5):
        events = await agent.stream("hi").to_list()
    assert events[-2].result.text == "done" and len(store.inner) == 0
    ends = [e.state.value for e in events if e.type == "tool_result_end"]
    if stall == "set":  # the call ran (and the write after it was given up)
        assert ends == ["success"]
    else:  # the read used the call's deadline up: it timed out before it started, as a tool would
        text = "".join(e.delta for e in events if e.type == "tool_result_text_delta")
        assert ends == ["error"] and text.startswith("Error: lookup timed out after 0.2 s (TimeoutMiddleware; its ")


async def test_a_background_check_cut_before_it_ran_leaves_no_coroutine_never_awaited() -> None:
    # A non-blocking async stream check is a task judging the check's coroutine; the consumer
    # leaving at the delta that made it due cancels that task before its first step.
    from agentscope_py import ModelStep, ScriptedModel

    model = ScriptedModel([ModelStep.text("one two three", chunks=3)], name="m")
    agent = ReActAgent.builder().model(model).middleware(GuardrailMiddleware(stream=_no_forbidden_async)).build()
    gc.collect()  # an earlier test's garbage is not this test's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        it = agent.stream("hi").__aiter__()
        async for ev in it:
            if ev.type == "text_block_delta":
                break
        await aclose(it)
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]
