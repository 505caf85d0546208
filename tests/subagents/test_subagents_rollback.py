"""A rollback takes the interrupted turn out of the sub-agents' sessions too: a sub-agent in a
``"derived"`` session remembers its calls across its caller's turns, so the calls a rolled-back
turn made go with it — the sub-agent's session is as the caller's turn found it, whether its
call had ended before the interrupt or was running when it landed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import ReActAgent, RuntimeContext, ScriptedModel, tool
from agentscope_py.agent import AgentStateStore, InMemoryStateStore, SqliteStateStore
from agentscope_py.model import ModelRequest, ModelStep

pytestmark = pytest.mark.timeout(20)


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AgentStateStore]:
    if request.param == "memory":
        yield InMemoryStateStore()
        return
    async with SqliteStateStore(tmp_path / "sessions.db") as sqlite:
        yield sqlite


def _user_texts(request: ModelRequest) -> list[str]:
    return [m.text for m in request.messages if m.role == "user" and m.text]


def _hold(holding: asyncio.Event, release: asyncio.Event) -> Any:
    """A tool that holds its run (``holding`` set) until ``release``."""

    @tool
    async def hold() -> str:
        """Hold the run."""
        holding.set()
        await release.wait()
        return "held"

    return hold


def _tree(store: AgentStateStore, holding: asyncio.Event, release: asyncio.Event,
          session: Any = "derived") -> ReActAgent:
    """A lead whose every turn asks its helper (in a derived session) to remember the turn's
    word; the helper holds on ``"hold in helper"``, the lead after the call on ``"hold after"``."""

    hold = _hold(holding, release)

    def helper_turn(request: ModelRequest) -> ModelStep:
        last = request.messages[-1]
        if last.role == "user" and last.text == "remember hold in helper":
            return ModelStep.tool_call("hold", {})
        return ModelStep.text(f"noted {_user_texts(request)}")

    def lead_turn(request: ModelRequest) -> ModelStep:
        last = request.messages[-1]
        word = _user_texts(request)[-1]
        if last.role == "user":
            return ModelStep.tool_call("helper", {"task": f"remember {word}"})
        if word == "hold after" and not any(r.name == "hold" for r in last.tool_results):
            return ModelStep.tool_call("hold", {})
        return ModelStep.text(f"done {word}")

    helper = (ReActAgent.builder().name("helper").model(ScriptedModel([ModelStep(respond=helper_turn)], loop=True))
              .tools(hold).state_store(store).build())
    return (ReActAgent.builder().name("lead").model(ScriptedModel([ModelStep(respond=lead_turn)], loop=True))
            .tools(hold, helper.as_tool(session=session)).state_store(store).build())


@pytest.mark.parametrize("word", ["hold after", "hold in helper"])
async def test_a_rollback_takes_the_turn_out_of_the_sub_agents_session(store: AgentStateStore, word: str) -> None:
    holding, release = asyncio.Event(), asyncio.Event()
    lead = _tree(store, holding, release)
    ctx = RuntimeContext("u", "s")
    assert (await lead.call("one", ctx=ctx)).text == "done one"  # a turn before: it stays
    found, _ = await store.load("u", "s/helper")
    assert found is not None and [m.text for m in found.context if m.role == "user"] == ["remember one"]

    stopped = asyncio.create_task(lead.call(word, ctx=RuntimeContext("u", "s")))
    await asyncio.wait_for(holding.wait(), 5)  # the turn's helper call ended, or runs
    reply = await lead.call("two", ctx=RuntimeContext("u", "s"), multitask_strategy="rollback")
    assert (await asyncio.wait_for(stopped, 5)).metadata["rolled_back"]

    helper_state, _ = await store.load("u", "s/helper")
    assert helper_state is not None
    # The helper's session holds the turn before and the next one, not the rolled-back one's.
    assert [m.text for m in helper_state.context if m.role == "user"] == ["remember one", "remember two"]
    assert helper_state.context[:len(found.context)] == found.context
    assert reply.text == "done two"
    lead_state, _ = await store.load("u", "s")
    assert lead_state is not None and [m.text for m in lead_state.context if m.role == "user"] == ["one", "two"]


async def test_a_rollback_reaches_a_sub_agents_own_sub_agent(store: AgentStateStore) -> None:
    holding, release = asyncio.Event(), asyncio.Event()

    hold = _hold(holding, release)

    def scribe_turn(request: ModelRequest) -> ModelStep:
        return ModelStep.text(f"wrote {_user_texts(request)[-1]}")

    def helper_turn(request: ModelRequest) -> ModelStep:
        last = request.messages[-1]
        if last.role == "user":
            return ModelStep.tool_call("scribe", {"task": last.text})
        return ModelStep.text("noted")

    def lead_turn(request: ModelRequest) -> ModelStep:
        last, word = request.messages[-1], _user_texts(request)[-1]
        if last.role == "user":
            return ModelStep.tool_call("helper", {"task": word})
        if word == "stop" and not any(r.name == "hold" for r in last.tool_results):
            return ModelStep.tool_call("hold", {})
        return ModelStep.text(f"done {word}")

    def scripted(name: str, respond: Any) -> Any:
        model = ScriptedModel([ModelStep(respond=respond)], loop=True)
        return ReActAgent.builder().name(name).model(model).state_store(store)

    scribe = scripted("scribe", scribe_turn).build()
    helper = scripted("helper", helper_turn).tools(scribe.as_tool()).build()
    lead = scripted("lead", lead_turn).tools(hold, helper.as_tool()).build()
    await lead.call("one", ctx=RuntimeContext("u", "s"))
    found = {sid: (await store.load("u", sid))[0] for sid in ("s/helper", "s/helper/scribe")}
    stopped = asyncio.create_task(lead.call("stop", ctx=RuntimeContext("u", "s")))
    await asyncio.wait_for(holding.wait(), 5)  # the helper's call (and the scribe's in it) ended
    await lead.call("two", ctx=RuntimeContext("u", "s"), multitask_strategy="rollback")
    assert (await asyncio.wait_for(stopped, 5)).metadata["rolled_back"]
    for sid, before in found.items():
        state, _ = await store.load("u", sid)
        assert before is not None and state is not None
        assert [m.text for m in state.context if m.role == "user"] == ["one", "two"], sid
        assert state.context[:len(before.context)] == before.context


async def test_a_shared_session_saved_by_another_conversation_since_keeps_what_it_has(
        store: AgentStateStore, caplog: pytest.LogCaptureFixture) -> None:
    holding, release = asyncio.Event(), asyncio.Event()
    lead = _tree(store, holding, release, session="shared")
    stopped = asyncio.create_task(lead.call("hold after", ctx=RuntimeContext("u", "s1")))
    await asyncio.wait_for(holding.wait(), 5)
    await lead.call("other", ctx=RuntimeContext("u", "s2"))  # the shared helper remembers this call too
    await lead.call("two", ctx=RuntimeContext("u", "s1"), multitask_strategy="rollback")
    assert (await asyncio.wait_for(stopped, 5)).metadata["rolled_back"]
    state, _ = await store.load("u", "helper")
    assert state is not None
    # Taking the rolled-back call out would take the other conversation's with it: it stays.
    assert [m.text for m in state.context if m.role == "user"] == [
        "remember hold after", "remember other", "remember two"]
    assert "keeps the rolled-back turn" in caplog.text
