"""The store contract, checked on every store: versions, CAS, conflict policies, and
many concurrent writers that lose nothing."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import Msg
from agentscope_py.agent import AgentState, InMemoryStateStore, StateConflictError, StateStoreError
from agentscope_py.agent.sqlite_store import SqliteStateStore


def state_with(*texts: str) -> AgentState:
    return AgentState(user_id="u", session_id="s", context=[Msg.user(t) for t in texts])


def texts(state: AgentState | None) -> list[str]:
    assert state is not None
    return [m.text for m in state.context]


async def test_versions_start_at_zero_and_count_saves(any_store: Any) -> None:
    assert await any_store.load("u", "s") == (None, 0)
    assert await any_store.save("u", "s", state_with("a"), 0) == 1
    assert await any_store.save("u", "s", state_with("a", "b"), 1) == 2
    state, version = await any_store.load("u", "s")
    assert (texts(state), version) == (["a", "b"], 2)
    assert await any_store.load("u", "other") == (None, 0)  # sessions are separate
    assert await any_store.load("other", "s") == (None, 0)  # and so are users


async def test_a_stale_version_is_a_conflict_and_changes_nothing(any_store: Any) -> None:
    await any_store.save("u", "s", state_with("first"), 0)
    with pytest.raises(StateConflictError) as info:
        await any_store.save("u", "s", state_with("stale"), 0)
    assert (info.value.expected, info.value.actual) == (0, 1)
    assert "u/s" in str(info.value)
    assert isinstance(info.value, StateStoreError)
    with pytest.raises(StateConflictError):
        await any_store.save("u", "s", state_with("future"), 5)
    state, version = await any_store.load("u", "s")
    assert (texts(state), version) == (["first"], 1)


async def test_saving_version_zero_over_a_stored_state_is_a_conflict(any_store: Any) -> None:
    """Two first writers: the second must not silently replace the first."""
    await any_store.save("u", "s", state_with("one"), 0)
    with pytest.raises(StateConflictError):
        await any_store.save("u", "s", state_with("two"), 0)


@pytest.mark.parametrize("kind", ["memory", "sqlite", pytest.param("redis", marks=pytest.mark.redis)])
async def test_overwrite_policy_means_last_writer_wins(kind: str, tmp_path: Path,
                                                       request: pytest.FixtureRequest) -> None:
    store = make_store(kind, tmp_path, request, conflict_policy="overwrite")
    try:
        assert await store.save("u", "s", state_with("one"), 0) == 1
        assert await store.save("u", "s", state_with("two"), 0) == 2  # stale, still saved
        assert await store.save("u", "s", state_with("three"), 99) == 3
        state, version = await store.load("u", "s")
        assert (texts(state), version) == (["three"], 3)
    finally:
        await close(store)


@pytest.mark.parametrize("kind", ["memory", "sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def test_an_unknown_conflict_policy_is_rejected(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    with pytest.raises(ValueError, match="conflict_policy"):
        make_store(kind, tmp_path, request, conflict_policy="last-wins")


async def test_concurrent_writers_retrying_on_conflict_lose_nothing(any_store: Any, tmp_path: Path,
                                                                    request: pytest.FixtureRequest) -> None:
    """24 writers on 4 store instances (4 connections for SQLite and Redis): each reads, appends
    its message and saves with CAS, retrying on a conflict. Every write must be in the result."""
    if isinstance(any_store, InMemoryStateStore):
        stores = [any_store] * 4
    elif isinstance(any_store, SqliteStateStore):
        stores = [SqliteStateStore(any_store.path) for _ in range(4)]
    else:
        from agentscope_py.agent.redis_store import RedisStateStore

        stores = [RedisStateStore(any_store.url, prefix=any_store.prefix) for _ in range(4)]
    conflicts = 0

    async def writer(i: int) -> None:
        nonlocal conflicts
        store = stores[i % len(stores)]
        while True:
            state, version = await store.load("u", "s")
            base = state or AgentState(user_id="u", session_id="s")
            # A new object: the in-memory store shares states by reference.
            new = base.model_copy(update={"context": [*base.context, Msg.user(f"w{i}")]})
            await asyncio.sleep(0)  # the agent's run between load and save: let others interleave
            try:
                await store.save("u", "s", new, version)
                return
            except StateConflictError:
                conflicts += 1
                await asyncio.sleep(random.uniform(0, 0.003))

    try:
        await asyncio.wait_for(asyncio.gather(*(writer(i) for i in range(24))), 30)
        state, version = await any_store.load("u", "s")
        assert version == 24
        assert sorted(texts(state)) == sorted(f"w{i}" for i in range(24))
        assert conflicts > 0, "the writers never raced: the test proves nothing"
    finally:
        for store in stores:
            if store is not any_store:
                await close(store)


async def test_delete_forgets_a_session_and_an_unknown_one_is_a_no_op(any_store: Any) -> None:
    """Every store: ``delete`` says whether the session existed, touches no other session, and a
    deleted session starts again at version 0."""
    await any_store.save("u", "s", state_with("a"), 0)
    await any_store.save("u", "s", state_with("a", "b"), 1)
    await any_store.save("u", "keep", state_with("k"), 0)
    assert await any_store.delete("u", "unknown") is False
    assert await any_store.delete("nobody", "s") is False
    assert await any_store.delete("u", "s") is True
    assert await any_store.delete("u", "s") is False
    assert await any_store.load("u", "s") == (None, 0)
    assert await any_store.save("u", "s", state_with("new"), 0) == 1
    kept, version = await any_store.load("u", "keep")
    assert (texts(kept), version) == (["k"], 1)


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
async def test_sqlite_and_redis_list_and_delete_sessions(kind: str, tmp_path: Path,
                                                         request: pytest.FixtureRequest) -> None:
    any_store = make_store(kind, tmp_path, request)
    for user, session in [("bob", "b"), ("alice", "x:y"), ("alice", "a")]:
        await any_store.save(user, session, state_with("hi"), 0)
    assert await any_store.sessions() == [("alice", "a"), ("alice", "x:y"), ("bob", "b")]
    assert await any_store.sessions("alice") == [("alice", "a"), ("alice", "x:y")]
    assert await any_store.delete("alice", "x:y") is True
    assert await any_store.delete("alice", "x:y") is False
    assert await any_store.load("alice", "x:y") == (None, 0)
    assert await any_store.sessions() == [("alice", "a"), ("bob", "b")]
    await close(any_store)


# -- helpers -------------------------------------------------------------------------------------


def make_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest, **options: Any) -> Any:
    if kind == "memory":
        return InMemoryStateStore(**options)
    if kind == "sqlite":
        return SqliteStateStore(tmp_path / "policy.db", **options)
    from agentscope_py.agent.redis_store import RedisStateStore

    return RedisStateStore(request.getfixturevalue("redis_url"), prefix=request.getfixturevalue("redis_prefix"),
                           **options)


async def close(store: Any) -> None:
    if hasattr(store, "close"):
        await store.close()
