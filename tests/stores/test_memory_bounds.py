"""`InMemoryStateStore`'s bounds: least-recently-used eviction past ``max_sessions``, an idle TTL
(on a fake clock), ``delete``, and what eviction must never lose: a call that is running, and a
turn the agent could not save."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentscope_py import ModelStep, Msg, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.agent import AgentState, InMemoryStateStore, StateConflictError, StateStoreError
from agentscope_py.model.base import ChatChunk, ModelRequest

pytestmark = pytest.mark.timeout(10)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def state(text: str) -> AgentState:
    return AgentState(user_id="u", session_id="s", context=[Msg.user(text)])


async def stored(store: InMemoryStateStore) -> set[str]:
    return {session for _, session in store.sessions()}


# -- the bounds ------------------------------------------------------------------------------------


async def test_unbounded_by_default_keeps_every_session_and_pins_nothing() -> None:
    store = InMemoryStateStore()
    assert not store.bounded and store.max_sessions is None and store.idle_ttl is None
    assert getattr(store, "session_lock", None) is None  # the agent's calls take no extra step
    for i in range(500):
        await store.save("u", f"s{i}", state("hi"), 0)
    assert len(store.sessions()) == 500


async def test_past_max_sessions_the_least_recently_used_goes_first() -> None:
    store = InMemoryStateStore(max_sessions=3)
    for name in ("a", "b", "c"):
        await store.save("u", name, state(name), 0)
    await store.load("u", "a")  # a load is a use: now b is the least recent
    await store.save("u", "d", state("d"), 0)
    assert await stored(store) == {"a", "c", "d"}
    await store.save("u", "c", state("c2"), 1)  # a save is a use too: now a is the least recent
    await store.save("u", "e", state("e"), 0)
    assert await stored(store) == {"c", "d", "e"}
    assert await store.load("u", "b") == (None, 0)
    loaded, version = await store.load("u", "c")
    assert loaded is not None and loaded.context[0].text == "c2" and version == 2


async def test_a_load_of_an_unknown_session_stores_nothing() -> None:
    store = InMemoryStateStore(max_sessions=2)
    await store.save("u", "a", state("a"), 0)
    for i in range(10):
        assert await store.load("u", f"unknown{i}") == (None, 0)
    assert await stored(store) == {"a"}


async def test_idle_sessions_expire_after_idle_ttl() -> None:
    clock = Clock()
    store = InMemoryStateStore(idle_ttl=100, clock=clock)
    await store.save("u", "a", state("a"), 0)
    await store.save("u", "b", state("b"), 0)
    clock.now = 50
    await store.load("u", "a")  # used at 50: expires at 150
    clock.now = 99.9
    assert await stored(store) == {"a", "b"}
    clock.now = 100  # b, last used at 0, has been idle for idle_ttl
    assert await stored(store) == {"a"}
    assert await store.load("u", "b") == (None, 0)
    clock.now = 149
    assert await stored(store) == {"a"}
    clock.now = 150
    assert await stored(store) == set()


async def test_an_expired_session_starts_again_at_version_zero() -> None:
    clock = Clock()
    store = InMemoryStateStore(idle_ttl=10, clock=clock)
    await store.save("u", "a", state("old"), 0)
    clock.now = 11
    assert await store.load("u", "a") == (None, 0)
    assert await store.save("u", "a", state("new"), 0) == 1


async def test_bounds_can_be_set_and_lifted_later() -> None:
    clock = Clock()
    store = InMemoryStateStore(clock=clock)
    for name in ("a", "b", "c"):
        await store.save("u", name, state(name), 0)
    store.bound(max_sessions=2, idle_ttl=None)  # applies at once
    assert await stored(store) == {"b", "c"}
    assert store.bounded and getattr(store, "session_lock", None) is not None
    store.bound(max_sessions=None, idle_ttl=None)
    assert not store.bounded and getattr(store, "session_lock", None) is None
    for name in ("d", "e"):
        await store.save("u", name, state(name), 0)
    assert await stored(store) == {"b", "c", "d", "e"}


@pytest.mark.parametrize("kwargs, match", [
    ({"max_sessions": 0}, "max_sessions"), ({"max_sessions": -1}, "max_sessions"),
    ({"max_sessions": True}, "max_sessions"), ({"max_sessions": 2.5}, "max_sessions"),
    ({"max_sessions": "10"}, "max_sessions"), ({"idle_ttl": 0}, "idle_ttl"), ({"idle_ttl": -5}, "idle_ttl"),
    ({"idle_ttl": True}, "idle_ttl"), ({"idle_ttl": "60"}, "idle_ttl"), ({"idle_ttl": float("nan")}, "idle_ttl"),
])
def test_bad_bounds_are_refused_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        InMemoryStateStore(**kwargs)


# -- delete ----------------------------------------------------------------------------------------


async def test_delete_forgets_one_session_and_an_unknown_one_is_a_no_op() -> None:
    store = InMemoryStateStore(max_sessions=10)
    await store.save("u", "a", state("a"), 0)
    await store.save("u", "b", state("b"), 0)
    assert await store.delete("u", "nope") is False
    assert await store.delete("other", "a") is False  # sessions are per user
    assert await stored(store) == {"a", "b"}
    assert await store.delete("u", "a") is True
    assert await store.delete("u", "a") is False
    assert await store.load("u", "a") == (None, 0)
    assert await store.save("u", "a", state("again"), 0) == 1  # a new session
    for i in range(10):  # the deleted entry left nothing behind that could be evicted twice
        await store.save("u", f"x{i}", state("x"), 0)
    assert len(store.sessions()) == 10


async def test_a_session_deleted_while_its_call_runs_is_a_conflict_at_the_save() -> None:
    store = InMemoryStateStore(max_sessions=10)
    await store.save("u", "a", state("a"), 0)
    async with store.session_lock("u", "a"):
        await store.delete("u", "a")
        with pytest.raises(StateConflictError):
            await store.save("u", "a", state("a2"), 1)


# -- what eviction must not lose -------------------------------------------------------------------


class GatedModel:
    """Answers "ok" at once, except for the messages containing "wait": those wait for ``go``."""

    name = "gated"

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.waiting = asyncio.Event()
        self.requests: list[ModelRequest] = []

    async def _stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        self.requests.append(request)
        if "wait" in request.messages[-1].text:
            self.waiting.set()
            await self.go.wait()
        yield ChatChunk(text="ok")
        yield ChatChunk(finish_reason="stop")

    def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        return self._stream(request)


def ctx(session: str) -> RuntimeContext:
    return RuntimeContext(user_id="u", session_id=session)


async def test_a_session_whose_call_is_running_is_never_evicted() -> None:
    clock = Clock()
    store = InMemoryStateStore(max_sessions=2, idle_ttl=60, clock=clock)
    model = GatedModel()
    agent = ReActAgent.builder().model(model).state_store(store).build()
    await agent.call("first", ctx=ctx("long"))
    running = asyncio.get_running_loop().create_task(agent.call("please wait", ctx=ctx("long")))
    await model.waiting.wait()
    for i in range(5):  # more sessions than the bound, while "long" runs
        await agent.call("hi", ctx=ctx(f"other{i}"))
    clock.now = 1_000  # and far past the TTL
    await agent.call("hi", ctx=ctx("late"))
    assert "long" in await stored(store)
    model.go.set()
    reply = await running  # its save found its session where it left it: no conflict
    assert reply.text == "ok"
    saved, version = await store.load("u", "long")
    assert saved is not None and version == 2
    assert [m.text for m in saved.context] == ["first", "ok", "please wait", "ok"]
    # Idle again, it is evicted like any other: its idle time started when its call ended.
    clock.now = 1_059
    assert "long" in await stored(store)
    clock.now = 1_060
    assert "long" not in await stored(store)


async def test_the_bound_holds_again_once_the_running_calls_end() -> None:
    store = InMemoryStateStore(max_sessions=1)
    model = GatedModel()
    agent = ReActAgent.builder().model(model).state_store(store).build()
    calls = [asyncio.get_running_loop().create_task(agent.call("wait", ctx=ctx(f"s{i}"))) for i in range(3)]
    await model.waiting.wait()
    model.go.set()
    await asyncio.gather(*calls)
    assert len(store.sessions()) == 1  # the last call to end is the one kept


class FailingOnce(InMemoryStateStore):
    """Fails the save of one call, as a full disk would."""

    fail_next = False

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        if self.fail_next:
            self.fail_next = False
            raise OSError("disk full")
        return await super().save(user_id, session_id, state, expected_version)


async def test_an_evicted_session_with_a_turn_the_agent_holds_gets_the_turn_back(
        caplog: pytest.LogCaptureFixture) -> None:
    """The turn a failed save left with the agent outlives the session's eviction: the next call
    restores it (with a warning), so no message is lost."""
    clock = Clock()
    store = FailingOnce(max_sessions=2, idle_ttl=60, clock=clock)
    model = ScriptedModel([ModelStep.text("one"), ModelStep.text("two"), ModelStep.text("x"),
                           ModelStep.text("y"), ModelStep.text("three")])
    agent = ReActAgent.builder().model(model).state_store(store).build()
    await agent.call("first", ctx=ctx("a"))
    store.fail_next = True
    with pytest.raises(StateStoreError, match="disk full"):
        await agent.call("second", ctx=ctx("a"))
    await agent.call("hi", ctx=ctx("b"))
    await agent.call("hi", ctx=ctx("c"))  # "a" is the least recently used: evicted
    assert "a" not in await stored(store)
    with caplog.at_level(logging.WARNING, logger="agentscope_py"):
        await agent.call("third", ctx=ctx("a"))
    assert [m.text for m in model.requests[-1].messages if m.role != "system"] == [
        "first", "one", "second", "two", "third"]
    saved, _ = await store.load("u", "a")
    assert saved is not None and [m.text for m in saved.context][-1] == "three"
    assert any("no longer has it" in r.getMessage() for r in caplog.records)
