"""Double texting across two ``agentscope-py serve`` processes sharing their sessions — on one
redis-server (``--redis``), or in one SQLite file (each process with a run log of its own): the
first input goes to one process, the second, at a random moment of the first's run, to the OTHER
one (which does not run the session's run). For each strategy: no orphan tool call, no user
message lost or duplicated (a refused or rolled-back one is absent, and its client was told),
every block of both streams closed, and the session usable afterwards."""

from __future__ import annotations

import asyncio
import os
import random
import textwrap
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_multitask import check_session

from agentscope_py.agent import RedisStateStore
from agentscope_py.agent.sqlite_store import SqliteStateStore

from .test_cli_serve import Serving, processes
from .test_runs import parse

pytestmark = pytest.mark.timeout(240)

TIMINGS = 30
AGENTS = '''
import asyncio
import os
import uuid

from agentscope_py import ReActAgent, tool
from agentscope_py.message import ToolResultBlock
from agentscope_py.model.base import ChatChunk, ToolCallChunk


class TurnModel:
    """After a user message, a call of ``work`` (its arguments in two pieces); after its
    result, three streamed pieces of text."""

    name = "turns"

    async def stream(self, request):
        await asyncio.sleep(0.01)
        if any(isinstance(b, ToolResultBlock) for b in request.messages[-1].content):
            for piece in ("done ", "with ", "it"):
                await asyncio.sleep(0.01)
                yield ChatChunk(text=piece)
            yield ChatChunk(finish_reason="stop")
            return
        yield ChatChunk(tool_call=ToolCallChunk(index=0, id=f"call-{uuid.uuid4().hex[:8]}", name="work",
                                                arguments='{"n": '))
        await asyncio.sleep(0.01)
        yield ChatChunk(tool_call=ToolCallChunk(index=0, arguments="3}"))
        yield ChatChunk(finish_reason="tool_calls")


@tool
async def work(n: int):
    """Work for ``n`` steps, streaming each."""
    for i in range(n):
        await asyncio.sleep(0.02)
        yield f"step {i} "


def build():
    # (with --redis and no store of its own, serve gives the agent a RedisStateStore)
    path = os.environ.get("TURN_SQLITE")
    store = None
    if path:
        from agentscope_py.agent.sqlite_store import SqliteStateStore

        store = SqliteStateStore(path)
    return ReActAgent(model=TurnModel(), tools=[work], state_store=store)
'''
KINDS = ("text_block", "thinking_block", "data_block", "tool_call", "tool_result", "model_call", "agent")


@pytest.fixture(params=[pytest.param("redis", marks=pytest.mark.redis), "sqlite"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def two(tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> Iterator[list[Serving]]:
    (tmp_path / "turn_agents.py").write_text(textwrap.dedent(AGENTS))
    # Their default is "reject" (`--multitask-strategy`): a request without a strategy is refused.
    shared: list[str] = []
    env = {"PYTHONPATH": os.getcwd()}
    if backend == "redis":
        shared = ["--redis", request.getfixturevalue("redis_url"), "--redis-prefix",
                  request.getfixturevalue("redis_prefix"), "--run-lease", "3"]
    else:
        env["TURN_SQLITE"] = str(tmp_path / "sessions.db")
    with processes(2, "turn_agents:build", *shared, "--log-level", "warning", "--multitask-strategy", "reject",
                   cwd=tmp_path, env=env) as servers:
        yield servers


@pytest.fixture
async def store(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """The sessions the processes share, as the test reads them."""
    shared: Any
    if backend == "redis":
        shared = RedisStateStore(request.getfixturevalue("redis_url"), prefix=request.getfixturevalue("redis_prefix"))
    else:
        shared = SqliteStateStore(tmp_path / "sessions.db")
    yield shared
    await shared.close()


def events(body: str) -> list[dict[str, Any]]:
    return [d for _, _, d in parse(body)]


def unbalanced(evs: list[dict[str, Any]]) -> dict[str, int]:
    open_: Counter[tuple[str, str]] = Counter()
    for e in evs:
        kind, _, edge = e.get("type", "").rpartition("_")
        if kind in KINDS and edge in ("start", "end"):
            ident = e.get("block_id") or e.get("tool_call_id") or e["reply_id"]
            open_[(kind, ident)] += 1 if edge == "start" else -1
            assert open_[(kind, ident)] in (0, 1), [x.get("type") for x in evs]
    return {f"{k}:{i}": v for (k, i), v in open_.items() if v}


def result(evs: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((e["result"] for e in evs if e.get("type") == "agent_result"), None)


async def one_timing(client: httpx.AsyncClient, a: Serving, b: Serving, store: Any, strategy: str,
                     session: str, delay: float) -> str:
    first_task = asyncio.create_task(client.post(f"{a.url}/v1/runs", json={"session_id": session, "input": "first",
                                                                             "multitask_strategy": "enqueue"}))
    await asyncio.sleep(delay)
    body = {"session_id": session, "input": "second"}
    if strategy != "reject":  # (reject: the servers' default)
        body["multitask_strategy"] = strategy
    second = await client.post(f"{b.url}/v1/runs", json=body)
    first = await first_task
    assert first.status_code == 200
    one = events(first.text)
    assert not unbalanced(one)
    first_result = result(one)
    assert first_result is not None, one[-3:]
    state, _ = await store.load("default", session)
    assert state is not None
    check_session(state.context)
    assert state.pending_tool_calls == []
    texts = Counter(m.text for m in state.context if m.role == "user")
    if second.status_code == 409:
        assert strategy == "reject" and second.headers["retry-after"] and second.json()["type"] == "session_busy"
        assert texts == Counter({"first": 1}) and first_result["generate_reason"] == "model_stop"
        outcome = "refused"
    else:
        two = events(second.text)
        assert second.status_code == 200 and not unbalanced(two)
        refusal = next((e for e in two if e.get("code") == "session_busy"), None)
        if refusal is not None:  # refused at the gate, in the instant after the check
            assert strategy == "reject" and texts == Counter({"first": 1})
            return "refused in the stream"
        second_result = result(two)
        assert second_result is not None and second_result["generate_reason"] == "model_stop", two[-3:]
        if first_result["metadata"].get("rolled_back"):
            assert strategy == "rollback" and texts == Counter({"second": 1}), texts
            assert any(e.get("type") == "agent_end" and e["metadata"] == {"rolled_back": True} for e in one)
            outcome = "rolled back"
        else:
            assert texts == Counter({"first": 1, "second": 1}), texts
            if first_result["generate_reason"] == "interrupted":
                assert strategy in ("interrupt", "rollback")
                outcome = "interrupted"
            else:
                assert first_result["generate_reason"] == "model_stop"
                outcome = "after"
    third = await client.post(f"{b.url}/v1/runs", json={"session_id": session, "input": "third",
                                                        "multitask_strategy": "enqueue"})
    third_result = result(events(third.text))
    assert third_result is not None and third_result["generate_reason"] == "model_stop"
    return outcome


@pytest.mark.parametrize("strategy", ["reject", "enqueue", "interrupt", "rollback"])
async def test_a_second_input_through_the_other_process(two: list[Serving], store: Any, strategy: str) -> None:
    a, b = two
    rng = random.Random(f"processes-{strategy}")
    outcomes: Counter[str] = Counter()
    async with httpx.AsyncClient(timeout=30) as client:
        # Five sessions at a time: the timings are independent, and the test stays short.
        for batch in range(0, TIMINGS, 5):
            done = await asyncio.gather(*(one_timing(client, a, b, store, strategy, f"{strategy}-{i}",
                                                     rng.uniform(0.0, 0.3)) for i in range(batch, batch + 5)))
            outcomes.update(done)
    print(f"{strategy}: {dict(outcomes)}")
    expected = {"reject": {"refused", "after"}, "enqueue": {"after"}, "interrupt": {"interrupted", "after"},
                "rollback": {"rolled back"}}[strategy]
    assert expected <= set(outcomes), outcomes
