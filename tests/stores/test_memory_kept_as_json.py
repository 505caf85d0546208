"""`InMemoryStateStore` keeps each state as its JSON: a served process holds thousands of finished
sessions, and Python's full collections walk every object it holds (pausing every stream at
once), so a kept session must be one object, not its messages' dozens. And what a caller loads is
its own: no aliasing between a stored state and a live one."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from agentscope_py import ModelStep, Msg, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.agent import AgentState, InMemoryStateStore

pytestmark = pytest.mark.timeout(30)


def conversation(turns: int) -> AgentState:
    context: list[Msg] = []
    for i in range(turns):
        context += [Msg.user(f"question {i}"), Msg.assistant(f"answer {i}")]
    return AgentState(user_id="u", session_id="s", context=context, metadata={"seen": ["a", "b"]})


def tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


async def test_a_kept_session_costs_the_collector_one_object_or_so() -> None:
    store = InMemoryStateStore()
    before = tracked()
    for i in range(1_000):
        await store.save("u", f"s{i}", conversation(5), 0)
    per_session = (tracked() - before) / 1_000
    # By reference it was ~70 per session here (the state, its 10 messages, their blocks, dicts,
    # sets); as JSON the session is a bytes object the collector does not track, in a tuple.
    assert per_session < 3, per_session


async def test_a_saved_state_changed_afterwards_changes_nothing_stored() -> None:
    store = InMemoryStateStore()
    state = conversation(1)
    version = await store.save("u", "s", state, 0)
    state.context.append(Msg.user("not saved"))
    state.metadata["seen"].append("c")
    loaded, loaded_version = await store.load("u", "s")
    assert loaded is not None and loaded_version == version == 1
    assert [m.text for m in loaded.context] == ["question 0", "answer 0"]
    assert loaded.metadata == {"seen": ["a", "b"]}
    assert loaded == conversation(1).model_copy(update={"context": loaded.context})  # nothing else moved


async def test_two_loads_are_two_states_and_the_saved_one_is_unchanged() -> None:
    store = InMemoryStateStore()
    await store.save("u", "s", conversation(1), 0)
    first, _ = await store.load("u", "s")
    second, _ = await store.load("u", "s")
    assert first is not None and second is not None and first is not second and first == second
    first.context.clear()
    again, _ = await store.load("u", "s")
    assert again is not None and len(again.context) == 2


async def test_a_state_json_cannot_hold_is_kept_as_it_is() -> None:
    class Opaque:
        pass

    class Richer(AgentState):
        note: str = ""

    store = InMemoryStateStore()
    odd = AgentState(user_id="u", session_id="odd", metadata={"handle": Opaque()})
    richer = Richer(user_id="u", session_id="richer", note="kept")
    await store.save("u", "odd", odd, 0)
    await store.save("u", "richer", richer, 0)
    loaded_odd, _ = await store.load("u", "odd")
    loaded_richer, _ = await store.load("u", "richer")
    assert loaded_odd is odd and isinstance(loaded_odd.metadata["handle"], Opaque)
    assert loaded_richer is richer and isinstance(loaded_richer, Richer)


async def test_an_agent_remembers_its_sessions_through_the_json() -> None:
    model = ScriptedModel([ModelStep.text("one"), ModelStep.text("two")])
    store = InMemoryStateStore(max_sessions=10)
    agent = ReActAgent.builder().model(model).state_store(store).build()
    ctx: Any = RuntimeContext(user_id="u", session_id="s")
    await agent.call("first", ctx=ctx)
    assert (await agent.call("second", ctx=ctx)).text == "two"
    seen = [m.text for m in model.requests[-1].messages if m.role != "system"]
    assert seen == ["first", "one", "second"]
    state, version = await store.load("u", "s")
    assert version == 2 and state is not None and [m.text for m in state.context] == ["first", "one", "second",
                                                                                    "two"]
