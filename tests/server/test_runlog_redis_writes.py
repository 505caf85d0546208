"""The Redis run log's flushes (one script call on a connection of their own, packed by us):
against a real redis-server that forgets its scripts, stalls past the timeout, and dies and comes
back, every write either lands or fails as a `RunLogError`, and the next one reads its own reply."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from redis.asyncio import Redis

from agentscope_py.errors import RunLogError
from agentscope_py.server import RunRecord
from agentscope_py.server._runs.runlog import Batch
from agentscope_py.server._runs.runlog_redis import RedisRunLog

pytestmark = pytest.mark.timeout(60)


def frames(first: int, last: int) -> list[bytes]:
    return [b'id: %d\ndata: {"n": %d}\n\n' % (n, n) for n in range(first, last + 1)]


async def started(log: RedisRunLog, *run_ids: str) -> None:
    await log.renew()
    for run_id in run_ids:
        assert await log.create(RunRecord(run_id, "alice", "s1", "native", owner=log.owner))


async def test_a_server_that_forgot_its_scripts_takes_the_next_write(redis_url: str, redis_prefix: str) -> None:
    log = RedisRunLog(redis_url, prefix=redis_prefix)
    try:
        await started(log, "r1")
        assert await log.append([Batch("r1", 1, frames(1, 2))]) == []
        admin = Redis.from_url(redis_url)
        await admin.script_flush()  # as after a restart
        await admin.aclose()
        assert await log.append([Batch("r1", 3, frames(3, 4))]) == []
        got = await log.read("r1", 0, 0)
        assert got is not None and got.data == b"".join(frames(1, 4))
    finally:
        await log.close()


async def test_a_stalled_server_is_a_typed_error_and_its_late_reply_is_never_read(
        redis_url: str, redis_prefix: str) -> None:
    log = RedisRunLog(redis_url, prefix=redis_prefix, socket_timeout=1.0)  # a loaded machine's margin
    admin = Redis.from_url(redis_url)
    try:
        await started(log, "r1", "r2")
        assert await log.append([Batch("r1", 1, frames(1, 1))]) == []
        await admin.execute_command("CLIENT", "PAUSE", 2500, "WRITE")  # writes wait 2.5 s
        with pytest.raises(RunLogError, match="appending 2 batches"):
            await log.append([Batch("r1", 2, frames(2, 2)), Batch("r2", 1, frames(1, 1))])
        await asyncio.sleep(2.5)
        # The paused write may have landed after the timeout; either way the next write gets its
        # own answer (one result per batch of its own), not the late reply to the one before.
        written = (await log.get("r1"))
        assert written is not None
        nxt = written.last + 1
        assert await log.append([Batch("r1", nxt, frames(nxt, nxt))]) == []
        got = await log.read("r1", 0, 0)
        assert got is not None and got.data == b"".join(frames(1, nxt))
    finally:
        await admin.aclose()
        await log.close()


async def test_a_dead_server_is_a_typed_error_and_a_restarted_one_takes_writes_again(own_redis: Any) -> None:
    log = RedisRunLog(own_redis.url, prefix="t", socket_timeout=1.0)
    try:
        await started(log, "r1")
        assert await log.append([Batch("r1", 1, frames(1, 1))]) == []
        own_redis.stop()
        with pytest.raises(RunLogError, match="appending 1 batches"):
            await log.append([Batch("r1", 2, frames(2, 2))])
        own_redis.start()  # empty: no record, no scripts
        with contextlib.suppress(RunLogError):  # the reading client's pooled connection was the old server's
            await log.renew()
        await started(log, "r9")
        assert await log.append([Batch("r9", 1, frames(1, 1))]) == []
        assert await log.append([Batch("r1", 2, frames(2, 2))]) == ["r1"]  # its record is gone: refused
    finally:
        await log.close()
