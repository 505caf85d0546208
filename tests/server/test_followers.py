"""Many clients following runs through one ``agentscope-py serve --redis`` process, one real
redis-server: every follower gets the whole run, none is refused, and the process that serves
them keeps renewing its own lease, so its own runs are never marked lost meanwhile."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .test_cli_serve import Serving
from .test_runs import parse, read_some, text_of

AGENTS = '''
from agentscope_py import ModelStep, ReActAgent, ScriptedModel

WORDS = [f"w{i} " for i in range(40)]


def build() -> ReActAgent:
    model = ScriptedModel([ModelStep.text("".join(WORDS), chunks=40, delay=0.2)], name="slow", loop=True)
    return ReActAgent.builder().name("slow").model(model).build()
'''
TEXT = "".join(f"w{i} " for i in range(40))
FOLLOWERS = 1_000
RUNS = 4


class Logged(Serving):
    """A serve process whose output is read as it comes (a pipe nobody reads would stall it)."""

    def drain(self) -> None:
        assert self.proc.stdout is not None
        stdout = self.proc.stdout

        def read() -> None:
            for line in stdout:
                self.lines.append(line.rstrip("\n"))

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.reader.join(timeout=5)
        return "\n".join(self.lines)


@pytest.fixture
def pair(tmp_path: Path, redis_url: str, redis_prefix: str) -> Iterator[list[Logged]]:
    (tmp_path / "slow_agents.py").write_text(textwrap.dedent(AGENTS))
    # A lease of 3 s, renewed every second: three renewals in a row must fail for the runs to be
    # lost, and the test watches every renewal.
    servers = [Logged("slow_agents:build", "--redis", redis_url, "--redis-prefix", redis_prefix,
                      "--run-lease", "3", "--log-level", "warning", "--max-connections", "4000",
                      cwd=tmp_path, env={"PYTHONPATH": os.getcwd()}) for _ in range(2)]
    try:
        for s in servers:
            s.wait_for_url()
            s.drain()
        yield servers
    finally:
        for s in servers:
            if s.proc.poll() is None:
                print(f"serve on {s.port}:", s.stop())  # its log, shown if the test failed


async def start_detached(client: httpx.AsyncClient, server: Logged, session: str) -> str:
    async with client.stream("POST", f"{server.url}/v1/runs",
                             json={"session_id": session, "input": "hi", "detach": True}) as r:
        assert r.status_code == 200, await r.aread()
        run_id = r.headers["x-run-id"]
        await read_some(r, 2)
    return run_id


def whole_run(status: int, body: str) -> str | None:
    """What is wrong with a follower's answer (None: the whole run, once, in order)."""
    if status != 200:
        return f"status {status}: {body[:200]}"
    frames = parse(body)
    if [i for i, _, _ in frames] != list(range(1, len(frames) + 1)):
        return f"ids {[i for i, _, _ in frames][:20]}..."
    if not frames or frames[-1][2].get("type") != "agent_end":
        return f"ends with {frames[-1][2] if frames else 'nothing'}"
    if text_of(frames) != TEXT:
        return f"text {text_of(frames)[:80]!r}"
    return None


@pytest.mark.timeout(150)
async def test_a_thousand_followers_through_one_process_complete_and_its_lease_holds(pair: list[Logged]) -> None:
    a, b = pair
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with asyncio.timeout(120), httpx.AsyncClient(timeout=90, limits=limits) as client:
        # B's own runs, each followed through A: A marks them lost if B's lease lapses.
        own = [await start_detached(client, b, f"own-{i}") for i in range(2)]
        watchers = [asyncio.create_task(client.get(f"{a.url}/v1/runs/{run_id}/events")) for run_id in own]
        # A's runs, each followed by a quarter of the followers through B.
        runs = [await start_detached(client, a, f"far-{i}") for i in range(RUNS)]

        async def follow(run_id: str) -> str | None:
            r = await client.get(f"{b.url}/v1/runs/{run_id}/events")
            return whole_run(r.status_code, r.text)

        outcomes = await asyncio.gather(*(follow(runs[i % RUNS]) for i in range(FOLLOWERS)))
        watched = [whole_run(r.status_code, r.text) for r in await asyncio.gather(*watchers)]
    wrong = [o for o in outcomes if o is not None]
    assert not wrong, f"{len(wrong)} of {FOLLOWERS} followers did not get the whole run, e.g. {wrong[:3]}"
    assert watched == [None, None], watched
    logs = {s.port: s.stop() for s in pair}
    for port, text in logs.items():
        assert "could not renew" not in text, f"serve on {port}:\n{text}"
        assert "marked lost" not in text, f"serve on {port}:\n{text}"


# -- in one process: the reads behind the followers ----------------------------------------------


def numbered(first: int, last: int) -> list[bytes]:
    return [b'id: %d\ndata: {"n": %d}\n\n' % (n, n) for n in range(first, last + 1)]


async def noop(run_id: str) -> bool:
    return False


async def blocked_clients(url: str) -> int:
    from redis.asyncio import Redis

    client = Redis.from_url(url)
    try:
        info: Any = await client.info("clients")
        return int(info["blocked_clients"])
    finally:
        await client.aclose()


@pytest.mark.timeout(60)
async def test_followers_of_a_run_share_one_read_from_any_position(own_redis: Any, monkeypatch: Any) -> None:
    """200 followers in one process of a run another process writes, from positions along it, a
    few of them slow: one blocking read of the log at a time, and each follower gets the frames
    after its position once, in order, to the end (a slow one, left behind the tail's bytes,
    reads the log itself and catches up)."""
    from agentscope_py.server import RunRecord
    from agentscope_py.server._limits import Limits
    from agentscope_py.server._logtail import TAIL_BYTES
    from agentscope_py.server._runlog import Batch
    from agentscope_py.server._runlog_redis import RedisRunLog
    from agentscope_py.server._runs import Runs

    monkeypatch.setattr("agentscope_py.server._logtail.TAIL_BYTES", 2_000)  # about 70 frames
    assert TAIL_BYTES > 2_000
    owner = RedisRunLog(own_redis.url, prefix="tail")
    here = RedisRunLog(own_redis.url, prefix="tail", max_connections=8)
    runs = Runs(here, Limits(), poll=0.5)
    await owner.start(noop)
    await owner.renew()
    await runs.start()
    total, written = 400, 20
    assert await owner.create(RunRecord("r", "u", "s", "native", owner.owner))
    assert await owner.append([Batch("r", 1, numbered(1, written))]) == []

    async def follow(after: int, slow: bool) -> list[int]:
        _, frames = await runs.resume("r", "u", after)
        seen = []
        async for chunk in frames():
            seen += [int(line[4:]) for line in chunk.decode().split("\n") if line.startswith("id: ")]
            if slow:
                await asyncio.sleep(0.05)
        return seen

    starts = [(i * 7) % (written + 1) for i in range(200)]
    async with asyncio.timeout(40):
        followers = [asyncio.create_task(follow(after, slow=i % 50 == 0)) for i, after in enumerate(starts)]
        await asyncio.sleep(0.3)  # all caught up with what is written: waiting for more
        assert await blocked_clients(own_redis.url) == 1, "one blocking read for the run's 200 followers"
        most = 0
        while written < total:
            await asyncio.sleep(0.02)
            most = max(most, await blocked_clients(own_redis.url))
            batch = numbered(written + 1, written + 10)
            assert await owner.append([Batch("r", written + 1, batch)]) == []
            written += 10
        await owner.end("r", "finished", total)
        seen = await asyncio.gather(*followers)
    for after, got in zip(starts, seen, strict=True):
        assert got == list(range(after + 1, total + 1)), (after, got[:10])
    assert most <= 1, f"{most} blocking reads at once for one run followed here"
    assert not runs._tails  # the read ended with the run
    await runs.close()
    await owner.close()


@pytest.mark.timeout(60)
async def test_the_lease_and_the_writes_never_wait_behind_reads(own_redis: Any) -> None:
    """Far more blocking reads than the process's read connections: the lease is renewed and
    the frames written at once, and the reads wait their turn instead of failing."""
    from agentscope_py.server import RunRecord
    from agentscope_py.server._runlog import Batch
    from agentscope_py.server._runlog_redis import RedisRunLog

    log = RedisRunLog(own_redis.url, prefix="lease", lease=3.0)
    await log.start(noop)
    await log.renew()
    for i in range(150):
        assert await log.create(RunRecord(f"quiet-{i}", "u", "s", "native", log.owner))
    assert await log.create(RunRecord("busy", "u", "s", "native", log.owner))
    async with asyncio.timeout(30):
        reads = [asyncio.create_task(log.read(f"quiet-{i}", 0, 1.5)) for i in range(150)]
        await asyncio.sleep(0.3)  # every read connection blocked
        assert await blocked_clients(own_redis.url) >= 90
        started = time.monotonic()
        await log.renew()
        assert await log.append([Batch("busy", 1, numbered(1, 3))]) == []
        waited = time.monotonic() - started
        slices = await asyncio.gather(*reads)
    assert waited < 0.5, f"the lease and a write waited {waited:.2f} s behind the reads"
    assert all(s is not None and s.data == b"" and s.record.running for s in slices)
    await log.close()
