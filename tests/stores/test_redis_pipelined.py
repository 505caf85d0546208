"""`Pipelined` (the commands every served run makes, through redis-py) against a real
redis-server: commands asked for together go in one round trip on one connection and each gets
its own reply; an error reply is its caller's alone; a server that forgot its scripts runs them
again, once; a stall past the timeout fails the round trip and its late reply is never read."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import ConnectionPool, Redis
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from agentscope_py._redis import Pipelined, RedisSettings

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

_COUNT = "return redis.call('INCRBY', KEYS[1], ARGV[1])"


def key() -> str:
    return f"test-pipelined-{uuid.uuid4().hex[:12]}"


def one_connection(url: str, timeout: float = 2.0) -> ConnectionPool:
    """A pool of one connection (as the run log's writes). `timeout` bounds a round trip; the
    connect keeps a loaded machine's margin, so only the stall a test makes can time out."""
    return RedisSettings(url, None).pool(max_connections=1, socket_timeout=timeout,
                                         connect_timeout=max(timeout, 10.0))


async def closed(commands: Pipelined) -> None:
    await commands.close()
    await commands.pool.aclose()


@pytest.fixture
async def admin(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_commands_asked_for_together_share_round_trips_and_each_gets_its_own_reply(
        redis_url: str, admin: Redis) -> None:
    commands = Pipelined(one_connection(redis_url))
    keys = [key() for _ in range(200)]
    try:
        replies = await asyncio.gather(*(commands.call("INCRBY", k, n) for n, k in enumerate(keys)))
        assert replies == list(range(200))
        stats = await admin.info("commandstats")
        before = stats.get("cmdstat_client|id", {}).get("calls", 0)
        assert len(set(await asyncio.gather(*(commands.call("CLIENT", "ID") for _ in range(50))))) == 1
        assert (await admin.info("commandstats"))["cmdstat_client|id"]["calls"] == before + 50
    finally:
        await admin.delete(*keys)
        await closed(commands)


async def test_an_error_reply_is_its_callers_alone(redis_url: str, admin: Redis) -> None:
    commands = Pipelined(one_connection(redis_url))
    bad, good = key(), key()
    try:
        await admin.set(bad, "not a number")
        await admin.set(good, "1")
        results = await asyncio.gather(commands.call("INCR", good), commands.call("INCR", bad),
                                       commands.call("INCR", good), return_exceptions=True)
        assert results[0] == 2 and results[2] == 3
        assert isinstance(results[1], ResponseError) and "not an integer" in str(results[1])
    finally:
        await admin.delete(bad, good)
        await closed(commands)


async def test_a_server_that_forgot_its_scripts_runs_each_of_them_once(redis_url: str, admin: Redis) -> None:
    commands = Pipelined(one_connection(redis_url), {"count": _COUNT})
    k = key()
    try:
        assert await commands.script("count", [k], [1]) == 1
        await admin.script_flush()
        assert await commands.script("count", [k], [1]) == 2  # alone
        await admin.script_flush()
        together = await asyncio.gather(*(commands.script("count", [k], [1]) for _ in range(20)))
        assert sorted(together) == list(range(3, 23))  # together: each ran once
        assert int(await admin.get(k) or 0) == 22
    finally:
        await admin.delete(k)
        await closed(commands)


async def test_a_stall_past_the_timeout_fails_the_round_trip_and_its_late_reply_is_never_read(
        redis_url: str, admin: Redis) -> None:
    commands = Pipelined(one_connection(redis_url, timeout=1.0))
    k = key()
    try:
        assert await commands.call("SET", k, "before") == b"OK"
        await admin.execute_command("CLIENT", "PAUSE", 2500, "WRITE")
        stalled = await asyncio.gather(commands.call("SET", k, "paused"), commands.call("APPEND", k, "?"),
                                       return_exceptions=True)
        assert all(isinstance(result, RedisTimeoutError) for result in stalled)
        await asyncio.sleep(2.5)
        # The paused writes may have landed late; the next command reads its own reply.
        value = await commands.call("GET", k)
        assert value in (b"before", b"paused", b"paused?")
        assert await commands.call("STRLEN", k) == len(value)
    finally:
        await admin.delete(k)
        await closed(commands)


async def test_a_connection_the_server_closed_while_idle_is_opened_again_and_the_command_sent_once(
        redis_url: str, admin: Redis) -> None:
    commands = Pipelined(one_connection(redis_url))
    k = key()
    try:
        assert await commands.call("INCR", k) == 1
        client_id = await commands.call("CLIENT", "ID")
        assert await admin.execute_command("CLIENT", "KILL", "ID", client_id) == 1
        await asyncio.sleep(0.1)  # the close reaches the idle connection
        assert await commands.call("INCR", k) == 2  # answered, and counted once
        assert await commands.call("CLIENT", "ID") != client_id
    finally:
        await admin.delete(k)
        await closed(commands)


async def test_a_caller_that_stopped_waiting_leaves_the_others_their_replies(redis_url: str, admin: Redis) -> None:
    commands = Pipelined(one_connection(redis_url, timeout=5.0))
    k = key()
    try:
        await admin.execute_command("CLIENT", "PAUSE", 300, "WRITE")
        first = asyncio.ensure_future(commands.call("SET", k, "landed"))  # sent at once, waits out the pause
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(commands.call("SET", k, "dropped"))  # queued behind it
        await asyncio.sleep(0.01)
        queued.cancel()
        assert await first == b"OK"
        assert await commands.call("GET", k) == b"landed"  # the cancelled command was never sent
    finally:
        await admin.delete(k)
        await closed(commands)
