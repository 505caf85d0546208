"""What the Redis-backed logs share (`server.RedisRunLog`, `durable.RedisEventLog`): typed
errors, a checked URL, and a redis-py client per event loop with the log's Lua scripts registered on it (a client
belongs to the loop that made it: a log used from two loops, as tests and ``asyncio.run`` do, gets
one for each)."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from .errors import RunLogError

try:
    from redis.asyncio import Redis
    from redis.exceptions import NoScriptError, RedisError
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

    async def _write_script(self, name: str, keys: Sequence[str], args: Sequence[bytes | str | int]) -> Any:
        """``EVALSHA`` of the script ``name`` on a connection of this loop's own for writes that
        go one at a time (a run log's flushes, one call each), its reply; Redis errors raised.

        Why not redis-py's command path: a flush is one command, and that path (the pool's
        connection taken and given back, retries, event hooks, an encoder call and several type
        checks per argument, a task per send for its timeout) cost ~150 Python calls a flush,
        paid per token at light load, where every token is a flush of its own. The command is
        packed here as RESP (what redis-py's ``pack_command`` writes) and sent and read on
        redis-py's own connection, which connects and parses (hiredis) as ever; the exchange is
        timed by ``socket_timeout`` as a whole."""
        self._redis()
        if self._writer_client is None:
            # No socket timeout of its own: redis-py would send through asyncio.wait_for, a task
            # per command; the whole exchange is timed here instead.
            self._writer_client = Redis.from_url(self.url, socket_timeout=None,
                                                 socket_connect_timeout=self.socket_timeout,
                                                 single_connection_client=True)
        client = self._writer_client
        if client.connection is None:
            await client.initialize()
        conn = client.connection
        assert conn is not None
        script = self._scripts[name]
        command = _packed(("EVALSHA", script.sha, len(keys), *keys, *args))
        for attempt in (1, 2):
            try:
                async with asyncio.timeout(self.socket_timeout):
                    await conn.send_packed_command(command, check_health=False)
                    return await conn.read_response(timeout=math.inf)
            except NoScriptError:
                if attempt == 2:
                    raise
                await client.script_load(script.script)  # the server lost its scripts (a restart)
            except BaseException:
                await conn.disconnect(nowait=True)  # a reply may be left unread: start afresh
                raise
        raise AssertionError("unreachable")

    async def _close_redis(self) -> None:
        """Close this loop's clients (errors ignored: the server may be gone)."""
        for client in (self._writer_client, self._client):
            if client is not None:
                with contextlib.suppress(RedisError, OSError, RuntimeError):
                    await client.aclose()
        self._client = self._writer_client = None


def _packed(args: Sequence[bytes | str | int]) -> bytes:
    """One command in RESP: an array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if type(arg) is bytes:
            data = arg
        elif type(arg) is int:
            data = b"%d" % arg
        else:
            data = str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)
