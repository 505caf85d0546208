"""Clients that leave at random frames of served runs, over a real uvicorn, in both vocabularies,
detached or not. Whatever frame a client leaves at:

- the run's log is a whole stream: ids 1, 2, ... without a gap, every start closed, and one last
  frame, the run's end or (a run tied to its client, cut) ``RunCancelled``; the AG-UI logs pass the
  official client's ``verifyEvents``;
- a detached run goes on to its end; a run tied to its client stops;
- the session takes the next run, and every tool call the model sees then has its one result;

with the run log in this process's memory, and in Redis (shared: it gets the frames in batches).

Each case's cut point comes from a seeded generator (``CUT_SEED``, ``CUT_CASES`` to widen it)."""

from __future__ import annotations

import asyncio
import os
import random
import uuid
from collections import Counter
from typing import Any

import httpx
import pytest

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, Toolkit, tool
from agentscope_py.model.base import ModelRequest
from agentscope_py.server import create_app

from .conftest import run_input, user
from .test_agui_client import client_modules  # noqa: F401  (a fixture `verify` uses)
from .test_agui_nested import node, verify  # noqa: F401
from .test_multitask_processes import unbalanced
from .test_runs import parse

CASES = int(os.environ.get("CUT_CASES", "24"))
SEED = int(os.environ.get("CUT_SEED", "7201"))

Frames = list[tuple[int | None, str, dict[str, Any]]]


@tool
async def add_slowly(a: int, b: int) -> str:
    """Add two integers, taking a moment.

    Args:
        a: the first
        b: the second
    """
    await asyncio.sleep(0.02)
    return str(a + b)


def _step(request: ModelRequest) -> ModelStep:
    """A tool call (with thinking and text before it) for a user's turn; the answer after its result."""
    if request.messages[-1].tool_results:
        return ModelStep.text("The sum is three.", chunks=5, delay=0.003)
    return ModelStep(thinking="Adding is a tool's job.", text="Let me add.",
                     tool_calls=[ModelStep.tool_call("add_slowly", {"a": 1, "b": 2}).tool_calls[0]],
                     chunks=4, delay=0.003)


def _agent() -> ReActAgent:
    model = ScriptedModel([ModelStep(respond=_step)], name="cuts", loop=True)
    return ReActAgent.builder().name("cuts").model(model).toolkit(Toolkit([add_slowly])).build()


async def _start(client: httpx.AsyncClient, kind: str, session: str, detach: bool, cut: int) -> tuple[str, Frames]:
    """Start a run, read ``cut`` frames of it (or all), leave; its run id and what was read."""
    if kind == "agui":
        body = run_input(session, user("add 1 and 2", id=f"{session}-u"), run=f"{session}-r",
                         forwardedProps={"detach": detach})
        request = client.stream("POST", "/agui", json=body)
    else:
        request = client.stream("POST", "/v1/runs", json={"session_id": session, "input": "add 1 and 2",
                                                          "detach": detach})
    body = ""
    async with request as response:
        assert response.status_code == 200
        run_id = response.headers["x-run-id"]
        async with asyncio.timeout(10):
            async for text in response.aiter_text():
                body += text
                if body.count("\n\n") >= cut:
                    break
    # Left here: the connection closes with the response, mid-stream unless the run had ended.
    return run_id, parse(body)[:cut]


async def _log(client: httpx.AsyncClient, kind: str, session: str, run_id: str) -> Frames:
    """The run's whole log, read to its end (it ends when the run has)."""
    url = f"/agui/runs/{run_id}/events?threadId={session}" if kind == "agui" else f"/v1/runs/{run_id}/events"
    async with asyncio.timeout(10):
        response = await client.get(url)
    assert response.status_code == 200
    return parse(response.text)


def _answered(request: ModelRequest) -> None:
    """Every tool call the model is shown has exactly one result."""
    calls = Counter(c.id for m in request.messages for c in m.tool_calls)
    results = Counter(r.id for m in request.messages for r in m.tool_results)
    assert calls == results, f"calls {dict(calls)} against results {dict(results)}"


@pytest.mark.parametrize("held", ["memory", "redis"])
async def test_a_client_leaving_at_any_frame_leaves_a_whole_log_and_a_free_session(
        live: Any, verify: Any, held: str, request: pytest.FixtureRequest) -> None:  # noqa: F811
    agent = _agent()
    if held == "redis":  # a shared log: frames reach it in batches while the run lasts
        from agentscope_py.server import RedisRunLog

        run_log: Any = RedisRunLog(request.getfixturevalue("redis_url"), prefix=f"cuts-{uuid.uuid4().hex}")
    else:
        run_log = None
    server = live(create_app(agent, run_log=run_log))
    rng = random.Random(SEED)
    agui_logs: list[tuple[str, list[dict[str, Any]]]] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        # A whole run of each vocabulary first: how many frames a cut may land in.
        totals = {}
        for kind in ("agui", "native"):
            run_id, _ = await _start(client, kind, f"whole-{kind}", False, 1_000)
            totals[kind] = len(await _log(client, kind, f"whole-{kind}", run_id))
        for case in range(CASES):
            kind = rng.choice(("agui", "native"))
            detach = rng.random() < 0.5
            cut = rng.randint(1, totals[kind] + 1)
            session = f"s{case}"
            what = f"case {case} (seed {SEED}): {kind}, detach={detach}, cut after {cut} of {totals[kind]} frames"
            run_id, seen = await _start(client, kind, session, detach, cut)
            log = await _log(client, kind, session, run_id)
            ids = [i for i, _, _ in log]
            assert ids == list(range(1, len(ids) + 1)), what
            if seen:
                assert log[:len(seen)] == seen, what  # what the client read is the log's start
            last = log[-1]
            ended = last[2].get("type") in ("RUN_FINISHED", "agent_end")
            cancelled = last[2].get("code") == "RunCancelled" and (last[1] == "error" or last[2].get("type") == "RUN_ERROR")
            assert ended or cancelled, f"{what}: the log ends with {last}"
            if detach or cut >= totals[kind]:
                assert ended, f"{what}: a run its client did not stop ended with {last}"
            if kind == "agui":
                agui_logs.append((what, [data for _, _, data in log]))
            else:
                # Every start has its end (the run's own `agent_start` is ended by the error frame).
                left = {k: v for k, v in unbalanced([data for _, _, data in log]).items() if not k.startswith("agent:")}
                assert left == {}, f"{what}: never closed: {left}"
            # The session takes the next run (queued behind whatever is left of this one).
            if kind == "agui":
                body = run_input(session, user("add 1 and 2", id=f"{session}-u"), user("again", id=f"{session}-u2"),
                                 run=f"{session}-next", forwardedProps={"multitask_strategy": "enqueue"})
                async with asyncio.timeout(10):
                    after = parse((await client.post("/agui", json=body)).text)
            else:
                async with asyncio.timeout(10):
                    after = parse((await client.post("/v1/runs", json={
                        "session_id": session, "input": "again", "multitask_strategy": "enqueue"})).text)
            assert after[-1][2].get("type") in ("RUN_FINISHED", "agent_end"), f"{what}: the next run: {after[-1]}"
            model = agent.model
            assert isinstance(model, ScriptedModel)
            _answered(model.requests[-1])
    verdicts = verify(*(events for _, events in agui_logs))
    assert [(what, verdict) for (what, _), verdict in zip(agui_logs, verdicts, strict=True) if verdict != "ok"] == []
