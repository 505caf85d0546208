"""What the built-ins keep in stores a user may share or edit — a cache's entries, a budget's
totals (the session's in its state, the user's in a `BudgetStore`), a call limit's counts — read
back bad: cut short, of the wrong JSON types, with fields missing or unknown, from another
version, hand-edited. A run then either ignores the entry (a cache: a miss with a warning, and the
miss writes over it) or fails with `StateStoreError` naming the session or key and what to do;
never a bare TypeError / KeyError / ValidationError, never a limit read as zero.

``STORE_CASES`` (default 40) and ``STORE_SEED`` (default: fixed) set the random part."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import ModelStep, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.agent import InMemoryStateStore
from agentscope_py.errors import BudgetExceeded, StateStoreError
from agentscope_py.middleware import (
    BudgetMiddleware,
    ModelCallLimitMiddleware,
    RedisBudgetStore,
    RedisCacheStore,
    ResponseCacheMiddleware,
    SqliteCacheStore,
)
from agentscope_py.middleware.limits.budget_stores import Spend

pytestmark = pytest.mark.timeout(60)

CASES = int(os.environ.get("STORE_CASES", "40"))
SEED = int(os.environ.get("STORE_SEED", "20261207"))

_BAD_VALUES: list[Any] = [None, "x", "12", -1, 1.5, float("inf"), [], {}, True, "\ud800", 10**30, "1e400"]


def _corrupt_json(rng: random.Random, value: Any) -> Any:
    """``value`` (JSON data) spoiled one random way."""
    how = rng.choice(["type", "drop", "unknown", "replace", "nest"])
    if how == "replace" or not isinstance(value, dict | list) or not value:
        return rng.choice(_BAD_VALUES)
    if isinstance(value, list):
        out = list(value)
        i = rng.randrange(len(out))
        if how == "drop":
            del out[i]
        else:
            out[i] = _corrupt_json(rng, out[i])
        return out
    out_d = dict(value)
    k = rng.choice(sorted(out_d))
    if how == "drop":
        del out_d[k]
    elif how == "unknown":
        out_d["schema_version"] = rng.choice([0, 2, 99, "v9"])
    else:
        out_d[k] = _corrupt_json(rng, out_d[k]) if how == "nest" else rng.choice(_BAD_VALUES)
    return out_d


def _text_cut(rng: random.Random, text: str) -> str:
    return text[: rng.randrange(len(text))] if rng.random() < 0.5 else json.dumps(_corrupt_json(rng, json.loads(text)))


# -- a session's counts ---------------------------------------------------------------------------


async def _session_case(rng: random.Random) -> str:
    kind = rng.choice(["budget", "calls"])
    mw = (BudgetMiddleware(session_tokens=10**6) if kind == "budget" else ModelCallLimitMiddleware(thread_limit=50))
    key = "budget" if kind == "budget" else "call_limits"
    store = InMemoryStateStore()
    agent = (ReActAgent.builder().model(ScriptedModel([ModelStep.text("a"), ModelStep.text("b")]))
             .state_store(store).middlewares([mw]).build())
    await agent.call("hi", ctx=RuntimeContext(user_id="u", session_id="s"))
    state, version = await store.load("u", "s")
    assert state is not None
    bad = _corrupt_json(rng, state.metadata[key])
    state.metadata[key] = bad
    await store.save("u", "s", state, version)
    try:
        await agent.call("again", ctx=RuntimeContext(user_id="u", session_id="s"))
    except StateStoreError as exc:
        assert "u/s" in str(exc) and repr(key) in str(exc), exc
        after, _ = await store.load("u", "s")
        assert after is not None and after.metadata[key] == bad  # left as it is: the error persists
        return "refused"
    after, _ = await store.load("u", "s")
    assert after is not None
    counts = after.metadata[key]  # accepted: only what is one (an unknown key beside the counts)
    assert isinstance(counts, dict)
    return "accepted"


@pytest.mark.timeout(20)
async def test_bad_session_counts_are_refused_with_a_typed_error_or_read_right() -> None:
    rng = random.Random(SEED)
    seen = [await _session_case(random.Random(rng.random())) for _ in range(CASES)]
    assert "refused" in seen


async def _spoiled_session(middleware: Any, key: str, bad: Any) -> tuple[ReActAgent, InMemoryStateStore]:
    """An agent whose session u/s ran one turn, then had ``metadata[key]`` set to ``bad``."""
    store = InMemoryStateStore()
    agent = (ReActAgent.builder().model(ScriptedModel([ModelStep.text("a"), ModelStep.text("b")]))
             .state_store(store).middlewares([middleware]).build())
    await agent.call("hi", ctx=RuntimeContext(user_id="u", session_id="s"))
    state, version = await store.load("u", "s")
    assert state is not None
    state.metadata[key] = bad
    await store.save("u", "s", state, version)
    return agent, store


@pytest.mark.parametrize("bad", [{"tokens": "x"}, {"cost": 1}, [], {"tokens": None, "cost": 0, "calls": 0}])
async def test_session_budget_totals_that_are_not_totals_are_a_state_store_error(bad: Any) -> None:
    agent, _ = await _spoiled_session(BudgetMiddleware(session_tokens=100), "budget", bad)
    with pytest.raises(StateStoreError, match=r"session u/s: .*metadata\['budget'\]"):
        await agent.call("again", ctx=RuntimeContext(user_id="u", session_id="s"))


async def test_a_stored_null_for_the_call_counts_is_no_count_yet_and_the_next_save_repairs_it() -> None:
    agent, store = await _spoiled_session(ModelCallLimitMiddleware(thread_limit=5), "call_limits", None)
    await agent.call("again", ctx=RuntimeContext(user_id="u", session_id="s"))
    state, _ = await store.load("u", "s")
    assert state is not None and state.metadata["call_limits"] == {"model": 1}


@pytest.mark.parametrize("bad", [[], "x", {"model": "abc"}, {"model": None}])
async def test_session_call_counts_that_are_not_counts_are_a_state_store_error(bad: Any) -> None:
    agent, _ = await _spoiled_session(ModelCallLimitMiddleware(thread_limit=5), "call_limits", bad)
    with pytest.raises(StateStoreError, match=r"session u/s: .*metadata\['call_limits'\]"):
        await agent.call("again", ctx=RuntimeContext(user_id="u", session_id="s"))


# -- cache entries --------------------------------------------------------------------------------


async def _cache_case(rng: random.Random, path: Path, caplog: pytest.LogCaptureFixture) -> str:
    store = SqliteCacheStore(path)
    try:
        first = (ReActAgent.builder().model(ScriptedModel([ModelStep.text("first")]))
                 .middlewares([ResponseCacheMiddleware(store)]).build())
        await first.call("hi", ctx=RuntimeContext(session_id="a"))
        with sqlite3.connect(path) as conn:
            ((events,),) = conn.execute("SELECT events FROM response_cache").fetchall()
            spoiled = _text_cut(rng, events)
            conn.execute("UPDATE response_cache SET events = ?", (spoiled,))
        cache = ResponseCacheMiddleware(store)
        second = (ReActAgent.builder().model(ScriptedModel([ModelStep.text("second"), ModelStep.text("third")]))
                  .middlewares([cache]).build())
        caplog.clear()
        with caplog.at_level(logging.WARNING, "agentscope_py.middleware.cache"):
            msg = await second.call("hi", ctx=RuntimeContext(session_id="b"))
        if cache.hits:  # a whole reply (a block's events dropped by hand, an unknown field): replayed as stored
            return "hit"
        assert msg.text == "second" and any("calling inward" in r.getMessage() for r in caplog.records)
        again = await second.call("hi", ctx=RuntimeContext(session_id="c"))  # the miss wrote over it
        assert again.text == "second" and cache.hits == 1
        return "miss"
    finally:
        await store.close()


@pytest.mark.timeout(30)
async def test_a_spoiled_cache_entry_is_a_miss_that_the_next_write_repairs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(SEED + 1)
    seen = [await _cache_case(random.Random(rng.random()), tmp_path / f"c{i}.db", caplog)
            for i in range(max(1, CASES // 2))]
    assert "miss" in seen


@pytest.mark.parametrize("cut", ["[]", "drop_end", "drop_start", "error_end", "twice"])
async def test_a_stored_entry_that_is_not_one_whole_reply_is_never_replayed(tmp_path: Path, cut: str) -> None:
    store = SqliteCacheStore(tmp_path / "c.db")
    try:
        first = (ReActAgent.builder().model(ScriptedModel([ModelStep.text("first")]))
                 .middlewares([ResponseCacheMiddleware(store)]).build())
        await first.call("hi", ctx=RuntimeContext(session_id="a"))
        with sqlite3.connect(tmp_path / "c.db") as conn:
            ((text,),) = conn.execute("SELECT events FROM response_cache").fetchall()
            evs = json.loads(text)
            spoiled = {"[]": [], "drop_end": evs[:-1], "drop_start": evs[1:], "twice": evs + evs,
                       "error_end": [*evs[:-1], {**evs[-1], "error": "boom"}]}[cut]
            conn.execute("UPDATE response_cache SET events = ?", (json.dumps(spoiled),))
        cache = ResponseCacheMiddleware(store)
        second = (ReActAgent.builder().model(ScriptedModel([ModelStep.text("second")]))
                  .middlewares([cache]).build())
        msg = await second.call("hi", ctx=RuntimeContext(session_id="b"))
        assert (msg.text, cache.hits, cache.misses) == ("second", 0, 1)
    finally:
        await store.close()


# -- a user's totals in Redis ---------------------------------------------------------------------


@pytest.mark.parametrize("fields", [{"tokens": "abc"}, {"cost": "x"}, {"calls": "x"}, {"tokens": "5.5"},
                                    {"tokens": "1e400"}])
async def test_redis_budget_totals_that_are_not_numbers_are_a_state_store_error(
        redis_url: str, redis_prefix: str, fields: dict[str, str]) -> None:
    from redis.asyncio import Redis

    client = Redis.from_url(redis_url)
    await client.hset(f"{redis_prefix}:u", mapping=fields)
    store = RedisBudgetStore(redis_url, prefix=redis_prefix)
    model = ScriptedModel([ModelStep.text("a")])
    agent = ReActAgent.builder().model(model).middlewares([BudgetMiddleware(user_tokens=10**6, store=store)]).build()
    try:
        with pytest.raises(StateStoreError, match=f"Redis key '{redis_prefix}:u' holds {next(iter(fields))}="):
            await agent.call("hi", ctx=RuntimeContext(user_id="u", session_id="s"))
        assert not any(k.startswith(b"hold:") for k in await client.hkeys(f"{redis_prefix}:u"))
        with pytest.raises(StateStoreError, match="not a number"):
            await store.get("u")
    finally:
        await store.close()
        await client.aclose()


@pytest.mark.parametrize("hold", ["garbage", "1 2", "x y z"])
async def test_a_redis_hold_that_cannot_be_read_is_dropped_like_an_expired_one(
        redis_url: str, redis_prefix: str, hold: str) -> None:
    from redis.asyncio import Redis

    client = Redis.from_url(redis_url)
    await client.hset(f"{redis_prefix}:u", mapping={"hold:old": hold})
    store = RedisBudgetStore(redis_url, prefix=redis_prefix)
    agent = (ReActAgent.builder().model(ScriptedModel([ModelStep.text("a")]))
             .middlewares([BudgetMiddleware(user_tokens=10**6, store=store)]).build())
    try:
        msg = await agent.call("hi", ctx=RuntimeContext(user_id="u", session_id="s"))
        assert msg.text == "a"
        assert await client.hkeys(f"{redis_prefix}:u") != [] and not await client.hexists(f"{redis_prefix}:u",
                                                                                          "hold:old")
    finally:
        await store.close()
        await client.aclose()


# -- a shared budget under parallel calls ---------------------------------------------------------


@pytest.mark.timeout(30)
async def test_parallel_runs_on_one_redis_budget_never_spend_past_its_limit(redis_url: str, redis_prefix: str) -> None:
    rng = random.Random(SEED + 2)
    store = RedisBudgetStore(redis_url, prefix=redis_prefix)
    limit = 300
    try:
        async def one(i: int) -> str:
            text = "x" * rng.randint(10, 200)
            agent = (ReActAgent.builder().model(ScriptedModel([ModelStep.text(text)]))
                     .middlewares([BudgetMiddleware(user_tokens=limit, store=store, on_exceeded="error")]).build())
            try:
                await agent.call("hi " * rng.randint(1, 30), ctx=RuntimeContext(user_id="u", session_id=f"s{i}"))
            except BudgetExceeded:
                return "refused"
            return "ran"

        outcomes = await asyncio.gather(*(one(i) for i in range(max(8, CASES // 2))))
        spent = await store.get("u")
        assert "refused" in outcomes and spent.tokens <= limit, (outcomes, spent)  # (a call cut short counts)
        assert not [k for k in await store._client().hkeys(f"{redis_prefix}:u") if k.startswith(b"hold:")]
    finally:
        await store.close()


# -- session states -------------------------------------------------------------------------------


async def _state_case(rng: random.Random, kind: str, tmp_path: Path, redis_url: str | None, prefix: str) -> str:
    from agentscope_py.agent import RedisStateStore, SqliteStateStore

    store: Any = (SqliteStateStore(tmp_path / f"s{rng.random()}.db") if kind == "sqlite"
                  else RedisStateStore(redis_url, prefix=prefix))
    ctx = {"user_id": "u", "session_id": f"s{rng.randrange(10**9)}"}

    def agent(text: str) -> ReActAgent:
        return (ReActAgent.builder().model(ScriptedModel([ModelStep.text(text)])).state_store(store)
                .middlewares([BudgetMiddleware(session_tokens=10**6), ModelCallLimitMiddleware(thread_limit=50)])
                .build())

    try:
        await agent("one").call("first", ctx=RuntimeContext(**ctx))
        if kind == "sqlite":
            with sqlite3.connect(store.path) as conn:
                ((data,),) = conn.execute("SELECT state FROM agent_state").fetchall()
                spoiled = _text_cut(rng, data)
                conn.execute("UPDATE agent_state SET state = ?", (spoiled,))
        else:
            from redis.asyncio import Redis

            client = Redis.from_url(redis_url)
            key = store._key("state", ctx["user_id"], ctx["session_id"])
            spoiled = _text_cut(rng, (await client.hget(key, "state")).decode())
            await client.hset(key, "state", spoiled.encode("utf-8", "surrogatepass"))
            await client.aclose()
        try:
            await agent("two").call("second", ctx=RuntimeContext(**ctx))
        except StateStoreError as exc:
            assert f"{ctx['user_id']}/{ctx['session_id']}" in str(exc), exc
            return "refused"
        await agent("three").call("third", ctx=RuntimeContext(**ctx))  # no later turn lost
        state, _ = await store.load(ctx["user_id"], ctx["session_id"])
        assert state is not None  # (the replies may be a budget's stop: a huge count read back is a count)
        assert [m.text for m in state.context if m.role == "user"][-2:] == ["second", "third"]
        return "read"
    finally:
        await store.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_a_spoiled_session_state_is_a_state_store_error_naming_it_or_reads_right(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("redis_url") if kind == "redis" else None
    prefix = request.getfixturevalue("redis_prefix") if kind == "redis" else ""
    rng = random.Random(SEED + 3)
    seen = [await _state_case(random.Random(rng.random()), kind, tmp_path, url, prefix)
            for _ in range(max(1, CASES // 2))]
    assert "refused" in seen


async def test_a_lone_surrogate_in_a_stored_entry_is_replaced_so_the_session_still_saves(tmp_path: Path) -> None:
    from agentscope_py.agent import SqliteStateStore

    cache, sessions = SqliteCacheStore(tmp_path / "c.db"), SqliteStateStore(tmp_path / "s.db")
    try:
        first = (ReActAgent.builder().model(ScriptedModel([ModelStep.text("first 😀")]))
                 .middlewares([ResponseCacheMiddleware(cache)]).build())
        await first.call("hi", ctx=RuntimeContext(session_id="a"))
        with sqlite3.connect(tmp_path / "c.db") as conn:
            ((text,),) = conn.execute("SELECT events FROM response_cache").fetchall()
            conn.execute("UPDATE response_cache SET events = ?", (text.replace("first", "\\ud800first"),))
        second = (ReActAgent.builder().model(ScriptedModel([ModelStep.text("second")])).state_store(sessions)
                  .middlewares([ResponseCacheMiddleware(cache)]).build())
        msg = await second.call("hi", ctx=RuntimeContext(session_id="b"))
        assert msg.text == "\ufffdfirst 😀"
        state, _ = await sessions.load("default", "b")
        assert state is not None and state.context[-1].text == "\ufffdfirst 😀"
    finally:
        await cache.close()
        await sessions.close()


# -- a Redis that drops its connections mid-operation ---------------------------------------------


@pytest.mark.timeout(60)
async def test_redis_connections_cut_mid_operation_give_typed_errors_and_leave_no_hold_or_lock(
        redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """Every connection to Redis dropped once a random number of bytes went out (mid-command,
    between the lock, the cache read and write, the budget's reserve and settle, the save): each
    run ends well or with `StateStoreError`; no hold outlives its call, the session's lock is free
    for the next run, and every turn that ended well is in the session."""
    from urllib.parse import urlparse

    from agentscope_py.agent import RedisStateStore

    from .cut_proxy import CutProxy

    target = urlparse(redis_url)
    proxy = CutProxy(target.hostname or "127.0.0.1", target.port or 6379)
    url = f"redis://127.0.0.1:{await proxy.start()}{target.path}"
    budget = RedisBudgetStore(url, prefix=f"{redis_prefix}:b", socket_timeout=5)
    cache = RedisCacheStore(url, prefix=f"{redis_prefix}:c", socket_timeout=5)
    sessions = RedisStateStore(url, prefix=f"{redis_prefix}:s", socket_timeout=5)
    rng = random.Random(SEED + 4)
    runs = max(6, CASES)
    agent = (ReActAgent.builder().model(ScriptedModel([ModelStep.text(f"r{i}") for i in range(2 * runs + 2)]))
             .state_store(sessions)
             .middlewares([ResponseCacheMiddleware(cache), BudgetMiddleware(user_tokens=10**9, store=budget)]).build())
    ok: list[str] = []
    try:
        with caplog.at_level(logging.CRITICAL):
            for i in range(runs):
                proxy.left = rng.randint(1, 2500) if rng.random() < 0.6 else None
                try:
                    await agent.call(f"q{i}", ctx=RuntimeContext(user_id="u", session_id="s"))
                    ok.append(f"q{i}")
                except StateStoreError:
                    pass
                assert await budget.held("u") == (0, 0.0), i  # (proxy.left is spent or None by now)
            proxy.left = None
            await agent.call("last", ctx=RuntimeContext(user_id="u", session_id="s"))
        assert proxy.cuts > 0
        state, _ = await sessions.load("u", "s")
        assert state is not None
        users = [m.text for m in state.context if m.role == "user"]
        assert set(ok) <= set(users) and users[-1] == "last"
    finally:
        await budget.close()
        await cache.close()
        await sessions.close()
        await proxy.close()


@pytest.mark.parametrize("applied", [False, True])
async def test_a_settle_whose_connection_fails_is_charged_once_and_leaves_no_hold(
        redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch, applied: bool) -> None:
    """The settle's transaction lost on the way (``applied=False``) or its reply lost (``True``):
    the hold tells which, the charge is made exactly once, and no hold stays until its lease."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    store = RedisBudgetStore(redis_url, prefix=redis_prefix)
    real = store._charge_once
    failed: list[bool] = []

    async def once(*args: Any) -> Any:
        if not failed:
            failed.append(True)
            if applied:
                await real(*args)
            raise RedisConnectionError("Connection closed by server.")
        return await real(*args)

    monkeypatch.setattr(store, "_charge_once", once)
    try:
        assert (await store.reserve("u", "h1", 10, 0.0, 100, None)).granted
        spent = await store.settle("u", "h1", 7, 0.5)
        assert (spent.tokens, spent.cost, spent.calls) == (7, 0.5, 1)
        assert await store.held("u") == (0, 0.0) and await store.get("u") == spent
    finally:
        await store.close()


@pytest.mark.timeout(60)
async def test_an_add_whose_connection_is_cut_anywhere_is_charged_exactly_once(
        redis_url: str, redis_prefix: str) -> None:
    """`RedisBudgetStore.add` (a call charged without a hold) over a connection cut after each
    number of bytes it sends (mid-command), or of the bytes Redis answers (the command ran, its
    reply is lost), is sent again on a new connection and charged exactly once each time."""
    from urllib.parse import urlparse

    from .cut_proxy import CutProxy

    target = urlparse(redis_url)
    proxy = CutProxy(target.hostname or "127.0.0.1", target.port or 6379)
    url = f"redis://127.0.0.1:{await proxy.start()}{target.path}"
    store = RedisBudgetStore(url, prefix=redis_prefix, socket_timeout=5)
    try:
        expected = await store.add("u", 7, 0.5)  # (the script loaded, the connection's handshake made)
        assert (expected.tokens, expected.calls) == (7, 1)
        for left, reply in [*((n, False) for n in range(1, 400, 3)), *((n, True) for n in range(0, 40, 2))]:
            if reply:  # the whole command reaches Redis, which runs it; its reply is lost
                proxy.reply_left = left
            else:
                proxy.left = left
            spent = await store.add("u", 7, 0.5)
            proxy.left = proxy.reply_left = None  # (a cut past this add's bytes did not happen)
            expected = Spend(expected.tokens + 7, expected.cost + 0.5, expected.calls + 1)
            assert (spent.tokens, spent.calls) == (expected.tokens, expected.calls), left
            assert spent.cost == pytest.approx(expected.cost), left
        assert proxy.cuts > 40, proxy.cuts
        assert await store.get("u") == spent
    finally:
        await store.close()
        await proxy.close()


async def test_a_budget_store_that_cannot_be_reached_is_a_state_store_error_naming_the_user() -> None:
    store = RedisBudgetStore("redis://127.0.0.1:9/0", prefix="nowhere", socket_timeout=1)
    agent = (ReActAgent.builder().model(ScriptedModel([ModelStep.text("a")]))
             .middlewares([BudgetMiddleware(user_tokens=100, store=store)]).build())
    try:
        with pytest.raises(StateStoreError, match="the budget store failed reserving for user 'u' at Redis key"):
            await agent.call("hi", ctx=RuntimeContext(user_id="u", session_id="s"))
    finally:
        await store.close()


@pytest.mark.timeout(60)
async def test_two_processes_sharing_a_redis_budget_never_spend_past_its_limit(
        redis_url: str, redis_prefix: str) -> None:
    import sys

    script = str(Path(__file__).with_name("budget_proc.py"))
    limit = 2000
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, script, redis_url, redis_prefix, str(limit), str(SEED + 10 + k), str(max(10, CASES // 2)),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE) for k in range(2)]
    for p in procs:
        assert p.stdout is not None and (await p.stdout.readline()).strip() == b"ready"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(b"go\n")
        await p.stdin.drain()
    outcomes: list[str] = []
    for p in procs:
        out, _ = await asyncio.wait_for(p.communicate(), 50)
        outcomes += json.loads(out.decode().splitlines()[-1])
    store = RedisBudgetStore(redis_url, prefix=redis_prefix)
    try:
        spent = await store.get("u")
        assert set(outcomes) <= {"ran", "refused"}, outcomes
        assert "refused" in outcomes and 0 < spent.tokens <= limit, (spent, outcomes)
        assert await store.held("u") == (0, 0.0)
    finally:
        await store.close()


@pytest.mark.parametrize("cut", ["error_state", "drop_end", "other_call"])
async def test_a_stored_tool_result_that_is_not_one_whole_success_is_never_replayed(tmp_path: Path, cut: str) -> None:
    from agentscope_py import tool
    from agentscope_py.middleware import ToolResultCacheMiddleware

    ran: list[str] = []

    @tool(read_only=True)
    async def weather(city: str) -> str:
        """Current weather."""
        ran.append(city)
        return f"sunny in {city}"

    def agent(store: SqliteCacheStore) -> tuple[ReActAgent, ScriptedModel]:
        model = ScriptedModel([ModelStep.tool_calls_of(("weather", {"city": "Oslo"})), ModelStep.text("done")])
        return ReActAgent.builder().model(model).tools(weather).middleware(ToolResultCacheMiddleware(store)).build(), model

    async with SqliteCacheStore(tmp_path / "t.db") as store:
        await agent(store)[0].call("1", ctx=RuntimeContext(session_id="a"))
        with sqlite3.connect(tmp_path / "t.db") as conn:
            ((text,),) = conn.execute("SELECT events FROM response_cache").fetchall()
            evs = json.loads(text)
            spoiled = {"error_state": [*evs[:-1], {**evs[-1], "state": "error"}], "drop_end": evs[:-1],
                       "other_call": [*evs[:-1], {**evs[-1], "tool_call_id": "call_other"}]}[cut]
            conn.execute("UPDATE response_cache SET events = ?", (json.dumps(spoiled),))
        second, model = agent(store)
        await second.call("2", ctx=RuntimeContext(session_id="b"))
        assert ran == ["Oslo", "Oslo"]  # a miss: the tool ran again
        assert [b.output for b in model.requests[1].messages[-1].tool_results] == ["sunny in Oslo"]
