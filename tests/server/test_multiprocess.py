"""Several ``agentscope-py serve --redis`` processes, one real redis-server: sessions, run logs and
interrupts are shared; a client that reconnects through another process resumes the same stream;
a process killed mid-run leaves the run marked lost (its lease expires), never a hanging client."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentscope_py.server._runs.runlog import RESERVE

from .test_cli_serve import Serving, processes
from .test_runs import parse, read_some, text_of

AGENTS = '''
from agentscope_py import ModelStep, ReActAgent, ScriptedModel

WORDS = [f"w{i} " for i in range(40)]


def _turn(request):
    turns = sum(1 for m in request.messages if m.role == "user")
    return ModelStep.text(f"turn {turns}: " + "".join(WORDS), chunks=41, delay=0.05)


def build() -> ReActAgent:
    model = ScriptedModel([ModelStep(respond=_turn)], name="slow", loop=True)
    return ReActAgent.builder().name("slow").model(model).build()
'''
TEXT = "".join(f"w{i} " for i in range(40))


@pytest.fixture
def two(tmp_path: Path, redis_url: str, redis_prefix: str) -> Iterator[list[Serving]]:
    (tmp_path / "slow_agents.py").write_text(textwrap.dedent(AGENTS))
    # A lease of 3 s: short, so a killed process's run is found lost quickly, but not so short that
    # a live process whose loop the loaded CI host stalls for a second looks dead (its run then
    # marked lost under the other tests).
    with processes(2, "slow_agents:build", "--redis", redis_url, "--redis-prefix", redis_prefix,
                   "--run-lease", "3", "--log-level", "warning", cwd=tmp_path,
                   env={"PYTHONPATH": os.getcwd()}) as servers:
        yield servers


async def start_detached(client: httpx.AsyncClient, server: Serving, session: str) -> str:
    """A detached run on ``server``, left after its first frames; its id (once a batch reached Redis)."""
    async with client.stream("POST", f"{server.url}/v1/runs",
                             json={"session_id": session, "input": "hi", "detach": True}) as r:
        run_id = r.headers["x-run-id"]
        await read_some(r, 4)
    await asyncio.sleep(0.1)
    return run_id


async def test_a_client_resumes_through_another_process_and_sessions_are_shared(two: list[Serving]) -> None:
    a, b = two
    async with asyncio.timeout(45), httpx.AsyncClient(timeout=30) as client:  # a hang fails at its await
        async with client.stream("POST", f"{a.url}/v1/runs",
                                 json={"session_id": "mp-1", "input": "hi", "detach": True}) as r:
            run_id = r.headers["x-run-id"]
            seen = parse(await read_some(r, 6))
        # Through the other process, while the run goes on in the first one.
        rest = await client.get(f"{b.url}/v1/runs/{run_id}/events", headers={"Last-Event-ID": str(seen[-1][0])})
        whole = seen + parse(rest.text)
        assert [i for i, _, _ in whole] == list(range(1, len(whole) + 1))  # nothing lost, nothing twice
        assert text_of(whole) == "turn 1: " + TEXT and whole[-1][2]["type"] == "agent_end"
        # The session lives in Redis: the next turn, through the other process, remembers the first.
        second = await client.post(f"{b.url}/v1/runs", json={"session_id": "mp-1", "input": "again"})
        assert text_of(parse(second.text)) == "turn 2: " + TEXT


async def test_an_interrupt_through_another_process_stops_the_run(two: list[Serving]) -> None:
    a, b = two
    async with httpx.AsyncClient(timeout=30) as client:
        run_id = await start_detached(client, a, "mp-2")  # a batch reaches Redis
        answer = await client.post(f"{b.url}/v1/runs/{run_id}/interrupt", json={})
        assert answer.json() == {"run_id": run_id, "interrupted": True}
        frames = parse((await client.get(f"{b.url}/v1/runs/{run_id}/events")).text)
    result = next(d for _, _, d in frames if d["type"] == "agent_result")
    assert result["result"]["generate_reason"] == "interrupted"
    assert len(text_of(frames)) < len("turn 1: " + TEXT)


async def test_a_process_killed_mid_run_leaves_the_run_lost_not_hanging(two: list[Serving]) -> None:
    a, b = two
    async with httpx.AsyncClient(timeout=30) as client:
        run_id = await start_detached(client, a, "mp-3")
        # A client follows it through B; then A dies without a word.
        follower = asyncio.create_task(client.get(f"{b.url}/v1/runs/{run_id}/events"))
        await asyncio.sleep(0.3)
        a.proc.send_signal(signal.SIGKILL)
        started = time.monotonic()
        async with asyncio.timeout(15):
            body = (await follower).text
        waited = time.monotonic() - started
        frames = parse(body)
        assert frames[-1][1] == "error" and frames[-1][2]["code"] == "RunLost"
        # The frames the log holds, then RunLost numbered past every id A may have sent its clients.
        ids = [i for i, _, _ in frames]
        assert ids[:-1] == list(range(1, len(frames))) and ids[-1] > ids[-2] + RESERVE
        assert f"holds the events up to id {ids[-2]};" in frames[-1][2]["message"]  # what may be missing
        assert waited < 12  # lease 3 s + a poll (~2 s): the client is told, not left waiting
        # A client that comes later hears the same ending.
        later = parse((await client.get(f"{b.url}/v1/runs/{run_id}/events")).text)
        assert later == frames


def test_serve_refuses_a_bad_redis_url(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "agentscope_py.cli", "serve", "--redis", "nope://x", "--port", "0"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and "redis" in out.stderr.lower(), out.stderr


async def test_users_are_scoped_across_processes(live: Any, redis_url: str, redis_prefix: str) -> None:
    """Two servers on one Redis, each with ``authenticate``: bob, through either, never gets
    alice's run (her run id names none of his: his own empty thread, no events of hers), cannot
    stop it (404); alice resumes it through the other one, in AG-UI too."""
    from agentscope_py import ModelStep, ReActAgent, ScriptedModel
    from agentscope_py.server import RedisRunLog, create_app

    from .conftest import run_input, user
    from .test_runs import by_token

    def app() -> Any:
        model = ScriptedModel([ModelStep.text(TEXT, chunks=40, delay=0.03)], name="m", loop=True)
        agent = ReActAgent.builder().model(model).build()
        return create_app(agent, authenticate=by_token, run_log=RedisRunLog(redis_url, prefix=redis_prefix))

    a, b = live(app()), live(app())
    alice, bob = {"Authorization": "Bearer alice-token"}, {"Authorization": "Bearer bob-token"}
    body = run_input("t-alice", user("hi"), run=f"{redis_prefix}-run", forwardedProps={"detach": True})
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", f"{a.url}/agui", json=body, headers=alice) as r:
            seen = parse(await read_some(r, 5))
        await asyncio.sleep(0.1)
        run_id = body["runId"]
        for server in (a, b):
            peek = await client.get(f"{server.url}/agui/runs/{run_id}/events?threadId=t-alice", headers=bob)
            assert peek.status_code == 200 and "w1" not in peek.text
            assert [e["messages"] for _, _, e in parse(peek.text) if e["type"] == "MESSAGES_SNAPSHOT"] == [[]]
            stop = await client.post(f"{server.url}/v1/runs/{run_id}/interrupt", json={}, headers=bob)
            assert stop.status_code == 404
        rest = await client.get(f"{b.url}/agui/runs/{run_id}/events?threadId=t-alice",
                                headers={**alice, "Last-Event-ID": str(seen[-1][0])})
    whole = seen + parse(rest.text)
    assert [i for i, _, _ in whole] == list(range(1, len(whole) + 1))
    assert text_of(whole) == TEXT and whole[-1][2]["type"] == "RUN_FINISHED"
