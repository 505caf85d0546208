"""Reading what a test wrote to Redis: every key under the test's own prefix, whatever its type,
and the keys deleted after the test (tests that search every sink for secrets)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


@asynccontextmanager
async def own_prefix(url: str, name: str) -> AsyncIterator[str]:
    """A fresh key prefix (``name-<hex>``) in the Redis at ``url``; its keys are deleted at the end."""
    from redis.asyncio import Redis

    prefix = f"{name}-{uuid.uuid4().hex[:8]}"
    try:
        yield prefix
    finally:
        redis = Redis.from_url(url)
        async for key in redis.scan_iter(f"{prefix}*"):
            await redis.delete(key)
        await redis.aclose()


async def redis_values(url: str, prefix: str) -> dict[str, str]:
    """Every key under ``prefix`` and its value, whatever its type, as text."""
    from redis.asyncio import Redis

    redis = Redis.from_url(url)
    read = {"string": redis.get, "hash": redis.hgetall, "stream": redis.xrange,
            "list": lambda key: redis.lrange(key, 0, -1), "set": redis.smembers,
            "zset": lambda key: redis.zrange(key, 0, -1)}
    found: dict[str, str] = {}
    try:
        async for key in redis.scan_iter(f"{prefix}*"):
            kind = (await redis.type(key)).decode()
            found[key.decode()] = repr(await read[kind](key))
    finally:
        await redis.aclose()
    return found
