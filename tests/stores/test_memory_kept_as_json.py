"""`InMemoryStateStore` keeps each state as its JSON: a served process holds thousands of finished
sessions, and Python's full collections walk every object it holds (pausing every stream at
once), so a kept session must be one object, not its messages' dozens. And what a caller loads is
its own: no aliasing between a stored state and a live one."""

from __future__ import annotations

import gc
from enum import StrEnum
from typing import Any

import pytest
from pydantic import BaseModel

from agentscope_py import ModelStep, Msg, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.agent import AgentState, InMemoryStateStore
from agentscope_py.message import TextBlock, ToolUseBlock

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
    store = InMemoryStateStore(as_json=True)
    before = tracked()
    for i in range(1_000):
        await store.save("u", f"s{i}", conversation(5), 0)
    per_session = (tracked() - before) / 1_000
    # By reference it was ~70 per session here (the state, its 10 messages, their blocks, dicts,
    # sets); as JSON the session is a bytes object the collector does not track, in a tuple.
    assert per_session < 3, per_session


async def test_a_saved_state_changed_afterwards_changes_nothing_stored() -> None:
    store = InMemoryStateStore(as_json=True)
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
    store = InMemoryStateStore(as_json=True)
    await store.save("u", "s", conversation(1), 0)
    first, _ = await store.load("u", "s")
    second, _ = await store.load("u", "s")
    assert first is not None and second is not None and first is not second and first == second
    first.context.clear()
    again, _ = await store.load("u", "s")
    assert again is not None and len(again.context) == 2


class City(BaseModel):
    name: str


class Color(StrEnum):
    RED = "red"


@pytest.mark.parametrize("metadata", [{"handle": object()}, {"city": City(name="Oslo")}, {"pair": (1, 2)},
                                      {"ratio": float("nan")}, {"color": Color.RED}],
                         ids=["object", "model", "tuple", "nan", "enum"])
async def test_a_state_json_would_not_give_back_as_it_is_is_kept_as_it_is(metadata: dict[Any, Any]) -> None:
    """On the state, on a message or in a tool call's input: a structured output's model must come
    back a model, a tuple a tuple (as they did when every state was kept by reference)."""
    store = InMemoryStateStore(as_json=True)
    on_state = AgentState(user_id="u", session_id="a", metadata=metadata)
    reply = Msg(role="assistant", content=[TextBlock(text="hi")], metadata=metadata)
    on_message = AgentState(user_id="u", session_id="b", context=[reply])
    call = Msg(role="assistant", content=[ToolUseBlock(id="c1", name="f", input=dict(metadata))])
    in_tool_input = AgentState(user_id="u", session_id="c", context=[call])
    for state in (on_state, on_message, in_tool_input):
        await store.save("u", state.session_id, state, 0)
        loaded, _ = await store.load("u", state.session_id)
        assert loaded is state


async def test_a_subclass_of_the_state_or_of_a_message_is_kept_as_it_is() -> None:
    class Richer(AgentState):
        note: str = ""

    class Tagged(Msg):
        tag: str = ""

    store = InMemoryStateStore(as_json=True)
    richer = Richer(user_id="u", session_id="richer", note="kept")
    tagged = AgentState(user_id="u", session_id="tagged", context=[Tagged(role="user", tag="t")])
    await store.save("u", "richer", richer, 0)
    await store.save("u", "tagged", tagged, 0)
    assert (await store.load("u", "richer"))[0] is richer
    loaded, _ = await store.load("u", "tagged")
    assert loaded is tagged and isinstance(loaded.context[0], Tagged)


async def test_plain_values_in_metadata_and_tool_inputs_go_as_json() -> None:
    plain = {"n": 1, "x": 0.5, "ok": True, "none": None, "nested": {"list": ["a", 2, [3.25]]}}
    call = Msg(role="assistant", content=[ToolUseBlock(id="c1", name="f", input=plain)], metadata=plain)
    state = AgentState(user_id="u", session_id="s", context=[call], metadata=plain)
    store = InMemoryStateStore(as_json=True)
    await store.save("u", "s", state, 0)
    loaded, _ = await store.load("u", "s")
    assert loaded is not state and loaded == state


async def test_an_agent_remembers_its_sessions_through_the_json() -> None:
    model = ScriptedModel([ModelStep.text("one"), ModelStep.text("two")])
    store = InMemoryStateStore(max_sessions=10, as_json=True)
    agent = ReActAgent.builder().model(model).state_store(store).build()
    ctx: Any = RuntimeContext(user_id="u", session_id="s")
    await agent.call("first", ctx=ctx)
    assert (await agent.call("second", ctx=ctx)).text == "two"
    seen = [m.text for m in model.requests[-1].messages if m.role != "system"]
    assert seen == ["first", "one", "second"]
    state, version = await store.load("u", "s")
    assert version == 2 and state is not None and [m.text for m in state.context] == ["first", "one", "second",
                                                                                    "two"]


async def test_by_default_a_state_is_kept_as_it_is_and_serving_keeps_json() -> None:
    # A script's or a test's store: no serialisation per save, no parse per load.
    store = InMemoryStateStore()
    state = conversation(1)
    await store.save("u", "s", state, 0)
    assert (await store.load("u", "s"))[0] is state
    with pytest.raises(TypeError, match="as_json must be True or False"):
        InMemoryStateStore(as_json="yes")  # type: ignore[arg-type]
