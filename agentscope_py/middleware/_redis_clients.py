"""One redis.asyncio client per event loop, for the built-ins' Redis stores (a client is bound to
the loop it first connected on, and tests and servers may run several loops).

Its pool blocks: a command that finds every connection in use waits (up to the socket timeout)
for one to come back, instead of failing with "Too many connections" — a hundred calls in flight
on one store each hold one while they wait for Redis."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["LoopClients"]


class LoopClients:
    """``get()``: this loop's client for ``url``, made on first use; ``close()``: close it."""

    __slots__ = ("_clients", "socket_timeout", "url")

    def __init__(self, url: str, socket_timeout: float) -> None:
        self.url = url
        self.socket_timeout = socket_timeout
        self._clients: dict[int, Any] = {}

    def get(self) -> Any:
        from redis.asyncio import BlockingConnectionPool, Redis

        loop = id(asyncio.get_running_loop())
        client = self._clients.get(loop)
        if client is None:
            pool = BlockingConnectionPool.from_url(
                self.url, timeout=self.socket_timeout, socket_timeout=self.socket_timeout,
                socket_connect_timeout=self.socket_timeout)
            client = self._clients[loop] = Redis.from_pool(pool)  # (the client closes its pool)
        return client

    async def close(self) -> None:
        client = self._clients.pop(id(asyncio.get_running_loop()), None)
        if client is not None:
            await client.aclose()
