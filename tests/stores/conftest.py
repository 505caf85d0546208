"""Fixtures of the state-store tests: a real redis-server, SQLite files, and every store kind.

Redis: ``REDIS_URL`` if set (CI starts the server); else a private ``redis-server`` on a free
loopback port for the session, stopped after. With neither, the redis tests fail (not skip):
a store that was never exercised must not look green.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port  # noqa: F401  (test_redis_store imports it from here)

from agentscope_py import ModelStep
from agentscope_py.agent import InMemoryStateStore
from agentscope_py.agent.sqlite_store import SqliteStateStore

AGENT_SCRIPT = Path(__file__).with_name("agent_proc.py")


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
