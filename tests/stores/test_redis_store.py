"""RedisStateStore against a real redis-server: key layout, the cross-process session lock
(refresh, expiry after a crash, compare-and-delete), two agent processes sharing a session,
corrupted data and a dead or hung server."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
import warnings
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from agentscope_py import ModelStep, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.agent import AgentState, RedisStateStore, StateStoreError

from .conftest import free_port, script_args, signalling

pytestmark = pytest.mark.redis


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[Redis]:
    """A plain client, to look at (and tamper with) what the store wrote."""
    client = Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


async def test_keys_are_prefixed_and_ids_escaped(redis_store: RedisStateStore, raw: Redis, redis_prefix: str) -> None:
    await redis_store.save("a:b", "c", AgentState(summary="1"), 0)
    await redis_store.save("a", "b:c", AgentState(summary="2"), 0)  # must not collide with the first
    assert sorted(await raw.keys(f"{redis_prefix}:*")) == [f"{redis_prefix}:state:a%3Ab:c",
                                                            f"{redis_prefix}:state:a:b%3Ac"]
    stored = await raw.hgetall(f"{redis_prefix}:state:a%3Ab:c")
    assert stored["version"] == "1"
    assert AgentState.from_json(stored["state"]).summary == "1"
    assert stored["updated_at"].endswith("+00:00")
    assert (await redis_store.load("a", "b:c"))[0].summary == "2"  # type: ignore[union-attr]


# -- the session lock ----------------------------------------------------------------------------


async def take_and_release(store: RedisStateStore, user: str = "u", session: str = "s") -> float:
    """Acquire the session lock, release it; the seconds it took to acquire."""
    started = time.monotonic()
    async with store.session_lock(user, session):
        return time.monotonic() - started


async def test_the_lock_excludes_others_and_expires_with_its_holder(redis_store: RedisStateStore,
                                                                   raw: Redis, redis_prefix: str) -> None:
    other = RedisStateStore(redis_store.url, prefix=redis_prefix)
    async with redis_store.session_lock("u", "s"):
        ttl = await raw.pttl(f"{redis_prefix}:lock:u:s")
        assert 0 < ttl <= 30_000  # the default lock_timeout
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(take_and_release(other), 0.3)
        assert await take_and_release(other, session="another") < 0.5  # other sessions are free
    assert await raw.exists(f"{redis_prefix}:lock:u:s") == 0  # released on exit
    assert await asyncio.wait_for(take_and_release(other), 1) < 0.5
    await other.close()


async def test_a_long_run_keeps_its_lock_by_refreshing_it(redis_url: str, redis_prefix: str, raw: Redis) -> None:
    store = RedisStateStore(redis_url, prefix=redis_prefix, lock_timeout=1.5)
    other = RedisStateStore(redis_url, prefix=redis_prefix)
    async with store.session_lock("u", "s"):
        # Hold it for 2.5 lifetimes of the lock: nobody else may get in meanwhile. (Refreshes
        # come every 0.5 s, so a loaded machine may stall the loop for 1 s without harm: CI's
        # two workers once stalled it past the 0.4 s a 0.6 s lock allowed.)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(take_and_release(other), 3.75)
        assert 0 < await raw.pttl(f"{redis_prefix}:lock:u:s") <= 1_500
    await store.close()
    await other.close()


async def test_release_never_deletes_a_lock_someone_else_now_holds(redis_store: RedisStateStore, raw: Redis,
                                                                   redis_prefix: str) -> None:
    key = f"{redis_prefix}:lock:u:s"
    async with redis_store.session_lock("u", "s"):
        # Our lock expired and another process took it (simulated): its token replaces ours.
        await raw.set(key, "someone-else", px=10_000)
    assert await raw.get(key) == "someone-else"


async def test_a_crashed_holder_never_wedges_the_session(redis_url: str, redis_prefix: str) -> None:
    """A process takes the lock with a 1 s expiry and is killed (SIGKILL: no cleanup at all).
    While it lives, its refreshes keep others out; after its death the lock is free once it
    expires."""
    holder = await asyncio.create_subprocess_exec(
        *script_args("hold-lock", "--store", redis_url, "--prefix", redis_prefix, "--lock-timeout", "1.0"),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        assert await asyncio.wait_for(holder.stdout.readline(), 20) == b"locked\n"
        store = RedisStateStore(redis_url, prefix=redis_prefix)
        with pytest.raises(TimeoutError):  # alive past its 1 s expiry: refreshed, still held
            await asyncio.wait_for(take_and_release(store), 1.5)
        holder.kill()
        await holder.wait()
        killed = time.monotonic()
        await asyncio.wait_for(take_and_release(store), 5)
        # Free after at most one lifetime (plus polling and slack for a loaded machine), not
        # the default 30 s, and never wedged.
        assert time.monotonic() - killed < 1.0 + 1.5
        await store.close()
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()


async def test_two_agents_in_one_process_share_the_session_through_the_lock(redis_store: RedisStateStore) -> None:
    """Separate agents (separate in-process gates) on one Redis store: the session lock orders them
    and the second sees the first's turn."""
    asked = asyncio.Event()
    m1 = ScriptedModel([signalling(asked, ModelStep.text("one", delay=0.2))])
    m2 = ScriptedModel([ModelStep.text("two")])
    a1 = ReActAgent.builder().model(m1).state_store(redis_store).build()
    a2 = ReActAgent.builder().model(m2).state_store(redis_store).build()
    ctx = RuntimeContext(user_id="u", session_id="s")
    first = asyncio.create_task(a1.call("first", ctx=ctx))
    await asked.wait()
    await a2.call("second", ctx=RuntimeContext(user_id="u", session_id="s"))
    await first
    assert [m.text for m in m2.requests[0].messages[1:]] == ["first", "one", "second"]
    state, version = await redis_store.load("u", "s")
    assert version == 2
    assert state is not None and [m.text for m in state.context] == ["first", "one", "second", "two"]


# -- two OS processes ----------------------------------------------------------------------------


async def test_two_processes_on_one_session_take_turns_and_lose_nothing(redis_url: str, redis_prefix: str) -> None:
    """Two agent processes call the same session at the same moment, each with a slow model
    step. The session lock serialises them: the load-to-save windows do not overlap, the later
    one's model sees the earlier one's turn, and the store ends with both turns in order."""
    procs = [
        await asyncio.create_subprocess_exec(
            *script_args("turn", "--store", redis_url, "--prefix", redis_prefix, "--user", "u", "--session", "s",
                         "--say", f"question {name}", "--reply", f"answer {name}", "--delay", "0.2", "--wait-go"),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        for name in ("A", "B")
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            line = await asyncio.wait_for(p.stdout.readline(), 20)
            assert line == b"ready\n", (line, await p.stderr.read() if p.stderr else b"")
        for p in procs:  # both go at once
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            await p.stdin.drain()
        outputs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 20)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err.decode()
    runs: list[dict[str, Any]] = sorted((json.loads(out.splitlines()[-1]) for out, _ in outputs),
                                        key=lambda r: r["start"])
    first, second = runs
    assert first["end"] <= second["start"], f"the runs overlapped: {runs}"
    assert second["start"] - first["start"] >= 0.2  # the second waited out the first's slow step
    first_name = first["reply"][-1]
    second_name = second["reply"][-1]
    assert first["request"][1:] == [["user", f"question {first_name}"]]
    assert second["request"][1:] == [["user", f"question {first_name}"], ["assistant", f"answer {first_name}"],
                                     ["user", f"question {second_name}"]]
    store = RedisStateStore(redis_url, prefix=redis_prefix)
    state, version = await store.load("u", "s")
    await store.close()
    assert version == 2
    assert state is not None and [m.text for m in state.context] == [
        f"question {first_name}", f"answer {first_name}", f"question {second_name}", f"answer {second_name}"]


# -- bad data and a bad server -------------------------------------------------------------------


@pytest.mark.parametrize("fields", [
    {"version": "3", "state": "{not json"},
    {"version": "3", "state": '{"tasks": 7}'},
    {"version": "three", "state": "{}"},
    {"version": "3"},
])
async def test_a_corrupted_state_is_a_typed_error_and_nothing_is_overwritten(
    redis_store: RedisStateStore, raw: Redis, redis_prefix: str, fields: dict[str, str]
) -> None:
    key = f"{redis_prefix}:state:alice:s1"
    await raw.hset(key, mapping=fields)
    with pytest.raises(StateStoreError, match="session alice/s1 is corrupted"):
        await redis_store.load("alice", "s1")
    model = ScriptedModel([ModelStep.text("never")])
    agent = ReActAgent.builder().model(model).state_store(redis_store).build()
    with pytest.raises(StateStoreError, match="alice/s1"):
        await agent.call("hi", ctx=RuntimeContext(user_id="alice", session_id="s1"))
    assert model.requests == []
    assert await raw.hgetall(key) == fields
    assert await raw.exists(f"{redis_prefix}:lock:alice:s1") == 0  # the lock was released


async def test_a_dead_server_is_a_typed_error_not_a_hang() -> None:
    store = RedisStateStore(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(StateStoreError, match="loading session u/s from Redis failed"):
        await store.load("u", "s")
    with pytest.raises(StateStoreError, match="saving session u/s"):
        await store.save("u", "s", AgentState(), 0)
    with pytest.raises(StateStoreError, match="locking session u/s"):
        await take_and_release(store)
    agent = ReActAgent.builder().model(ScriptedModel([ModelStep.text("never")])).state_store(store).build()
    with pytest.raises(StateStoreError):
        await agent.call("hi", ctx=RuntimeContext(user_id="u", session_id="s"))
    assert time.monotonic() - started < 5
    await store.close()


async def test_a_server_that_never_answers_times_out_as_a_typed_error() -> None:
    """A peer that accepts the connection and then says nothing (a hung server, a black hole)."""
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = RedisStateStore(f"redis://127.0.0.1:{port}/0", socket_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(StateStoreError, match="Timeout"):
        await store.load("u", "s")
    assert time.monotonic() - started < 2  # one retry at most: 2 x 0.3 s
    assert accepted
    for w in accepted:
        w.close()
    server.close()
    await server.wait_closed()
    with contextlib.suppress(StateStoreError):
        await store.close()


def test_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="lock_timeout"):
        RedisStateStore("redis://127.0.0.1:1/0", lock_timeout=0)
    with pytest.raises(ValueError, match="conflict_policy"):
        RedisStateStore("redis://127.0.0.1:1/0", conflict_policy="merge")  # type: ignore[arg-type]


def test_one_store_works_across_event_loops(redis_url: str, redis_prefix: str) -> None:
    """A redis.asyncio connection belongs to its loop: a second asyncio.run gets a new client."""
    store = RedisStateStore(redis_url, prefix=redis_prefix)
    assert asyncio.run(store.save("u", "s", AgentState(), 0)) == 1
    assert asyncio.run(store.load("u", "s"))[1] == 1
    asyncio.run(store.close())
    # The first two loops' clients were dropped, not closed (a connection cannot be closed from
    # another loop, docs/sessions.md): their warnings come out here, not in a later test.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
