"""What the Redis-backed logs share (`server.RedisRunLog`, `durable.RedisEventLog`): typed
errors, a checked URL, and a redis-py client per event loop with the log's Lua scripts registered on it (a client
belongs to the loop that made it: a log used from two loops, as tests and ``asyncio.run`` do, gets
one for each)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

from .errors import RunLogError

try:
    from redis.asyncio import Redis
    from redis.exceptions import RedisError
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError("the Redis logs need the redis client: pip install 'agentscope-py[redis]'") from exc

__all__ = ["LoopRedis", "RedisError", "redis_errors"]


@contextlib.contextmanager
def redis_errors(log: str, what: str) -> Iterator[None]:
    """Every Redis failure as a `RunLogError` naming ``log`` and what it was doing."""
    try:
        yield
    except (RedisError, OSError) as exc:
        raise RunLogError(f"{log} in Redis failed while {what}: {type(exc).__name__}: {exc}") from exc


class LoopRedis:
    """A mixin: ``SCRIPTS`` (name -> Lua source) are registered on each loop's client, reached
    with ``_redis()`` and ``_scripts[name]``."""

    SCRIPTS: ClassVar[dict[str, str]] = {}
    url: str
    socket_timeout: float

    def _init_redis(self, url: str, socket_timeout: float) -> None:
        if not socket_timeout > 0:
            raise ValueError(f"socket_timeout must be positive seconds, got {socket_timeout!r}")
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"the Redis url {url!r} must start with redis://, rediss:// or unix://")
        self.url, self.socket_timeout = url, socket_timeout
        self._client: Redis | None = None
        self._writer_client: Redis | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scripts: dict[str, Any] = {}

    def _redis(self) -> Redis:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            # Blocking reads wait up to their own wait on top of the socket timeout.
            self._client = Redis.from_url(self.url, socket_timeout=self.socket_timeout + 5,
                                          socket_connect_timeout=self.socket_timeout)
            self._writer_client = None
            self._loop = loop
            self._scripts = {name: self._client.register_script(source) for name, source in self.SCRIPTS.items()}
        return self._client

    def _writer(self) -> Redis:
        """This loop's client on one connection of its own, for writes that go one at a time (a
        run log's flushes, each one call): no connection taken from the pool and given back per
        command, which cost about a fifth of a flush."""
        self._redis()
        if self._writer_client is None:
            self._writer_client = Redis.from_url(self.url, socket_timeout=self.socket_timeout,
                                                 socket_connect_timeout=self.socket_timeout,
                                                 single_connection_client=True)
        return self._writer_client

    async def _close_redis(self) -> None:
        """Close this loop's clients (errors ignored: the server may be gone)."""
        for client in (self._writer_client, self._client):
            if client is not None:
                with contextlib.suppress(RedisError, OSError, RuntimeError):
                    await client.aclose()
        self._client = self._writer_client = None
