"""A schedule firing every second across three ``agentscope-py serve --redis`` processes on one
redis-server: each tick is fired exactly once across them, and when one process is SIGKILLed
midway the other two carry on, tick after tick; a process SIGKILLed right after claiming a tick
(before starting its run) does not lose it: another takes the claim over once its lease is up.
Evidence from Redis itself: every run the log holds of the schedule (each in the session of its
own tick, ``{schedule_id}-{tick}``), whichever process started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from .test_cli_serve import Serving, _free_port, processes

pytestmark = pytest.mark.timeout(120)

AGENTS = '''
from agentscope_py import ModelStep, ReActAgent, ScriptedModel


def build():
    return ReActAgent.builder().model(ScriptedModel([ModelStep.text("tick")], loop=True)).build()
'''


@pytest.fixture
def three(tmp_path: Path, redis_url: str, redis_prefix: str) -> Iterator[list[Serving]]:
    (tmp_path / "tick_agents.py").write_text(textwrap.dedent(AGENTS))
    with processes(3, "tick_agents:build", "--redis", redis_url, "--redis-prefix", redis_prefix,
                   "--run-lease", "3", "--log-level", "warning", cwd=tmp_path,
                   env={"PYTHONPATH": os.getcwd()}) as servers:
        yield servers


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


# A serve process on the same Redis whose schedule store SIGKILLs the process the moment a claim
# of a tick to fire succeeds (after printing the tick): the claim is in Redis, the run never starts.
CLAIM_THEN_DIE = '''
import os
import signal
import sys

from agentscope_py.server import RedisRunLog, serve
from agentscope_py.server._schedules.store_redis import RedisScheduleStore
from tick_agents import build

url, prefix, port = sys.argv[1], sys.argv[2], int(sys.argv[3])


class ClaimThenDie(RedisScheduleStore):
    async def claim(self, schedule_id, claim, *args, **kwargs):
        claimed = await super().claim(schedule_id, claim, *args, **kwargs)
        if claimed and kwargs.get("fires", True):
            print(f"claimed {getattr(claim, 'tick', claim)}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return claimed


run_log = RedisRunLog(url, prefix=prefix, lease=2.0)
serve(build, port=port, app_options={"run_log": run_log,
                                     "schedule_store": ClaimThenDie(url, prefix=prefix)})
'''


class ClaimThenDieServing(Serving):
    """`CLAIM_THEN_DIE` run as a process of its own."""

    def __init__(self, cwd: Path, redis_url: str, prefix: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "claim_then_die.py", redis_url, prefix, str(self.port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.getcwd()})
        self.lines = []

    def claimed(self, timeout: float) -> int:
        """The tick it claimed before it died."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip("\n"))
            if line.startswith("claimed "):
                return int(line.split()[1])
        raise AssertionError(f"it claimed no tick: {self.lines}")


def test_a_tick_claimed_by_a_process_killed_before_its_run_runs_once_elsewhere(
        tmp_path: Path, redis_url: str, redis_prefix: str) -> None:
    """Two ``serve --redis`` processes and one that SIGKILLs itself right after claiming a tick,
    all with a lease of 2 s, a schedule every second: the tick the killed process claimed runs
    exactly once, started by one of the others under the tick's run id once the lease is up, and
    ``GET`` shows it; every other tick runs once too."""
    (tmp_path / "tick_agents.py").write_text(textwrap.dedent(AGENTS))
    (tmp_path / "claim_then_die.py").write_text(textwrap.dedent(CLAIM_THEN_DIE))
    dying = ClaimThenDieServing(tmp_path, redis_url, redis_prefix)
    others = [Serving("tick_agents:build", "--redis", redis_url, "--redis-prefix", redis_prefix,
                      "--run-lease", "2", "--log-level", "warning", cwd=tmp_path,
                      env={"PYTHONPATH": os.getcwd()}) for _ in range(2)]
    try:
        dying.wait_for_url()
        # Created through the dying process as soon as it serves: it fires the next tick at once
        # (the others, still starting, race it for later ticks only).
        made = httpx.post(f"{dying.url}/v1/schedules", timeout=10,
                          json={"cron": "* * * * * *", "thread": "new", "input": "tick"})
        assert made.status_code == 201, made.text
        sid = made.json()["schedule_id"]
        for s in others:
            s.wait_for_url()
        killed = dying.claimed(timeout=20)
        assert dying.proc.wait(10) == -signal.SIGKILL
        time.sleep(4)  # the lease (2 s) lapses, and a pass of another process takes the claim over
        shown = httpx.get(f"{others[1].url}/v1/schedules/{sid}", timeout=10).json()["recent_runs"]
        [entry] = [r for r in shown if r["tick"] == killed]
        assert entry["run_id"] and entry["error"] is None, entry
        client = redis.Redis.from_url(redis_url)
        record = client.hgetall(f"{redis_prefix}:run:{entry['run_id']}")
        assert record[b"session"].decode() == f"{sid}-{killed}" and record[b"status"] == b"finished", record
        gone = httpx.delete(f"{others[1].url}/v1/schedules/{sid}", timeout=10)
        assert gone.json()["deleted"] is True
        time.sleep(1.5)  # a tick claimed just before the delete has started its run
        ticks = runs_of(client, redis_prefix, sid)
        assert ticks[killed] == 1, f"the tick claimed by the killed process ran {ticks[killed]} times"
        assert all(n == 1 for n in ticks.values()), f"a tick fired twice: {ticks}"
        first, last = min(ticks), max(ticks)
        assert sorted(ticks) == list(range(first, last + 1)), f"a tick did not fire: {sorted(ticks)}"
    finally:
        for s in others:
            if s.proc.poll() is None:
                print(f"serve on {s.port}:", s.stop())
        if dying.proc.poll() is None:
            dying.proc.kill()
            dying.proc.wait(5)
