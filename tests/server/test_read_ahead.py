"""The session's state the server reads before a run starts (for the 503 of a failing store, and
AG-UI's new input) is handed to the run, which then reads the store only when the session changed
in between: a save made meanwhile, by a run queued ahead or by any other writer, is never lost."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from agentscope_py import ModelStep, Msg, ReActAgent, RuntimeContext
from agentscope_py.agent import AgentState, InMemoryStateStore
from agentscope_py.agent.store import ConflictPolicy, read_ahead
from agentscope_py.model.base import ChatChunk, ModelRequest, ToolCallChunk
from agentscope_py.server import create_app

from .conftest import SlowTool, agui_events, run_input, scripted_agent, user

pytestmark = pytest.mark.timeout(60)


def count_reads(store: InMemoryStateStore) -> list[str]:
    """The sessions ``store`` reads from now on (``load`` and the server's read both go through
    ``_load_marked``)."""
    reads: list[str] = []
    read = store._load_marked

    def counted(user_id: str, session_id: str) -> tuple[AgentState | None, int, object]:
        reads.append(session_id)
        return read(user_id, session_id)

    store._load_marked = counted  # type: ignore[method-assign]
    return reads


async def memory(store: InMemoryStateStore, session: str, user_id: str = "default") -> list[tuple[str, str]]:
    state, _ = await store.load(user_id, session)
    assert state is not None
    return [(m.role, m.text) for m in state.context]


def test_an_agui_request_reads_the_session_once() -> None:
    store = InMemoryStateStore()
    agent = scripted_agent(ModelStep.text("one"), ModelStep.text("two"), state_store=store)
    with TestClient(create_app(agent)) as client:
        reads = count_reads(store)
        first = client.post("/agui", json=run_input("t", user("hi", id="u1"), run="r1"))
        assert len(reads) == 1
        # (an AG-UI client sends the whole conversation again)
        second = client.post("/agui", json=run_input("t", user("hi", id="u1"), {"id": "a1", "role": "assistant",
                                                                                "content": "one"},
                                                     user("again", id="u2"), run="r2"))
    assert agui_events(first.text)[-1]["type"] == "RUN_FINISHED"
    assert agui_events(second.text)[-1]["type"] == "RUN_FINISHED"
    assert reads == ["t", "t"]  # the server's read only: the runs took it
    assert asyncio.run(memory(store, "t")) == [("user", "hi"), ("assistant", "one"), ("user", "again"),
                                               ("assistant", "two")]


def test_a_native_request_reads_the_session_once() -> None:
    store = InMemoryStateStore()
    agent = scripted_agent(ModelStep.text("one"), state_store=store)
    with TestClient(create_app(agent)) as client:
        reads = count_reads(store)
        body = client.post("/v1/runs", json={"session_id": "s", "input": "hi"}).text
    assert '"agent_end"' in body
    assert reads == ["s"]
    assert asyncio.run(memory(store, "s")) == [("user", "hi"), ("assistant", "one")]


@pytest.mark.parametrize("policy", ["fail", "overwrite"])
async def test_a_save_between_the_read_and_the_run_is_kept(policy: ConflictPolicy) -> None:
    store = InMemoryStateStore(conflict_policy=policy, as_json=True)
    agent = scripted_agent(ModelStep.text("one"), ModelStep.text("two"), state_store=store)
    await agent.call("hi", ctx=RuntimeContext("u", "s"))
    ctx = RuntimeContext("u", "s")
    read, ahead = await read_ahead(store, "u", "s")
    assert read is not None and ahead is not None
    ahead.hand_to(ctx)
    other, version = await store.load("u", "s")  # another writer, after the server's read
    assert other is not None
    other.context.append(Msg.user("from elsewhere"))
    await store.save("u", "s", other, version)
    await agent.call("again", ctx=ctx)
    assert await memory(store, "s", "u") == [("user", "hi"), ("assistant", "one"), ("user", "from elsewhere"),
                                       ("user", "again"), ("assistant", "two")]


async def test_a_session_deleted_and_saved_again_in_between_is_read_again() -> None:
    # Its version is the one the server read (a deleted session starts again at 0): only the
    # store can tell that it changed.
    store = InMemoryStateStore(as_json=True)
    agent = scripted_agent(ModelStep.text("one"), ModelStep.text("two"), state_store=store)
    await agent.call("hi", ctx=RuntimeContext("u", "s"))
    ctx = RuntimeContext("u", "s")
    _, ahead = await read_ahead(store, "u", "s")
    assert ahead is not None and ahead.version == 1
    ahead.hand_to(ctx)
    await store.delete("u", "s")
    assert await store.save("u", "s", AgentState(user_id="u", session_id="s", context=[Msg.user("fresh")]), 0) == 1
    await agent.call("again", ctx=ctx)
    assert await memory(store, "s", "u") == [("user", "fresh"), ("user", "again"), ("assistant", "two")]


async def test_an_unchanged_session_is_taken_once() -> None:
    store = InMemoryStateStore(as_json=True)
    agent = scripted_agent(ModelStep.text("one"), ModelStep.text("two"), ModelStep.text("three"), state_store=store)
    await agent.call("hi", ctx=RuntimeContext("u", "s"))
    ctx = RuntimeContext("u", "s")
    _, ahead = await read_ahead(store, "u", "s")
    assert ahead is not None
    ahead.hand_to(ctx)
    reads = count_reads(store)
    await agent.call("again", ctx=ctx)
    assert reads == []  # the run took what the server read
    await agent.call("once more", ctx=ctx)  # the same context again: its run reads the store
    assert reads == ["s"]
    assert [text for _, text in await memory(store, "s", "u")] == ["hi", "one", "again", "two", "once more", "three"]


async def test_a_sub_agent_or_another_session_does_not_take_it() -> None:
    store = InMemoryStateStore()
    agent = scripted_agent(ModelStep.text("one"), state_store=store)
    ctx = RuntimeContext("u", "other")  # not the session that was read
    _, ahead = await read_ahead(store, "u", "s")
    assert ahead is not None
    ahead.hand_to(ctx)
    reads = count_reads(store)
    await agent.call("hi", ctx=ctx)
    assert reads == ["other"]
    assert await memory(store, "other", "u") == [("user", "hi"), ("assistant", "one")]


async def test_a_store_that_cannot_tell_is_read_by_the_run() -> None:
    class Subclass(InMemoryStateStore):
        pass

    state, ahead = await read_ahead(Subclass(), "u", "s")
    assert state is None and ahead is None


class ToolThenText:
    """After the user message ``first``, a call of the ``slow`` tool; then, and after anything
    else, the text ``done``."""

    name = "tool-then-text"

    async def stream(self, request: ModelRequest) -> Any:
        if request.messages[-1].text == "first":
            yield ChatChunk(tool_call=ToolCallChunk(index=0, id="call-1", name="slow", arguments="{}"))
            yield ChatChunk(finish_reason="tool_calls")
            return
        yield ChatChunk(text="done")
        yield ChatChunk(finish_reason="stop")


async def test_an_agui_input_queued_behind_a_run_of_its_thread_reads_what_that_run_saved(live: Any) -> None:
    # The second request reads the thread while the first runs; the first saves before the
    # second takes the thread: the second's run reads the store again, and keeps both turns.
    slow = SlowTool(seconds=1.0)
    store = InMemoryStateStore()
    agent = ReActAgent(model=ToolThenText(), tools=[slow.slow], state_store=store)
    server = live(create_app(agent))
    reads = count_reads(store)
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        first = asyncio.ensure_future(client.post("/agui", json=run_input("t", user("first", id="u1"), run="r1")))
        assert await asyncio.to_thread(slow.started.wait, 10)
        second = await client.post("/agui", json=run_input("t", user("second", id="u2"), run="r2"))
        first_body = (await first).text
    assert agui_events(first_body)[-1]["type"] == "RUN_FINISHED"
    assert agui_events(second.text)[-1]["type"] == "RUN_FINISHED", second.text
    assert slow.finished.is_set()
    assert reads == ["t", "t", "t"]  # the server's two reads, and the second run's own
    assert [(role, text) for role, text in await memory(store, "t") if text] == [
        ("user", "first"), ("assistant", "done"), ("user", "second"), ("assistant", "done")]
