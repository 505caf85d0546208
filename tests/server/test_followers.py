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

pytestmark = pytest.mark.redis

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
    # lost, and the test watches every renewal. The HTTP connection cap well above the followers:
    # this test is about Redis connections.
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


async def blocked_clients_seen(url: str) -> list[int]:
    """Blocked clients, seen five times 0.05 s apart (a read between two blocks is not blocked)."""
    seen = []
    for _ in range(5):
        await asyncio.sleep(0.05)
        seen.append(await blocked_clients(url))
    return seen


@pytest.mark.timeout(60)
async def test_followers_of_a_run_share_one_read_from_any_position(own_redis: Any, monkeypatch: Any) -> None:
    """200 followers in one process of a run another process writes, from positions along it, a
    few of them slow, 10 more from the start half way: one blocking read of the log at a time,
    and each follower gets the frames after its position once, in order, to the end (one left
    behind what the tail keeps reads the log itself and catches up)."""
    from agentscope_py.server import RunRecord
    from agentscope_py.server._limits import Limits
    from agentscope_py.server._runs.logtail import TAIL_BYTES
    from agentscope_py.server._runs.runlog import Batch
    from agentscope_py.server._runs.runlog_redis import RedisRunLog
    from agentscope_py.server._runs.runs import Runs

    monkeypatch.setattr("agentscope_py.server._runs.logtail.TAIL_BYTES", 2_000)  # about 70 frames
    assert TAIL_BYTES > 2_000
    owner = RedisRunLog(own_redis.url, prefix="tail")
    here = RedisRunLog(own_redis.url, prefix="tail", max_connections=8)
    runs = Runs(here, Limits(), poll=1.0)
    waits: list[float] = []
    read = here.read

    async def counted(run_id: str, after: int, wait: float) -> Any:
        waits.append(wait)
        return await read(run_id, after, wait)

    monkeypatch.setattr(here, "read", counted)
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
                await asyncio.sleep(0.3)
        return seen

    starts = [(i * 7) % (written + 1) for i in range(200)]
    async with asyncio.timeout(40):
        followers = [asyncio.create_task(follow(after, slow=i % 50 == 0)) for i, after in enumerate(starts)]
        await asyncio.sleep(0.3)  # all caught up with what is written: waiting for more
        blocked = await blocked_clients_seen(own_redis.url)
        assert max(blocked) == 1, f"blocking reads for the run's 200 followers: {blocked}"
        most = 0
        while written < total:
            await asyncio.sleep(0.02)
            most = max(most, await blocked_clients(own_redis.url))
            batch = numbered(written + 1, written + 10)
            assert await owner.append([Batch("r", written + 1, batch)]) == []
            written += 10
            if written == 200:  # late followers, from the start: the tail moved on without them
                starts += [0] * 10
                followers += [asyncio.create_task(follow(0, slow=False)) for _ in range(10)]
        await owner.end("r", "finished", total)
        seen = await asyncio.gather(*followers)
    for after, got in zip(starts, seen, strict=True):
        assert got == list(range(after + 1, total + 1)), (after, got[:10])
    assert most <= 1, f"{most} blocking reads at once for one run followed here"
    blocking = sum(1 for w in waits if w > 0)
    assert blocking < 100, f"{blocking} blocking reads for 38 batches"  # one per batch or poll, not per follower
    assert 0 in waits  # some followers were behind the tail and read the log themselves
    assert not runs._tails  # the read ended with the run
    await runs.close()
    await owner.close()


@pytest.mark.timeout(60)
async def test_the_lease_and_the_writes_never_wait_behind_reads(own_redis: Any) -> None:
    """More blocking reads than the process's read connections: the lease is renewed and
    the frames written at once, and the reads wait their turn instead of failing."""
    from agentscope_py.server import RunRecord
    from agentscope_py.server._runs.runlog import Batch
    from agentscope_py.server._runs.runlog_redis import RedisRunLog

    log = RedisRunLog(own_redis.url, prefix="lease", lease=3.0)
    await log.start(noop)
    await log.renew()
    for i in range(120):
        assert await log.create(RunRecord(f"quiet-{i}", "u", "s", "native", log.owner))
    assert await log.create(RunRecord("busy", "u", "s", "native", log.owner))
    async with asyncio.timeout(30):
        reads = [asyncio.create_task(log.read(f"quiet-{i}", 0, 2.0)) for i in range(120)]
        while await blocked_clients(own_redis.url) < 90:  # every read connection blocked
            await asyncio.sleep(0.05)
        started = time.monotonic()
        await log.renew()
        assert await log.append([Batch("busy", 1, numbered(1, 3))]) == []
        waited = time.monotonic() - started
        slices = await asyncio.gather(*reads)
    assert waited < 1.0, f"the lease and a write waited {waited:.2f} s behind the reads"
    assert all(s is not None and s.data == b"" and s.record.running for s in slices)
    await log.close()


@pytest.mark.timeout(60)
async def test_followers_of_a_quiet_run_get_heartbeats_and_the_read_stops_when_they_leave(own_redis: Any) -> None:
    from agentscope_py.server import RunRecord
    from agentscope_py.server._limits import Limits
    from agentscope_py.server._runs.runlog import Batch
    from agentscope_py.server._runs.runlog_redis import RedisRunLog
    from agentscope_py.server._runs.runs import Runs
    from agentscope_py.server.sse import HEARTBEAT

    owner = RedisRunLog(own_redis.url, prefix="quiet")
    here = RedisRunLog(own_redis.url, prefix="quiet")
    runs = Runs(here, Limits(), poll=0.2)
    await owner.start(noop)
    await owner.renew()
    await runs.start()
    assert await owner.create(RunRecord("q", "u", "s", "native", owner.owner))
    assert await owner.append([Batch("q", 1, numbered(1, 3))]) == []
    streams: list[Any] = []  # (async generators: closed by the test)
    for after in (0, 2):
        _, frames = await runs.resume("q", "u", after, heartbeat=0.5)
        streams.append(frames())
    async with asyncio.timeout(20):
        firsts = [await stream.__anext__() for stream in streams]
        assert firsts == [b"".join(numbered(1, 3)), numbered(3, 3)[0]]
        waiting = [asyncio.create_task(stream.__anext__()) for stream in streams]
        assert list(runs._tails) == ["q"] and max(await blocked_clients_seen(own_redis.url)) == 1  # one for both
        assert await asyncio.gather(*waiting) == [HEARTBEAT, HEARTBEAT]  # nothing for 0.5 s
        tail = runs._tails["q"]
        for stream in streams:
            await stream.aclose()
        assert not runs._tails
        assert tail.task is not None
        await asyncio.gather(tail.task, return_exceptions=True)
        while await blocked_clients(own_redis.url):  # its blocking read went with it
            await asyncio.sleep(0.05)
    await runs.close()
    await owner.close()
