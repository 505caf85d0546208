"""Fixtures of the state-store tests: a real redis-server, SQLite files, and every store kind.

Redis: ``REDIS_URL`` if set (CI starts the server); else a private ``redis-server`` on a free
loopback port for the session, stopped after. With neither, the redis tests fail (not skip):
a store that was never exercised must not look green.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentscope_py import ModelStep
from agentscope_py.agent import InMemoryStateStore
from agentscope_py.agent.sqlite_store import SqliteStateStore

AGENT_SCRIPT = Path(__file__).with_name("agent_proc.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    env = os.environ.get("REDIS_URL")
    if env:
        yield env
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(
            "the redis tests need a Redis server: set REDIS_URL (e.g. redis://127.0.0.1:6379/0) or "
            "install redis-server (apt-get install -y redis-server) so the fixture can start one",
            pytrace=False,
        )
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not _redis_ping(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"redis-server did not start on port {port} (exit code {proc.poll()})",
                            pytrace=False)
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix per test, so tests (and a shared CI server) never see each other's keys;
    the test's keys are deleted after it. Sync, so async tests may ``getfixturevalue`` it."""
    from redis import Redis

    prefix = f"test-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
async def redis_store(redis_url: str, redis_prefix: str) -> AsyncIterator[Any]:
    from agentscope_py.agent.redis_store import RedisStateStore

    store = RedisStateStore(redis_url, prefix=redis_prefix)
    yield store
    await store.close()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "sessions.db"


@pytest.fixture
async def sqlite_store(db_path: Path) -> AsyncIterator[SqliteStateStore]:
    store = SqliteStateStore(db_path)
    yield store
    await store.close()


@pytest.fixture(params=["memory", "sqlite", pytest.param("redis", marks=pytest.mark.redis)])
async def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """Each store kind in turn (a fresh, empty one)."""
    if request.param == "memory":
        yield InMemoryStateStore()
    elif request.param == "sqlite":
        store = SqliteStateStore(tmp_path / "any.db")
        yield store
        await store.close()
    else:
        from agentscope_py.agent.redis_store import RedisStateStore

        # Both fixtures are sync: safe to request inside the running loop.
        redis = RedisStateStore(request.getfixturevalue("redis_url"), prefix=request.getfixturevalue("redis_prefix"))
        yield redis
        await redis.close()


def signalling(event: asyncio.Event, step: ModelStep) -> ModelStep:
    """``step``, and ``event`` set when the model is asked for it."""

    def respond(request: Any) -> ModelStep:
        event.set()
        return step

    return ModelStep(respond=respond)


def script_args(*args: str) -> list[str]:
    """The command line that runs ``agent_proc.py`` with ``args`` in a fresh interpreter."""
    return [sys.executable, str(AGENT_SCRIPT), *args]
