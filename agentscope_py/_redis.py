"""What the Redis-backed stores share (`RedisStateStore`, `server.RedisRunLog`,
`durable.RedisEventLog`, the middleware's Redis stores): where their connections go — a URL, or a
caller's ``redis.asyncio.Redis`` —, clients made per event loop, and typed errors.

Every command goes through redis-py's own API (its clients, or, for the commands every run makes,
its connections, pipelined: `Pipelined`; EVALSHA with the script loaded again when the server
forgot it; hiredis parses the replies when it is installed).

A client made here belongs to the event loop it was made on (a redis.asyncio connection is bound
to the loop that opened it): a store used from two loops, as tests and ``asyncio.run`` do, makes
one for each (`PerLoop`). A caller's client is used as it is, on whatever loop the store runs, and
the caller closes it (after the stores using it); where a store's guarantees rest on how its
connections are pooled (the run log: writes never sent twice nor held up by reads, a lease that
never waits), it opens pools of its own with the caller's client's connection settings
(`RedisSettings`)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from .errors import RunLogError

try:
    from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import NoScriptError, RedisError, ResponseError
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError("the Redis stores need the redis client: pip install 'agentscope-py[redis]'") from exc

__all__ = ["DEFAULT_URL", "PerLoop", "Pipelined", "Redis", "RedisError", "RedisSettings", "ResponseError",
           "check_source", "read_block_ms", "redis_errors"]

DEFAULT_URL = "redis://localhost:6379/0"

T = TypeVar("T")

# What a pool puts into its connections' settings for itself (bound to that pool, or made again by
# any new pool): left out when a pool is made with another pool's settings.
_POOL_OWN = frozenset({"himport_registry", "maint_notifications_pool_handler", "maint_notifications_config",
                       "orig_host_address", "orig_socket_timeout", "orig_socket_connect_timeout"})


@contextlib.contextmanager
def redis_errors(log: str, what: str) -> Iterator[None]:
    """Every Redis failure as a `RunLogError` naming ``log`` and what it was doing."""
    try:
        yield
    except (RedisError, OSError) as exc:
        raise RunLogError(f"{log} in Redis failed while {what}: {type(exc).__name__}: {exc}") from exc


def check_source(owner: str, url: str | None, client: Any) -> str | None:
    """The URL ``owner`` connects to (`DEFAULT_URL` when neither is given), or None when it uses
    ``client``; a clear error for both, a client that is not a ``redis.asyncio.Redis`` or decodes
    its replies, or a URL of another scheme."""
    if client is not None:
        if url is not None:
            raise ValueError(f"{owner}: give a Redis url or client=, not both")
        if not isinstance(client, Redis):
            raise TypeError(f"{owner}: client= must be a redis.asyncio.Redis (the asyncio client, which may be "
                            f"a Sentinel's master_for(...)), got {type(client).__module__}.{type(client).__name__}")
        if client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError(f"{owner}: client= decodes replies to text (decode_responses=True); the stores keep "
                             "bytes: pass a client made without decode_responses")
        return None
    url = DEFAULT_URL if url is None else url
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"{owner}: the Redis url {url!r} must start with redis://, rediss:// or unix:// "
                         "(or pass a redis.asyncio.Redis as client=)")
    return url


def read_block_ms(client: Redis, wait: float, margin: float) -> int | None:
    """The BLOCK of an XREAD that waits up to ``wait`` seconds on ``client``, kept ``margin``
    seconds inside its socket timeout (a block past it would fail as a timeout); None: no wait."""
    if not wait > 0:
        return None
    timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
    if timeout is not None and wait > timeout - margin:
        wait = max(timeout / 2, timeout - margin)
    return max(1, round(wait * 1000))


class RedisSettings:
    """How to open connections to one Redis: the ``url``'s, or, given ``client``, the caller's
    client's (its connection class and settings: address, database, TLS, credentials, a Sentinel's
    master discovery), with the timeouts, size and retries of the pool asked for."""

    __slots__ = ("client", "url")

    def __init__(self, url: str | None, client: Redis | None) -> None:
        self.url, self.client = url, client

    def pool(self, *, max_connections: int, socket_timeout: float | None, connect_timeout: float,
             wait: float | None = None, retries: int = 0) -> ConnectionPool:
        """A new pool: at most ``max_connections``; with ``wait`` a command that finds them all in
        use waits up to ``wait`` seconds for one (else it fails); ``retries``: times a command that
        failed on its connection is sent again (0: never sent twice)."""
        options: dict[str, Any] = {"max_connections": max_connections, "socket_timeout": socket_timeout,
                                   "socket_connect_timeout": connect_timeout, "retry": Retry(NoBackoff(), retries)}
        if wait is not None:
            options["timeout"] = wait
        kind = ConnectionPool if wait is None else BlockingConnectionPool
        if self.client is None:
            assert self.url is not None
            return kind.from_url(self.url, **options)
        theirs = self.client.connection_pool
        settings = {k: v for k, v in theirs.connection_kwargs.items() if k not in _POOL_OWN}
        return kind(connection_class=theirs.connection_class, **{**settings, **options})


class PerLoop(Generic[T]):
    """A value made by ``make`` for the running event loop, made again on another loop."""

    __slots__ = ("_loop", "_make", "_value")

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._value: T | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def get(self) -> T:
        loop = asyncio.get_running_loop()
        if self._value is None or self._loop is not loop:
            self._value, self._loop = self._make(), loop
        return self._value

    def take(self) -> T | None:
        """The running loop's value, forgotten here (to close it); None if there is none (a value
        made on another, finished, loop cannot be closed from this one: it is only dropped)."""
        value, loop = self._value, self._loop
        self._value = self._loop = None
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return None
        return value if loop is running else None


def _sha(source: str) -> bytes:
    return hashlib.sha1(source.encode()).hexdigest().encode()


class Pipelined:
    """The commands that every run makes (a session's lock, load and save, a run's record, its
    frames and its end), on one connection taken from ``pool`` and held: a command asked for while
    none is on its way goes at once; those asked for while one is go together in the next round
    trip, packed and sent as one (a pipeline, each command standing alone), so a busy process makes
    one round trip for many runs' commands. They go through redis-py's connection (its command
    packing, its parser — hiredis when installed —, its connect: credentials, database, TLS), not
    through a client's command path, which retries and costs several times more per command.

    Replies are redis-py's raw replies (bytes, ints, lists). A command's error reply is raised to
    its caller alone; a round trip whose connection failed or timed out fails every command in it,
    and the connection is opened again for the next (a connection the server closed while idle is
    found so, and opened again, before a command is sent on it): a command is never sent twice. A
    queued command whose caller stopped waiting (it was cancelled) is dropped; one already on its
    way has its reply read and dropped, or, when its own caller was the one reading, its connection
    closed (redis-py's way: no later command reads its reply). ``scripts`` (name -> Lua source) run
    with `script`, by their SHA (EVALSHA), loaded again when the server forgot them (a script that
    was not found did not run: sending it again sends it once). ``close()`` gives the connection
    back to ``pool``."""

    __slots__ = ("_busy", "_conn", "_queue", "_sender", "_shas", "_sources", "pool")

    def __init__(self, pool: ConnectionPool, scripts: Mapping[str, str] | None = None) -> None:
        self.pool = pool
        # (SHAs as bytes: arguments already bytes are packed as they are)
        self._sources = {_sha(source): source for source in (scripts or {}).values()}
        self._shas = {name: _sha(source) for name, source in (scripts or {}).items()}
        self._queue: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = []
        self._busy = False  # a round trip is on its way
        self._sender: asyncio.Task[None] | None = None
        self._conn: Any = None

    async def call(self, *args: Any) -> Any:
        """The reply to the command ``args`` (``"HMGET", key, "version"``)."""
        if self._busy:
            future = asyncio.get_running_loop().create_future()
            self._queue.append((args, future))
            return await future
        self._busy = True
        try:
            [reply] = await self._exchange([args])
            if isinstance(reply, NoScriptError) and self._forgotten(args):
                await self._load(args[1])
                [reply] = await self._exchange([args])
        finally:
            self._next()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def script(self, name: str, keys: Sequence[Any], args: Sequence[Any]) -> Awaitable[Any]:
        """The reply of the script ``name`` run on ``keys`` and ``args``."""
        return self.call(b"EVALSHA", self._shas[name], len(keys), *keys, *args)

    async def close(self) -> None:
        """Give the connection back to the pool (a later command takes one again)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await self.pool.release(conn)

    async def _exchange(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """One round trip: every command's reply, an error reply as its exception (its caller's
        alone); a failed connection raises, and is opened again for the next round trip."""
        conn = self._conn
        if conn is None:
            take: Callable[[], Awaitable[Any]] = self.pool.get_connection
            conn = self._conn = await take()  # connected and checked by the pool
        else:
            await self.pool.ensure_connection(conn)
        await conn.send_packed_command(conn.pack_commands(commands), check_health=False)
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await conn.read_response())
            except ResponseError as error:  # a reply (read whole): the connection goes on
                replies.append(error)
        return replies

    def _forgotten(self, args: tuple[Any, ...]) -> bool:
        return args[0] == b"EVALSHA" and args[1] in self._sources

    async def _load(self, sha: bytes) -> None:
        [reply] = await self._exchange([("SCRIPT", "LOAD", self._sources[sha])])
        if isinstance(reply, Exception):
            raise reply

    def _next(self) -> None:
        """After a round trip: the commands queued meanwhile go in the next one, else none is busy."""
        if self._queue:
            self._sender = asyncio.get_running_loop().create_task(self._send())
        else:
            self._busy, self._sender = False, None

    async def _send(self) -> None:
        batch, self._queue = [(a, f) for a, f in self._queue if not f.done()], []
        try:
            if batch:
                await self._round_trip(batch)
        except BaseException as exc:  # cancelled (the loop is closing): nothing waits for ever
            error = RedisConnectionError(f"the connection to Redis stopped: {type(exc).__name__}")
            for _, future in (*batch, *self._queue):
                if not future.done():
                    future.set_exception(error)
            self._queue = []
            raise
        finally:
            self._next()

    async def _round_trip(self, batch: list[tuple[tuple[Any, ...], asyncio.Future[Any]]]) -> None:
        try:
            replies = await self._exchange([args for args, _ in batch])
        except (RedisError, OSError) as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        forgotten: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = []
        for (args, future), reply in zip(batch, replies, strict=True):
            if isinstance(reply, NoScriptError) and self._forgotten(args):
                forgotten.append((args, future))
            elif future.done():
                pass  # its caller stopped waiting: the reply is dropped
            elif isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)
        if forgotten:  # the server lost its scripts (a restart, SCRIPT FLUSH): loaded, and sent again
            try:
                for sha in {args[1] for args, _ in forgotten}:
                    await self._load(sha)
            except (RedisError, OSError) as exc:
                for _, future in forgotten:
                    if not future.done():
                        future.set_exception(exc)
                return
            self._queue[:0] = forgotten
