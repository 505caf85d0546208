"""The ids a shared log reserves (real Redis, real servers): a run's own clients never get an id
past what the log reserved, however long the log is away; and a run whose process was cut off
long enough to be marked lost elsewhere ends, for its own clients too, with the log's `RunLost`
under the one id every client sees it by."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import pytest

from agentscope_py.errors import RunLogError
from agentscope_py.server import create_app
from agentscope_py.server._runs.runlog import Batch
from agentscope_py.server._runs.runlog_redis import RedisRunLog

from .conftest import LiveServer
from .test_runs import TEXT, parse, slow_agent, text_of

pytestmark = pytest.mark.timeout(60)


class CutOff(RedisRunLog):
    """A log this process loses for a while (``away``): its batches and lease renewals fail."""

    away = False

    async def append(self, batches: Sequence[Batch]) -> list[str]:
        if self.away:
            raise RunLogError("the run log is unavailable: connection refused (a test)")
        return await super().append(batches)

    async def renew(self) -> None:
        if self.away:
            raise RunLogError("the run log is unavailable: connection refused (a test)")
        await super().renew()


class Reader:
    """A streaming response read frame by frame as it comes, in a task of its own."""

    def __init__(self, client: httpx.AsyncClient, method: str, url: str, **kw: Any) -> None:
        self.body = ""
        self.run_id = ""
        self.task = asyncio.create_task(self._read(client, method, url, kw))

    async def _read(self, client: httpx.AsyncClient, method: str, url: str, kw: dict[str, Any]) -> None:
        async with client.stream(method, url, **kw) as r:
            self.run_id = r.headers.get("x-run-id", "")
            async for chunk in r.aiter_text():
                self.body += chunk

    @property
    def ids(self) -> list[int]:
        return [i for i, _, _ in parse(self.body) if i is not None]

    async def until(self, done: Callable[[Reader], bool]) -> None:
        async with asyncio.timeout(20):
            while not done(self):
                await asyncio.sleep(0.01)


async def test_a_runs_own_clients_never_get_an_id_past_what_the_log_reserved(
        live: Callable[..., LiveServer], redis_url: str, redis_prefix: str) -> None:
    owner_log = CutOff(redis_url, prefix=redis_prefix, reserve=4)
    owner = live(create_app(slow_agent(delay=0.03), run_log=owner_log))
    peek = RedisRunLog(redis_url, prefix=redis_prefix)
    async with httpx.AsyncClient(timeout=30) as client:
        run = Reader(client, "POST", f"{owner.url}/v1/runs", json={"session_id": "s", "input": "hi", "detach": True})
        await run.until(lambda r: len(r.ids) >= 3)
        await asyncio.sleep(0.1)  # a batch in the log
        owner_log.away = True
        reserved = await peek.get(run.run_id)
        assert reserved is not None and reserved.reserved == reserved.last + 4
        await asyncio.sleep(0.6)  # the run goes on: 20 frames more, none of them written
        stalled = run.ids
        assert stalled[-1] <= reserved.reserved, (stalled, reserved)
        await asyncio.sleep(0.3)
        assert run.ids == stalled  # held at the reservation while the log is away
        owner_log.away = False  # back: the next batch reserves more, and the client goes on
        async with asyncio.timeout(20):
            await run.task
    await peek.close()
    frames = parse(run.body)
    assert [i for i, _, _ in frames] == list(range(1, len(frames) + 1))
    assert text_of(frames) == TEXT and frames[-1][2]["type"] == "agent_end"


async def test_a_run_cut_off_and_marked_lost_elsewhere_ends_with_the_same_runlost_for_every_client(
        live: Callable[..., LiveServer], redis_url: str, redis_prefix: str) -> None:
    owner_log = CutOff(redis_url, prefix=redis_prefix, reserve=4, lease=0.5)
    owner = live(create_app(slow_agent(delay=0.05), run_log=owner_log))
    other = live(create_app(slow_agent(), run_log=RedisRunLog(redis_url, prefix=redis_prefix)))
    async with httpx.AsyncClient(timeout=30) as client:
        here = Reader(client, "POST", f"{owner.url}/v1/runs", json={"session_id": "s", "input": "hi", "detach": True})
        await here.until(lambda r: len(r.ids) >= 3)
        await asyncio.sleep(0.1)
        owner_log.away = True  # cut off: no batch, no renewal; its lease runs out
        await asyncio.sleep(0.3)
        seen = here.ids[-1]
        there = Reader(client, "GET", f"{other.url}/v1/runs/{here.run_id}/events",
                       headers={"Last-Event-ID": str(seen)})
        await there.until(lambda r: "RunLost" in r.body)  # the other process marks it lost
        owner_log.away = False  # back: its next write is refused, and it stops the run
        async with asyncio.timeout(20):
            await asyncio.gather(here.task, there.task)
        whole = (await client.get(f"{other.url}/v1/runs/{here.run_id}/events")).text
    mine, theirs, log = parse(here.body), parse(there.body), {i: (e, d) for i, e, d in parse(whole)}
    assert mine[-1][2]["code"] == "RunLost" and theirs[-1][2]["code"] == "RunLost", (mine[-3:], theirs)
    assert mine[-1][0] == theirs[-1][0] and mine[-1][0] in log  # one id, one frame, for every client
    assert "RunCancelled" not in here.body
    for i, event, data in mine[:-1]:  # the frames it had from memory: the log's, or ids no other frame has
        assert i is not None and (i not in log or log[i] == (event, data)), i
    ids = [i for i, _, _ in mine]
    assert ids == sorted(set(ids))
