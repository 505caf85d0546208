"""Double texting over HTTP, in one serve process: a refused input is a 409 with ``Retry-After``
(native ``type`` and AG-UI ``RUN_ERROR`` code ``session_busy``), the strategy comes from the body
(AG-UI: ``forwardedProps``) or the server's default, and an interrupting input stops the running
run and runs right after it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentscope_py import BusyError, ReActAgent
from agentscope_py.agent import AgentState, AgentStateStore, InMemoryStateStore, SqliteStateStore
from agentscope_py.model.base import ChatChunk, ModelRequest, ToolCallChunk
from agentscope_py.server import create_app

from .conftest import SlowTool, agui_events, run_input, user
from .test_runs import parse, read_some

pytestmark = pytest.mark.timeout(60)


class SlowTurns:
    """After the user message ``first``, a call of the ``slow`` tool; after anything else, the text ``done``."""

    name = "slow-turns"

    def __init__(self) -> None:
        self.calls = 0

    async def stream(self, request: ModelRequest) -> AsyncIterator[ChatChunk]:
        if request.messages[-1].text != "first":
            yield ChatChunk(text="done")
            yield ChatChunk(finish_reason="stop")
            return
        self.calls += 1
        yield ChatChunk(tool_call=ToolCallChunk(index=0, id=f"call-{self.calls}", name="slow", arguments="{}"))
        yield ChatChunk(finish_reason="tool_calls")


def busy_agent(slow: SlowTool, **options: Any) -> ReActAgent:
    return ReActAgent(model=SlowTurns(), tools=[slow.slow], **options)


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> AgentStateStore:
    """The served agent's session store: the default, or a SQLite file."""
    return InMemoryStateStore() if request.param == "memory" else SqliteStateStore(tmp_path / "sessions.db")


async def start_first(client: httpx.AsyncClient, slow: SlowTool) -> str:
    """A detached run on session ``s`` that waits in its tool; its run id."""
    slow.started.clear()
    async with client.stream("POST", "/v1/runs", json={"session_id": "s", "input": "first", "detach": True}) as r:
        run_id = r.headers["x-run-id"]
        await read_some(r, 2)
    await asyncio.to_thread(slow.started.wait, 10)
    return run_id


async def test_a_rejected_input_is_a_409_with_retry_after_on_both_endpoints(live: Any, store: AgentStateStore) -> None:
    slow = SlowTool()
    server = live(create_app(busy_agent(slow, state_store=store)))
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        first = await start_first(client, slow)
        native = await client.post("/v1/runs", json={"session_id": "s", "input": "second",
                                                     "multitask_strategy": "reject"})
        agui = await client.post("/agui", json=run_input("s", user("second"), run="run-2",
                                                          forwardedProps={"multitask_strategy": "reject"}))
        async with client.stream("POST", "/v1/runs", json={"session_id": "other", "input": "hi",
                                                           "multitask_strategy": "reject"}) as other:
            pass  # (another session is not busy; leaving stops that run)
        await client.post(f"/v1/runs/{first}/interrupt", json={})
    assert native.status_code == 409 and native.headers["retry-after"] == "1"
    assert native.json()["type"] == "session_busy"
    assert "multitask_strategy='reject'" in native.json()["detail"]
    assert agui.status_code == 409 and agui.headers["retry-after"] == "1"
    assert agui.headers["content-type"].startswith("text/event-stream")
    events = agui_events(agui.text)
    assert [e["type"] for e in events] == ["RUN_STARTED", "RUN_ERROR"]
    assert events[1]["code"] == "session_busy" and "multitask_strategy='reject'" in events[1]["message"]
    assert other.status_code == 200


async def test_bad_strategies_are_422_and_the_server_default_applies(live: Any) -> None:
    slow = SlowTool()
    server = live(create_app(busy_agent(slow), multitask_strategy="reject"))
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        bad_native = await client.post("/v1/runs", json={"session_id": "s", "input": "x",
                                                         "multitask_strategy": "later"})
        bad_agui = await client.post("/agui", json=run_input("s", user("x"), run="run-9",
                                                              forwardedProps={"multitask_strategy": "later"}))
        first = await start_first(client, slow)
        defaulted = await client.post("/v1/runs", json={"session_id": "s", "input": "second"})
        await client.post(f"/v1/runs/{first}/interrupt", json={})
    assert bad_native.status_code == 422 and "multitask_strategy" in bad_native.text
    assert bad_agui.status_code == 422 and "forwardedProps.multitask_strategy: give one of" in bad_agui.text
    assert defaulted.status_code == 409


async def test_an_interrupting_input_stops_the_run_and_runs_next(live: Any, store: AgentStateStore) -> None:
    slow = SlowTool()
    agent = busy_agent(slow, state_store=store)
    server = live(create_app(agent))
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        first = await start_first(client, slow)
        second = parse((await client.post("/v1/runs", json={"session_id": "s", "input": "second",
                                                            "multitask_strategy": "rollback"})).text)
        first_frames = parse((await client.get(f"/v1/runs/{first}/events")).text)
        interrupting = await start_first(client, slow)  # again, then stopped by an "interrupt" input
        third = parse((await client.post("/v1/runs", json={"session_id": "s", "input": "third",
                                                           "multitask_strategy": "interrupt"})).text)
        interrupted = parse((await client.get(f"/v1/runs/{interrupting}/events")).text)
    three = next(d for _, _, d in third if d["type"] == "agent_result")["result"]
    assert three["generate_reason"] == "model_stop"
    stopped = next(d for _, _, d in interrupted if d["type"] == "agent_result")["result"]
    assert stopped["generate_reason"] == "interrupted" and "rolled_back" not in stopped["metadata"]
    one = next(d for _, _, d in first_frames if d["type"] == "agent_result")["result"]
    assert one["generate_reason"] == "interrupted" and one["metadata"]["rolled_back"] is True
    end = next(d for _, _, d in first_frames if d["type"] == "agent_end")
    assert end["metadata"] == {"rolled_back": True}
    two = next(d for _, _, d in second if d["type"] == "agent_result")["result"]
    assert two["generate_reason"] == "model_stop" and slow.cancelled.is_set()
    state, _ = await agent.state_store.load("default", "s")
    assert state is not None
    texts = [m.text for m in state.context if m.role == "user"]
    assert texts == ["second", "first", "third"]  # the first turn was taken back, the interrupted one kept


class LockedElsewhere:
    """A store whose cross-process session lock another process holds, and which cannot say by
    whom (no ``session_holder``): the server's check lets a rejecting input through, and the
    agent's gate refuses it when it tries the lock."""

    def __init__(self) -> None:
        self.states = InMemoryStateStore()

    async def load(self, user_id: str, session_id: str) -> tuple[AgentState | None, int]:
        return await self.states.load(user_id, session_id)

    async def save(self, user_id: str, session_id: str, state: AgentState, expected_version: int) -> int:
        return await self.states.save(user_id, session_id, state, expected_version)

    @contextlib.asynccontextmanager
    async def session_lock(self, user_id: str, session_id: str, *, wait: bool = True,
                           holder: str = "") -> AsyncIterator[None]:
        if not wait:
            raise BusyError(user_id, session_id)
        yield


async def test_a_refusal_at_the_gate_reaches_the_stream_with_the_same_code(live: Any) -> None:
    agent = ReActAgent(model=SlowTurns(), state_store=LockedElsewhere())
    server = live(create_app(agent))
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        native = await client.post("/v1/runs", json={"session_id": "s", "input": "hi", "multitask_strategy": "reject"})
        agui = await client.post("/agui", json=run_input("s", user("hi"), run="run-3",
                                                          forwardedProps={"multitask_strategy": "reject"}))
        waits = await client.post("/v1/runs", json={"session_id": "s", "input": "hi"})  # enqueue: takes the lock
    frames = parse(native.text)
    assert native.status_code == 200 and [e for _, e, _ in frames][-1] == "error"
    assert frames[-1][2]["code"] == "session_busy" and "refuses to wait" in frames[-1][2]["message"]
    ends = [d for _, _, d in frames if d.get("type") == "agent_end"]
    assert len(ends) == 1 and ends[0]["error"].startswith("BusyError")  # the run's own bracket closed
    events = agui_events(agui.text)
    assert events[-1]["type"] == "RUN_ERROR" and events[-1]["code"] == "session_busy"
    assert next(d for _, _, d in parse(waits.text) if d.get("type") == "agent_result")["result"]["generate_reason"] \
        == "model_stop"
