"""The Redis stores on a client the caller built (`client=`): an ACL user and a database, TLS,
Sentinel — each against a redis-server of the test's own — carry every store, the run log's own
connections go with the same settings, the caller's client stays open; a write whose connection
the server closed while idle is sent once; bad arguments are clear errors; URLs keep working."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, self_signed
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import ConnectionError as RedisConnectionError

from agentscope_py.agent import AgentState, RedisStateStore, StateStoreError
from agentscope_py.durable import RedisEventLog
from agentscope_py.errors import RunLogError
from agentscope_py.middleware import RedisBudgetStore, RedisCacheStore
from agentscope_py.server import RedisRunLog, RunRecord
from agentscope_py.server._runs.runlog import Batch

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


@contextlib.contextmanager
def redis_server(*args: str) -> Iterator[None]:
    """A redis-server of the test's own, with ``args`` (a configuration file first, if any),
    stopped after."""
    binary = shutil.which("redis-server")
    assert binary is not None, "this test needs redis-server on PATH"
    proc = subprocess.Popen([binary, *args, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


async def answering(client: Redis) -> Redis:
    """``client`` once the server it goes to answers (it may still be starting)."""
    for _ in range(800):  # 20 s: a loaded host starts a process slowly
        try:
            await client.ping()
            return client
        except (RedisConnectionError, OSError):
            await asyncio.sleep(0.025)
    raise AssertionError("no Redis answered")


def frames(first: int, last: int) -> list[bytes]:
    return [b'id: %d\ndata: {"n": %d}\n\n' % (n, n) for n in range(first, last + 1)]


async def a_run_logged(log: RedisRunLog, run_id: str) -> bytes:
    """A run created, two batches written and read back through ``log``: what it read."""
    await log.renew()
    assert await log.create(RunRecord(run_id, "alice", "s1", "native", owner=log.owner))
    assert await log.append([Batch(run_id, 1, frames(1, 2))]) == []
    assert await log.append([Batch(run_id, 3, frames(3, 3))]) == []
    got = await log.read(run_id, 0, 0)
    assert got is not None
    return got.data


async def interrupts_heard(log: RedisRunLog, run_id: str) -> list[str]:
    """The run ids ``log``'s process hears after another sends it an interrupt for ``run_id``."""
    heard: list[str] = []
    got = asyncio.Event()

    async def on_interrupt(rid: str) -> None:
        heard.append(rid)
        got.set()

    await log.start(on_interrupt)
    record = await log.get(run_id)
    assert record is not None
    assert await log.send_interrupt(record)
    await asyncio.wait_for(got.wait(), 5)
    return heard


@pytest.fixture
async def acl_redis() -> AsyncIterator[tuple[int, Redis]]:
    """A redis-server whose default user has a password and whose user ``alice`` (every right)
    has another, and an admin client of the default user on database 3."""
    port = free_port()
    with redis_server("--port", str(port), "--requirepass", "admin-pw",
                      "--user", "alice", "on", ">s3cret", "~*", "&*", "+@all"):
        admin = await answering(Redis(host="127.0.0.1", port=port, password="admin-pw", db=3))
        yield port, admin
        await admin.aclose()


async def test_a_callers_client_with_an_acl_user_and_a_database_carries_every_store(
        acl_redis: tuple[int, Redis]) -> None:
    port, admin = acl_redis
    client = Redis(host="127.0.0.1", port=port, username="alice", password="s3cret", db=3)
    store, run_log = RedisStateStore(client=client, prefix="t"), RedisRunLog(client=client, prefix="t")
    events, budget = RedisEventLog(client=client, prefix="t"), RedisBudgetStore(client=client, prefix="t:b")
    cache = RedisCacheStore(client=client, prefix="t:c")
    try:
        async with store.session_lock("ada", "chat"):
            assert await store.save("ada", "chat", AgentState(summary="kept"), 0) == 1
        state, version = await store.load("ada", "chat")
        assert state is not None and state.summary == "kept" and version == 1

        assert await a_run_logged(run_log, "r1") == b"".join(frames(1, 3))
        assert await run_log.owner_alive(run_log.owner)
        assert await interrupts_heard(run_log, "r1") == ["r1"]

        assert await events.describe("d1", {"user": "ada"})
        assert await events.publish("d1", 1, [{"n": 1}, {"n": 2}]) == 2
        assert (await events.read("d1", 0, 0)).events == [{"n": 1}, {"n": 2}]

        spend = await budget.add("ada", 10, 0.5)
        assert (spend.tokens, spend.calls) == (10, 1)
        await cache.set("k", [], None)
        assert await cache.get("k") == ()

        # Everything went to database 3, as alice, the run log's own connections included (its
        # writes, lease and subscription are not the caller's client's).
        assert await admin.exists("t:state:ada:chat", "t:run:r1", "t:durable:d1", "t:b:ada", "t:c:k") == 5
        listed = (await admin.execute_command("CLIENT", "LIST")).decode().splitlines()
        alices = [line for line in listed if " user=alice " in line]
        assert len(alices) >= 4 and all(" db=3 " in line for line in alices)
        assert any(" cmd=subscribe " in line or " sub=1 " in line for line in alices)
    finally:
        for closing in (store, run_log, events, budget, cache):
            await closing.close()
    assert await client.ping()  # the caller's client is the caller's to close
    await client.aclose()


async def test_a_client_with_a_wrong_password_is_a_typed_error_naming_it(acl_redis: tuple[int, Redis]) -> None:
    port, _ = acl_redis
    client = Redis(host="127.0.0.1", port=port, username="alice", password="nope")
    run_log, store = RedisRunLog(client=client, prefix="t"), RedisStateStore(client=client, prefix="t")
    try:
        with pytest.raises(RunLogError, match=r"renewing this process's lease.*(WRONGPASS|invalid username)"):
            await run_log.renew()
        with pytest.raises(StateStoreError, match=r"loading session ada/chat.*(WRONGPASS|invalid username)"):
            await store.load("ada", "chat")
    finally:
        await run_log.close()
        await store.close()
        await client.aclose()


async def test_a_tls_client_carries_the_run_log_and_the_sessions_and_an_untrusting_one_is_refused(
        tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    port = free_port()
    with redis_server("--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file",
                      str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"):
        client = await answering(Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(cert)))
        run_log, store = RedisRunLog(client=client, prefix="t"), RedisStateStore(client=client, prefix="t")
        untrusting = Redis(host="127.0.0.1", port=port, ssl=True)
        refused = RedisRunLog(client=untrusting, prefix="t")
        try:
            assert await a_run_logged(run_log, "r1") == b"".join(frames(1, 3))
            assert await store.save("ada", "chat", AgentState(summary="over tls"), 0) == 1
            with pytest.raises(RunLogError, match=r"(?i)certificate verify failed"):
                await refused.renew()
        finally:
            for closing in (run_log, store, refused):
                await closing.close()
            await client.aclose()
            await untrusting.aclose()


async def test_a_sentinels_master_client_carries_the_run_log(tmp_path: Path) -> None:
    port, sentinel_port = free_port(), free_port()
    conf = tmp_path / "sentinel.conf"  # (a sentinel rewrites its configuration file)
    conf.write_text(f"port {sentinel_port}\nbind 127.0.0.1\nsentinel monitor main 127.0.0.1 {port} 1\n")
    with redis_server("--port", str(port)), redis_server(str(conf), "--sentinel"):
        sentinel = Sentinel([("127.0.0.1", sentinel_port)], socket_timeout=1.0)
        master = await answering(Redis(host="127.0.0.1", port=port))  # both may still be starting
        await (await answering(Redis(host="127.0.0.1", port=sentinel_port))).aclose()
        client = sentinel.master_for("main")
        run_log = RedisRunLog(client=client, prefix="t")
        try:
            assert await a_run_logged(run_log, "r1") == b"".join(frames(1, 3))
            assert await master.exists("t:run:r1:log") == 1
        finally:
            await run_log.close()
            await client.aclose()
            await master.aclose()
            for each in sentinel.sentinels:  # the clients it asked for the master
                await each.aclose()


async def test_a_write_whose_connection_the_server_closed_while_idle_is_sent_once() -> None:
    # A redis-server of the test's own: it closes every connection but its admin's, which on the
    # suite's shared server would cut the connections of the tests running beside it.
    port = free_port()
    with redis_server("--port", str(port)):
        admin = await answering(Redis(host="127.0.0.1", port=port))
        log = RedisRunLog(f"redis://127.0.0.1:{port}/0", prefix="t")
        try:
            await log.renew()
            assert await log.create(RunRecord("r1", "alice", "s1", "native", owner=log.owner))
            assert await log.append([Batch("r1", 1, frames(1, 1))]) == []
            # Every connection but the admin's closed by the server, the writes' one among them.
            assert await admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes") >= 1
            await asyncio.sleep(0.1)  # the close reaches the idle connections
            # Taken, once: a batch sent twice would have its second copy refused (its ids behind).
            assert await log.append([Batch("r1", 2, frames(2, 2))]) == []
            assert await log.append([Batch("r1", 3, frames(3, 3))]) == []
            got = await log.read("r1", 0, 0)
            assert got is not None and got.data == b"".join(frames(1, 3))
        finally:
            await log.close()
            await admin.aclose()


async def test_urls_keep_working_a_password_a_database_and_a_unix_socket(tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    port = free_port()
    with redis_server("--port", str(port), "--unixsocket", str(sock), "--requirepass", "pw"):
        admin = await answering(Redis(unix_socket_path=str(sock), password="pw", db=2))
        store = RedisStateStore(f"unix://:pw@{sock}?db=2", prefix="t")
        run_log = RedisRunLog(f"redis://:pw@127.0.0.1:{port}/2", prefix="t")
        try:
            assert await store.save("ada", "chat", AgentState(summary="s"), 0) == 1
            assert await a_run_logged(run_log, "r1") == b"".join(frames(1, 3))
            assert await admin.exists("t:state:ada:chat", "t:run:r1") == 2
        finally:
            await store.close()
            await run_log.close()
            await admin.aclose()


def test_bad_arguments_say_what_was_wrong_and_what_to_do() -> None:
    client = Redis()
    for make in (RedisStateStore, RedisRunLog, RedisEventLog, RedisBudgetStore, RedisCacheStore):
        name = make.__name__
        with pytest.raises(ValueError, match=f"{name}: give a Redis url or client=, not both"):
            make("redis://localhost:6379/0", client=client)
        with pytest.raises(TypeError, match=rf"{name}: client= must be a redis.asyncio.Redis .* got redis.*Redis"):
            make(client=SyncRedis())
        with pytest.raises(ValueError, match=f"{name}: client= decodes replies to text"):
            make(client=Redis(decode_responses=True))
        with pytest.raises(ValueError, match=rf"{name}: the Redis url 'http://x' must start with redis://"):
            make("http://x")
        made: Any = make(client=client)
        assert made.client is client and made.url is None
        assert make().url == "redis://localhost:6379/0"
