"""No turn lost to a cancellation, over the real provider: a property test at random cut times.

The real `OpenAIChatModel` (its aiohttp client, the model call's own task) talks to
a loopback server speaking the OpenAI SSE wire; every turn asks a tool, then answers, the replies
spread over ~100 ms. Each case cancels its turn at a random time in 0–250 ms — the task running
``call()``, the task consuming ``stream()``, or the caller's own deadline around ``call()`` — so
the cut lands before the request, while it is sent, while the reply streams, while the tool runs,
while the checkpoint is written, or after the end. The invariant, for each case, as soon as the
cancelled call has returned: either the model was never asked, or the session's memory holds the
input followed by a closed turn (a reply, every tool call answered after it was made, nothing
pending). Many cases run at once on one loop, one server and one client, with each store.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import ReActAgent, RuntimeContext, Toolkit
from agentscope_py.agent import InMemoryStateStore, SqliteStateStore
from agentscope_py.agent.state import AgentState
from agentscope_py.model.openai import OpenAIChatModel

from .fakes import TurnServer, get_weather

pytestmark = pytest.mark.timeout(120)

# Cases per store (two stores): 2 x 700 = 1,400 cut times by default; CANCEL_CASES raises it.
CASES = int(os.environ.get("CANCEL_CASES", "700"))
AT_ONCE = 40  # cases in flight together
WINDOW = 0.25  # seconds: the cut lands in [0, WINDOW) after the call starts
MODES = ("call", "stream", "deadline")


@dataclass
class Case:
    question: str
    mode: str
    cut: float
    stored: AgentState | None = None
    ended: bool = False


async def _run_case(agent: ReActAgent, case: Case, session: str) -> None:
    ctx = RuntimeContext(user_id="u", session_id=session)

    async def consume() -> None:
        async for _ in agent.stream(case.question, ctx=ctx):
            pass

    async def with_deadline() -> None:
        async with asyncio.timeout(case.cut):
            await agent.call(case.question, ctx=ctx)

    if case.mode == "deadline":
        task = asyncio.create_task(with_deadline())
    else:
        task = asyncio.create_task(agent.call(case.question, ctx=ctx) if case.mode == "call" else consume())
        await asyncio.sleep(case.cut)
        task.cancel()
    done, _ = await asyncio.wait([task], timeout=10)
    case.ended = bool(done)
    if done and not task.cancelled():
        with contextlib.suppress(TimeoutError):  # the deadline's cut, or a turn that ended in time
            task.result()
    # Read at once: what the caller finds the moment its cancelled call has returned.
    case.stored, _ = await agent.state_store.load("u", session)


def _turn_problem(case: Case) -> str | None:
    """What is wrong with the stored turn of ``case`` (None: nothing)."""
    state = case.stored
    texts = [] if state is None else [m.text for m in state.context]
    if case.question not in texts:
        return f"the input is not in memory (memory: {texts})"
    assert state is not None
    turn = state.context[texts.index(case.question) + 1:]
    if not any(m.role == "assistant" for m in turn):
        return f"no reply after the input: {[(m.role, m.text) for m in turn]}"
    # Every call answered after it was made (an interrupted reply's calls get interrupted results).
    open_calls: set[str] = set()
    for m in turn:
        for result in m.tool_results:
            if result.id not in open_calls:
                return f"a result for {result.id}, which no open call made"
            open_calls.discard(result.id)
        open_calls.update(c.id for c in m.tool_calls)
    if open_calls:
        return f"tool calls {sorted(open_calls)} have no result"
    if state.pending_tool_calls:
        return f"calls left pending: {state.pending_tool_calls}"
    return None


@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
async def test_no_cancellation_at_any_time_loses_a_turn_the_model_was_asked_about(
    store_kind: str, tmp_path: Path
) -> None:
    server = TurnServer()
    await server.start()
    store: Any = InMemoryStateStore(as_json=True) if store_kind == "memory" else SqliteStateStore(tmp_path / "s.db")
    model = OpenAIChatModel("gpt-fake", base_url=f"{server.url}/v1", api_key="sk-test", timeout=10)
    agent = ReActAgent.builder().model(model).toolkit(Toolkit([get_weather])).state_store(store).build()
    rnd = random.Random(f"cancel-{store_kind}")
    cases = [Case(f"question {i}", MODES[i % len(MODES)], rnd.uniform(0, WINDOW)) for i in range(CASES)]
    started = time.monotonic()
    try:
        limit = asyncio.Semaphore(AT_ONCE)

        async def bounded(i: int, case: Case) -> None:
            async with limit:
                await _run_case(agent, case, f"s{i}")

        await asyncio.gather(*(bounded(i, c) for i, c in enumerate(cases)))
        await asyncio.sleep(0.2)  # requests still in the server's socket are read and recorded
        # No cut leaks a connection: what the server still has open is what the client's pool
        # keeps idle, at most one per stream that ran at once.
        assert server.open_connections <= AT_ONCE
    finally:
        await model.aclose()
        if store_kind == "sqlite":
            await store.close()
        await server.stop()
    elapsed = time.monotonic() - started
    stuck = [c for c in cases if not c.ended]
    assert not stuck, f"{len(stuck)} cancelled calls did not return within 10 s, e.g. {stuck[0]}"
    lost = []
    for case in cases:
        if case.question in server.asked or case.stored is not None:
            problem = _turn_problem(case)
            if problem is not None:
                lost.append(f"{case.mode} cut at {case.cut * 1000:.0f} ms: {problem}")
    asked = sum(c.question in server.asked for c in cases)
    assert not lost, f"{len(lost)} of {asked} asked turns broken ({elapsed:.1f} s):\n" + "\n".join(lost[:10])
    # The cut times covered the whole turn: some before the request, most after it.
    assert 0 < asked < len(cases)
