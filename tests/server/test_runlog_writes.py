"""A shared run log whose writes are slow, fail or end short, with real Redis: no frame lost from
the log by a race between this process's own writes, no run left ``running`` in the log because
its end could not be written, no follower left polling a log that ended short of its last frame."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from agentscope_py.errors import RunLogError
from agentscope_py.server import create_app
from agentscope_py.server._runs.runlog import Batch, RunRecord
from agentscope_py.server._runs.runlog_redis import RedisRunLog

from .test_runs import TEXT, parse, slow_agent, text_of

pytestmark = pytest.mark.timeout(60)


class HeldFirstAppend(RedisRunLog):
    """The first batch write is held up on its way (a slow link): the run ends meanwhile."""

    def __init__(self, *args: Any, hold: float, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.hold = hold
        self.appends = 0

    async def append(self, batches: Sequence[Batch]) -> list[str]:
        self.appends += 1
        if self.appends == 1:
            await asyncio.sleep(self.hold)
        return await super().append(batches)


class EndFailsTwice(RedisRunLog):
    """Writing a run's end fails twice (the store away for a moment), then works."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.ends = 0

    async def end(self, run_id: str, status: str, last: int) -> None:
        self.ends += 1
        if self.ends <= 2:
            raise RunLogError("the run log is unavailable: connection refused (a test)")
        await super().end(run_id, status, last)


async def _run_then_read_elsewhere(owner_log: RedisRunLog, reader_log: RedisRunLog) -> tuple[str, str, str]:
    """A run in one app (a process), its events then read through another app on the same Redis."""
    owner, reader = create_app(slow_agent(delay=0.01), run_log=owner_log), create_app(slow_agent(), run_log=reader_log)
    async with owner.router.lifespan_context(owner), reader.router.lifespan_context(reader), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=owner), base_url="http://a", timeout=30) as a, \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=reader), base_url="http://b", timeout=30) as b:
        run = await a.post("/v1/runs", json={"session_id": "s", "input": "hi"})
        run_id = run.headers["x-run-id"]
        await asyncio.sleep(1.5)  # past the held write
        async with asyncio.timeout(20):
            elsewhere = await b.get(f"/v1/runs/{run_id}/events")
    return run_id, run.text, elsewhere.text


async def test_a_flush_still_on_its_way_when_the_run_ends_loses_no_frame(redis_url: str, redis_prefix: str) -> None:
    # The run streams for ~0.4 s: the flusher takes its first frames and its write is held 1 s;
    # the run's end (its last frames, then the end) must go after that write, not overtake it.
    held = HeldFirstAppend(redis_url, prefix=redis_prefix, hold=1.0)
    _, here, elsewhere = await _run_then_read_elsewhere(held, RedisRunLog(redis_url, prefix=redis_prefix))
    assert held.appends >= 2
    assert "RunLogTrimmed" not in elsewhere and "RunLogIncomplete" not in elsewhere
    assert parse(elsewhere) == parse(here) and text_of(parse(elsewhere)) == TEXT


async def test_an_end_that_could_not_be_written_is_written_once_the_log_is_back(
        redis_url: str, redis_prefix: str) -> None:
    failing = EndFailsTwice(redis_url, prefix=redis_prefix)
    run_id, here, elsewhere = await _run_then_read_elsewhere(failing, RedisRunLog(redis_url, prefix=redis_prefix))
    assert failing.ends >= 3
    assert parse(elsewhere) == parse(here) and text_of(parse(elsewhere)) == TEXT
    log = RedisRunLog(redis_url, prefix=redis_prefix)
    record = await log.get(run_id)
    await log.close()
    assert record is not None and record.status == "finished"


async def test_a_follower_of_a_log_that_ended_short_of_its_last_frame_hears_so_and_ends(
        redis_url: str, redis_prefix: str) -> None:
    # However it came about, a log whose record ended at frame 5 while it holds frames 1-3 only
    # must not keep a follower polling for ever: it gets 1-3, then a terminal frame saying so.
    log = RedisRunLog(redis_url, prefix=redis_prefix)
    await log.start(_no_interrupts)
    await log.renew()
    assert await log.create(RunRecord("short", "default", "s1", "native", owner=log.owner))
    frames = [b'id: %d\nevent: text\ndata: {"n": %d}\n\n' % (n, n) for n in (1, 2, 3)]
    assert await log.append([Batch("short", 1, frames)]) == []
    await log.end("short", "finished", 5)
    app = create_app(slow_agent(), run_log=RedisRunLog(redis_url, prefix=redis_prefix))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://b", timeout=30) as client:
        async with asyncio.timeout(10):
            answer = await client.get("/v1/runs/short/events")
    await log.close()
    assert answer.text.startswith(b"".join(frames).decode())
    assert "RunLogIncomplete" in answer.text and "after id 3" in answer.text


async def _no_interrupts(run_id: str) -> bool:
    return False
