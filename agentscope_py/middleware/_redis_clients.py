"""The redis.asyncio client of the built-ins' Redis stores: the caller's, or one per event loop
made from a URL (a client is bound to the loop it first connected on, and tests and servers may
run several loops).

A client made here has a blocking pool: a command that finds every connection in use waits (up
to the socket timeout) for one to come back, instead of failing with "Too many connections" — a
hundred calls in flight on one store each hold one while they wait for Redis. A caller's client
is used as it is (its pool, timeouts and retries), and the caller closes it."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["LoopClients"]


class LoopClients:
    """``get()``: ``client`` if given, else this loop's client for ``url``, made on first use;
    ``close()``: close a client made here."""

    __slots__ = ("_clients", "client", "socket_timeout", "url")

    def __init__(self, url: str | None, socket_timeout: float, client: Any = None) -> None:
        self.url = url
        self.client = client
        self.socket_timeout = socket_timeout
        self._clients: dict[int, Any] = {}

    def get(self) -> Any:
        if self.client is not None:
            return self.client
        from .._redis import Redis, RedisSettings

        loop = id(asyncio.get_running_loop())
        client = self._clients.get(loop)
        if client is None:
            timeout = self.socket_timeout
            pool = RedisSettings(self.url, None).pool(max_connections=100, wait=timeout, socket_timeout=timeout,
                                                      connect_timeout=timeout)
            client = self._clients[loop] = Redis.from_pool(pool)  # (the client closes its pool)
        return client

    async def close(self) -> None:
        client = self._clients.pop(id(asyncio.get_running_loop()), None)
        if client is not None:
            await client.aclose()
