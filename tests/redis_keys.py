"""Reading what a test wrote to Redis: every key under the test's own prefix (the `redis_prefix`
fixture), whatever its type (tests that search every sink for secrets)."""

from __future__ import annotations


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
