"""`PackedCommands` (the commands every served run makes) against a real redis-server: each
command gets its own reply whatever fails around it — a connection the server closed while idle,
a stall past the timeout, an error reply, a server that forgot its scripts, many commands at once —
and a command is never sent twice."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, self_signed
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from agentscope_py._redis import PackedCommands

pytestmark = pytest.mark.timeout(60)

_GET_OR_ZERO = "return tonumber(redis.call('GET', KEYS[1]) or '0') + tonumber(ARGV[1])"


def key() -> str:
    return f"test-packed-{uuid.uuid4().hex[:12]}"


async def test_a_connection_the_server_closed_while_idle_is_opened_again_and_the_command_sent_once(
        redis_url: str) -> None:
    commands = PackedCommands(redis_url, 2.0)
    admin = Redis.from_url(redis_url)
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
        await admin.aclose()
        await commands.close()


async def test_a_restarted_server_takes_the_next_command_and_a_dead_one_is_a_typed_error(own_redis: Any) -> None:
    commands = PackedCommands(own_redis.url, 1.0, {"add": _GET_OR_ZERO})
    try:
        assert await commands.call("SET", "k", "5") == b"OK"
        own_redis.stop()
        with pytest.raises((RedisConnectionError, OSError)):
            await commands.call("GET", "k")
        own_redis.start()  # empty, and without the script
        assert await commands.call("GET", "k") is None
        assert await commands.script("add", ["k"], [3]) == 3
    finally:
        await commands.close()


async def test_a_stall_past_the_timeout_is_an_error_and_its_late_reply_is_never_read(redis_url: str) -> None:
    commands = PackedCommands(redis_url, 0.3)
    admin = Redis.from_url(redis_url)
    k = key()
    try:
        assert await commands.call("SET", k, "before") == b"OK"
        await admin.execute_command("CLIENT", "PAUSE", 800, "WRITE")
        with pytest.raises(RedisTimeoutError, match=r"did not answer within 0\.3 s"):
            await commands.call("SET", k, "paused")
        await asyncio.sleep(0.8)
        # The paused SET may have landed late; the next command reads its own reply, not "OK".
        assert await commands.call("GET", k) in (b"before", b"paused")
        assert await commands.call("APPEND", k, "!") == len("before!")
    finally:
        await admin.delete(k)
        await admin.aclose()
        await commands.close()


async def test_an_error_reply_is_raised_and_the_connection_goes_on(redis_url: str) -> None:
    commands = PackedCommands(redis_url, 2.0)
    k = key()
    try:
        await commands.call("SET", k, "not a number")
        client_id = await commands.call("CLIENT", "ID")
        with pytest.raises(ResponseError, match="not an integer"):
            await commands.call("INCR", k)
        assert await commands.call("CLIENT", "ID") == client_id
        assert await commands.call("GET", k) == b"not a number"
        assert await commands.call("DEL", k) == 1
    finally:
        await commands.close()


async def test_a_server_that_forgot_its_scripts_runs_them_again(redis_url: str) -> None:
    commands = PackedCommands(redis_url, 2.0, {"add": _GET_OR_ZERO})
    admin = Redis.from_url(redis_url)
    k = key()
    try:
        await commands.call("SET", k, "1")
        assert await commands.script("add", [k], [1]) == 2
        await admin.script_flush()
        assert await commands.script("add", [k], [2]) == 3
    finally:
        await admin.delete(k)
        await admin.aclose()
        await commands.close()


async def test_many_commands_at_once_each_get_their_own_reply_on_one_connection(redis_url: str) -> None:
    commands = PackedCommands(redis_url, 5.0)
    admin = Redis.from_url(redis_url)
    keys = [key() for _ in range(200)]
    try:
        replies = await asyncio.gather(*(commands.call("INCRBY", k, n) for n, k in enumerate(keys)))
        assert replies == list(range(200))
        assert len(set(await asyncio.gather(*(commands.call("CLIENT", "ID") for _ in range(50))))) == 1
    finally:
        await admin.delete(*keys)
        await admin.aclose()
        await commands.close()


async def test_a_command_whose_caller_stopped_waiting_leaves_the_next_its_own_reply(redis_url: str) -> None:
    commands = PackedCommands(redis_url, 5.0)
    admin = Redis.from_url(redis_url)
    k = key()
    try:
        await admin.execute_command("CLIENT", "PAUSE", 300, "WRITE")
        waiting = asyncio.ensure_future(commands.call("SET", k, "landed"))
        await asyncio.sleep(0.05)
        waiting.cancel()
        # The SET still runs once the pause ends; its "OK" is read and dropped, and the GET
        # behind it on the same connection gets the value, not "OK".
        assert await commands.call("GET", k) == b"landed"
        assert await commands.call("STRLEN", k) == len("landed")
    finally:
        await admin.delete(k)
        await admin.aclose()
        await commands.close()


async def test_bytes_text_and_numbers_go_as_they_are(redis_url: str) -> None:
    commands = PackedCommands(redis_url, 2.0)
    k = key()
    try:
        value = "é\r\n$3\r\n*1 ".encode() + bytes(range(256))
        await commands.call("HSET", k, "b", value, "s", "ünï", "n", -42)
        assert await commands.call("HMGET", k, "b", "s", "n", "missing") == [value, "ünï".encode(), b"-42", None]
        assert await commands.call("DEL", k) == 1
    finally:
        await commands.close()


@contextlib.contextmanager
def redis_server(*args: str) -> Iterator[None]:
    """A redis-server of the test's own, with ``args``, stopped after."""
    binary = shutil.which("redis-server")
    assert binary is not None, "this test needs redis-server on PATH"
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


async def answering(url: str) -> PackedCommands:
    """`PackedCommands` on ``url`` once the server there answers (it may still be starting)."""
    commands = PackedCommands(url, 2.0)
    for _ in range(200):
        try:
            await commands.call("PING")
            return commands
        except (RedisConnectionError, OSError):
            await asyncio.sleep(0.025)
    raise AssertionError(f"no Redis answered at {url}")


async def test_the_url_s_password_and_database_are_used() -> None:
    port = free_port()
    with redis_server("--port", str(port), "--requirepass", "s3cret"):
        commands = await answering(f"redis://:s3cret@127.0.0.1:{port}/3")
        admin = Redis.from_url(f"redis://:s3cret@127.0.0.1:{port}/3")
        try:
            assert await commands.call("SET", "k", "in 3") == b"OK"
            assert await admin.get("k") == b"in 3"
            assert await admin.execute_command("SELECT", 0) and await admin.get("k") is None
            wrong = PackedCommands(f"redis://:nope@127.0.0.1:{port}/0", 2.0)
            with pytest.raises(RedisConnectionError, match=r"refused the connection's setup: .*WRONGPASS"):
                await wrong.call("PING")
            with pytest.raises(ResponseError, match="NOAUTH"):
                await PackedCommands(f"redis://127.0.0.1:{port}/0", 2.0).call("GET", "k")
        finally:
            await admin.aclose()
            await commands.close()


async def test_a_unix_socket_and_its_database(tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    with redis_server("--port", "0", "--unixsocket", str(sock)):
        commands = await answering(f"unix://{sock}?db=2")
        try:
            assert await commands.call("SET", "k", "v") == b"OK"
            assert await Redis.from_url(f"unix://{sock}?db=2").get("k") == b"v"
        finally:
            await commands.close()


async def test_tls_verifies_the_server(tmp_path: Path) -> None:
    cert, key_file = self_signed(tmp_path)
    port = free_port()
    with redis_server("--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file",
                      str(key_file), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"):
        commands = await answering(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}")
        try:
            assert await commands.call("SET", "k", "over tls") == b"OK"
            assert await commands.call("GET", "k") == b"over tls"
            untrusting = PackedCommands(f"rediss://127.0.0.1:{port}/0", 2.0)
            with pytest.raises(RedisConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
                await untrusting.call("PING")
            unchecked = PackedCommands(f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=none", 2.0)
            assert await unchecked.call("PING") == b"PONG"
            await unchecked.close()
        finally:
            await commands.close()


async def test_bytes_that_are_not_resp_fail_the_connection_and_the_next_command_opens_a_new_one() -> None:
    answers = [b"?what is this\r\n", b"+OK\r\n+EXTRA\r\n", b"+PONG\r\n"]
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        with contextlib.suppress(ConnectionError):
            while await reader.read(1024):
                writer.write(answers.pop(0))
                await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    commands = PackedCommands(f"redis://127.0.0.1:{port}/0", 2.0)
    try:
        with pytest.raises(RedisConnectionError, match="not RESP"):
            await commands.call("PING")
        assert await commands.call("SET", "k", "v") == b"OK"  # answered, but a second reply came with it
        assert await commands.call("PING") == b"PONG"  # on a new connection
        assert connections == 3
    finally:
        await commands.close()
        server.close()


async def test_a_command_on_a_connection_that_failed_is_an_error_not_a_wait(redis_url: str) -> None:
    commands = PackedCommands(redis_url, 2.0)
    try:
        assert await commands.call("PING") == b"PONG"
        wire = commands._wire
        assert wire is not None
        wire.close()
        with pytest.raises(RedisConnectionError, match="is closed"):
            await asyncio.wait_for(wire.send(b"*1\r\n$4\r\nPING\r\n"), 1.0)
        assert await commands.call("PING") == b"PONG"  # the next command opens a new connection
    finally:
        await commands.close()
