"""A schedule firing every second across three ``agentscope-py serve --redis`` processes on one
redis-server: each tick is fired exactly once across them, and when one process is SIGKILLed
midway the other two carry on, tick after tick. Evidence from Redis itself: every run the log
holds of the schedule (each in the session of its own tick, ``{schedule_id}-{tick}``), whichever
process started it."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from .test_cli_serve import Serving

pytestmark = pytest.mark.timeout(120)

AGENTS = '''
from agentscope_py import ModelStep, ReActAgent, ScriptedModel


def build():
    return ReActAgent.builder().model(ScriptedModel([ModelStep.text("tick")], loop=True)).build()
'''


@pytest.fixture
def three(tmp_path: Path, redis_url: str, redis_prefix: str) -> Iterator[list[Serving]]:
    (tmp_path / "tick_agents.py").write_text(textwrap.dedent(AGENTS))
    servers = [Serving("tick_agents:build", "--redis", redis_url, "--redis-prefix", redis_prefix,
                       "--run-lease", "3", "--log-level", "warning", cwd=tmp_path,
                       env={"PYTHONPATH": os.getcwd()}) for _ in range(3)]
    try:
        for s in servers:
            s.wait_for_url()
        yield servers
    finally:
        for s in servers:
            if s.proc.poll() is None:
                print(f"serve on {s.port}:", s.stop())


def runs_of(client: redis.Redis, prefix: str, schedule_id: str) -> Counter[int]:
    """How many runs the shared run log holds for each tick of the schedule."""
    ticks: Counter[int] = Counter()
    for key in client.scan_iter(f"{prefix}:run:*"):
        if key.endswith(b":log"):
            continue
        session = client.hget(key, "session")
        if session is not None and session.decode().startswith(schedule_id + "-"):
            ticks[int(session.decode().rsplit("-", 1)[1])] += 1
    return ticks


def test_each_tick_fires_once_across_processes_and_survives_a_sigkill(three: list[Serving], redis_url: str,
                                                                        redis_prefix: str) -> None:
    made = httpx.post(f"{three[0].url}/v1/schedules", timeout=10,
                      json={"cron": "* * * * * *", "thread": "new", "input": "tick"})
    assert made.status_code == 201, made.text
    sid = made.json()["schedule_id"]
    # Every process lists it (one store), whichever created it.
    for s in three:
        listed = httpx.get(f"{s.url}/v1/schedules", timeout=10).json()["schedules"]
        assert [x["schedule_id"] for x in listed] == [sid]
    client = redis.Redis.from_url(redis_url)
    time.sleep(5)
    killed_at = time.time()
    three[1].proc.send_signal(signal.SIGKILL)
    three[1].proc.wait(10)
    time.sleep(5)
    gone = httpx.delete(f"{three[2].url}/v1/schedules/{sid}", timeout=10)
    assert gone.json()["deleted"] is True
    time.sleep(1.5)  # a tick claimed just before the delete has started its run
    ticks = runs_of(client, redis_prefix, sid)
    assert ticks, "no tick fired"
    assert all(n == 1 for n in ticks.values()), f"a tick fired twice: {ticks}"
    first, last = min(ticks), max(ticks)
    assert sorted(ticks) == list(range(first, last + 1)), f"a tick did not fire: {sorted(ticks)}"
    assert last - first >= 8, sorted(ticks)
    assert last >= killed_at + 3, "the others did not carry on after the kill"
    # A schedule deleted fires no more.
    time.sleep(1.5)
    assert max(runs_of(client, redis_prefix, sid)) == last
