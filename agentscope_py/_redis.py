"""What the Redis-backed stores share (`RedisStateStore`, `server.RedisRunLog`,
`durable.RedisEventLog`): typed errors, a checked URL, `PackedCommands` (the commands a served
request makes, sent without redis-py's command path), and a redis-py client per event loop with the
log's Lua scripts registered on it (a client belongs to the loop that made it: a log used from two
loops, as tests and ``asyncio.run`` do, gets one for each)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

from ._redis_wire import Arg, PackedCommands, bulk
from .errors import RunLogError

try:
    from redis.asyncio import Redis
    from redis.exceptions import RedisError
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError("the Redis stores need the redis client: pip install 'agentscope-py[redis]'") from exc

__all__ = ["Arg", "LoopRedis", "PackedCommands", "RedisError", "bulk", "redis_errors"]


@contextlib.contextmanager
def redis_errors(log: str, what: str) -> Iterator[None]:
    """Every Redis failure as a `RunLogError` naming ``log`` and what it was doing."""
    try:
        yield
    except (RedisError, OSError) as exc:
        raise RunLogError(f"{log} in Redis failed while {what}: {type(exc).__name__}: {exc}") from exc


class LoopRedis:
    """A mixin: this loop's redis-py client (``_redis()``, with ``SCRIPTS``, name -> Lua source,
    registered on it as ``_scripts[name]``) and its `PackedCommands` (``_commands()``, the same
    scripts), both made again for a new event loop. The run log runs its scripts through
    ``_commands()``; the durable event log through ``_scripts``."""

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
        self._packed: PackedCommands | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scripts: dict[str, Any] = {}

    def _redis(self) -> Redis:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client = self._connect()
            self._packed = PackedCommands(self.url, self.socket_timeout, self.SCRIPTS)
            self._loop = loop
            self._scripts = {name: self._client.register_script(source) for name, source in self.SCRIPTS.items()}
        return self._client

    def _connect(self) -> Redis:
        """A new client for ``_redis()`` (a subclass may give it another pool)."""
        # Blocking reads wait up to their own wait on top of the socket timeout.
        return Redis.from_url(self.url, socket_timeout=self.socket_timeout + 5,
                              socket_connect_timeout=self.socket_timeout)

    def _commands(self) -> PackedCommands:
        """This loop's `PackedCommands`: for the writes every run makes (its record, its frames, its end)."""
        self._redis()
        assert self._packed is not None
        return self._packed

    async def _close_redis(self) -> None:
        """Close this loop's client and connections (errors ignored: the server may be gone)."""
        if self._packed is not None:
            await self._packed.close()
        if self._client is not None:
            with contextlib.suppress(RedisError, OSError, RuntimeError):
                await self._client.aclose()
                # (a client made on a pool of its own leaves it open when it closes)
                await self._client.connection_pool.disconnect()
        self._client = self._packed = None
