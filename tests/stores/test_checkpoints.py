"""When the agent checkpoints: after every successful call, after a
failed call (the partial turn) and on interrupt — on every store. A failing save raises
`StateStoreError` yet loses no message."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from agentscope_py import GenerateReason, ModelStep, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.agent import AgentState, InMemoryStateStore, StateConflictError, StateStoreError
from agentscope_py.agent.sqlite_store import SqliteStateStore

from .conftest import signalling


def make_agent(store: Any, *steps: ModelStep) -> tuple[ReActAgent, ScriptedModel]:
    model = ScriptedModel(list(steps))
    return ReActAgent.builder().name("bot").sys_prompt("Be brief.").model(model).state_store(store).build(), model


def pairs(state: AgentState | None) -> list[tuple[str, str]]:
    assert state is not None
    return [(m.role, m.text) for m in state.context]


def ctx() -> RuntimeContext:
    return RuntimeContext(user_id="alice", session_id="s1")


async def test_state_is_saved_after_every_successful_call(any_store: Any) -> None:
    agent, model = make_agent(any_store, ModelStep.text("hi Ada"), ModelStep.text("you are Ada"))
    await agent.call("I am Ada", ctx=ctx())
    state, version = await any_store.load("alice", "s1")
    assert version == 1
    assert pairs(state) == [("user", "I am Ada"), ("assistant", "hi Ada")]
    await agent.call("who am I?", ctx=ctx())
    state, version = await any_store.load("alice", "s1")
    assert version == 2
    assert pairs(state)[2:] == [("user", "who am I?"), ("assistant", "you are Ada")]
    # The second request carried the first turn: the agent loaded it from the store.
    assert [(m.role, m.text) for m in model.requests[1].messages] == [
        ("system", "Be brief."), ("user", "I am Ada"), ("assistant", "hi Ada"), ("user", "who am I?")]


async def test_a_failed_call_saves_the_partial_turn(any_store: Any) -> None:
    agent, _ = make_agent(any_store, ModelStep.error(RuntimeError("model down")))
    with pytest.raises(RuntimeError, match="model down"):
        await agent.call("remember me", ctx=ctx())
    state, version = await any_store.load("alice", "s1")
    assert version == 1
    assert pairs(state) == [("user", "remember me")]


async def test_an_interrupted_call_saves_an_interrupted_reply(any_store: Any) -> None:
    agent, _ = make_agent(any_store, ModelStep.text("one two three four five", chunks=5, delay=0.2))
    seen: list[str] = []
    async for event in agent.stream("tell me a long story", ctx=ctx()):
        seen.append(event.type)
        if event.type == "text_block_delta":  # the slow step is streaming: stop it now
            assert agent.interrupt(user_id="alice", session_id="s1")
    assert seen.count("text_block_delta") < 5
    state, version = await any_store.load("alice", "s1")
    assert version == 1
    assert state is not None
    assert [m.role for m in state.context] == ["user", "assistant"]
    reply = state.context[1]
    assert reply.generate_reason is GenerateReason.INTERRUPTED
    assert reply.metadata.get("interrupted") is True
    assert reply.text.startswith("one")


class FailingSaves:
    """A store that forwards to ``inner`` but fails the next ``failures`` saves (a disk that is
    full for a moment)."""

    def __init__(self, inner: Any, failures: int = 1) -> None:
        self.inner = inner
        self.failures = failures

    async def load(self, user_id: str, session_id: str) -> tuple[AgentState | None, int]:
        return await self.inner.load(user_id, session_id)  # type: ignore[no-any-return]

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        if self.failures:
            self.failures -= 1
            raise OSError("disk full")
        return await self.inner.save(user_id, session_id, state, expected_version)  # type: ignore[no-any-return]


async def test_a_failing_save_raises_keeps_the_turn_and_the_next_call_loses_nothing(any_store: Any) -> None:
    store = FailingSaves(any_store)
    agent, model = make_agent(store, ModelStep.text("first answer"), ModelStep.text("second answer"))
    c = ctx()
    with pytest.raises(StateStoreError, match=r"alice/s1.*disk full") as info:
        await agent.call("first question", ctx=c)
    assert isinstance(info.value.__cause__, OSError)
    # The in-memory state object kept the whole turn…
    assert pairs(c.agent_state) == [("user", "first question"), ("assistant", "first answer")]
    # …although the store has nothing.
    assert (await any_store.load("alice", "s1")) == (None, 0)

    msg = await agent.call("second question", ctx=ctx())  # the store works again
    assert msg.text == "second answer"
    assert [m.text for m in model.requests[1].messages[1:]] == ["first question", "first answer", "second question"]
    state, version = await any_store.load("alice", "s1")
    assert version == 1
    assert pairs(state) == [("user", "first question"), ("assistant", "first answer"),
                            ("user", "second question"), ("assistant", "second answer")]


async def test_a_failing_save_of_a_later_turn_loses_nothing_either(any_store: Any) -> None:
    store = FailingSaves(any_store, failures=0)
    agent, _ = make_agent(store, *(ModelStep.text(f"a{i}") for i in range(3)))
    await agent.call("q0", ctx=ctx())
    store.failures = 1
    with pytest.raises(StateStoreError):
        await agent.call("q1", ctx=ctx())
    await agent.call("q2", ctx=ctx())
    state, version = await any_store.load("alice", "s1")
    assert version == 2
    assert [t for _, t in pairs(state)] == ["q0", "a0", "q1", "a1", "q2", "a2"]


async def test_an_unsaved_turn_yields_to_a_newer_stored_state(tmp_path: Any) -> None:
    """If another writer saved the session after our checkpoint failed, the stored state wins
    (exactly as a CAS conflict would decide); the unsaved turn is not forced over it."""
    async with SqliteStateStore(tmp_path / "s.db") as shared:
        flaky = FailingSaves(shared)
        agent, model = make_agent(flaky, ModelStep.text("lost"), ModelStep.text("mine"))
        other, _ = make_agent(shared, ModelStep.text("theirs"))
        with pytest.raises(StateStoreError):
            await agent.call("unsaved", ctx=ctx())
        await other.call("saved elsewhere", ctx=ctx())
        await agent.call("next", ctx=ctx())
        assert [m.text for m in model.requests[1].messages[1:]] == ["saved elsewhere", "theirs", "next"]
        state, _ = await shared.load("alice", "s1")
        assert [t for _, t in pairs(state)] == ["saved elsewhere", "theirs", "next", "mine"]


async def test_without_a_session_lock_a_racing_save_fails_loudly() -> None:
    """Two agents (two processes, say) on a store without a session lock race on one session:
    the later save raises instead of overwriting the other's turn."""
    store = InMemoryStateStore()
    asked = asyncio.Event()
    slow, _ = make_agent(store, signalling(asked, ModelStep.text("slow", delay=0.3)))
    fast, _ = make_agent(store, ModelStep.text("fast"))
    task = asyncio.create_task(slow.call("from slow", ctx=ctx()))
    await asked.wait()  # slow has loaded version 0 and is waiting for its model
    await fast.call("from fast", ctx=ctx())  # saves version 1 meanwhile
    with pytest.raises(StateConflictError, match="alice/s1"):
        await task
    state, version = await store.load("alice", "s1")
    assert (pairs(state), version) == ([("user", "from fast"), ("assistant", "fast")], 1)


async def test_agents_sharing_a_sqlite_file_take_the_session_in_turn(tmp_path: Any) -> None:
    """Two agents with stores of their own on one SQLite file (two processes, say): the second
    input waits for the session's lock in the file, and runs on the turn the first saved."""
    first_store, second_store = SqliteStateStore(tmp_path / "turns.db"), SqliteStateStore(tmp_path / "turns.db")
    asked = asyncio.Event()
    slow, _ = make_agent(first_store, signalling(asked, ModelStep.text("slow", delay=0.3)))
    fast, fast_model = make_agent(second_store, ModelStep.text("fast"))
    task = asyncio.create_task(slow.call("from slow", ctx=ctx()))
    await asked.wait()  # slow holds the session and waits for its model
    await fast.call("from fast", ctx=ctx())
    await task
    assert [m.text for m in fast_model.requests[0].messages[1:]] == ["from slow", "slow", "from fast"]
    state, version = await first_store.load("alice", "s1")
    assert (pairs(state), version) == ([("user", "from slow"), ("assistant", "slow"), ("user", "from fast"),
                                        ("assistant", "fast")], 2)
    await first_store.close()
    await second_store.close()


async def test_a_consumer_that_stops_listening_still_checkpoints_the_turn(any_store: Any) -> None:
    agent, _ = make_agent(any_store, ModelStep.text("one two three four five", chunks=5, delay=0.2))
    it = agent.stream("talk", ctx=ctx()).__aiter__()
    async with contextlib.aclosing(it):  # type: ignore[type-var]
        async for event in it:
            if event.type == "text_block_delta":
                break  # the consumer goes away mid-reply (a closed browser tab)
    state, version = await any_store.load("alice", "s1")
    assert version == 1
    assert state is not None and [m.role for m in state.context] == ["user", "assistant"]
    assert state.context[1].generate_reason is GenerateReason.INTERRUPTED
