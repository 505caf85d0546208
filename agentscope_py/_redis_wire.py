"""`PackedCommands`: the commands every served run makes to Redis, on one connection of our own.

A served request makes about eight commands (its session's lock, load, save and release, its run's
record and end, the flushes of its frames), and redis-py's command path cost ~250 Python calls a
command: the pool's lock and health check, retries, event hooks, an encoder call and type checks
per argument, a StreamReader and StreamWriter, and a task or a timeout scope per command. Here a
command is packed as RESP once and written; its reply is parsed in C (hiredis) where it arrives.

One connection per event loop carries every command, pipelined: Redis answers in the order it was
asked, so a reply belongs to the oldest command still waiting. A caller that stops waiting (it was
cancelled) leaves its reply to be read and dropped, so the next command still gets its own.

Timeouts without a timer per command: while the connection is open a watchdog looks every eighth
of ``timeout``; a command waiting longer than ``timeout`` fails the connection, and with it every
command on it, as `redis.exceptions.TimeoutError` (so a command fails after between ``timeout``
and 9/8 of it). A connection that closed fails its commands as `redis.exceptions.ConnectionError`;
either way the next command opens a new one, and no command is ever sent twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, cast

try:
    import hiredis
    from redis.asyncio.connection import parse_url
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import NoScriptError, ResponseError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError("the Redis stores need redis and hiredis: pip install 'agentscope-py[redis]'") from exc

__all__ = ["Arg", "PackedCommands", "bulk", "packed"]

Arg = bytes | str | int


def bulk(value: bytes) -> bytes:
    """``value`` as a RESP bulk string (one argument of a packed command)."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


def bulks(args: Sequence[Arg]) -> bytes:
    """``args`` as RESP bulk strings, one after another: bytes as they are, ints in decimal, text
    in UTF-8."""
    values = [arg if type(arg) is bytes else b"%d" % arg if type(arg) is int else str(arg).encode() for arg in args]
    return b"".join([b"$%d\r\n%s\r\n" % (len(value), value) for value in values])


def packed(args: Sequence[Arg]) -> bytes:
    """One command in RESP: an array of bulk strings."""
    return b"*%d\r\n%s" % (len(args), bulks(args))


class _Wire(asyncio.Protocol):
    """One connection: commands written as they come, each reply handed to the oldest command
    still waiting for one."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.open = False
        self._transport: asyncio.Transport | None = None
        self._reader = hiredis.Reader(replyError=ResponseError)  # error replies as values, typed
        self._waiting: deque[tuple[asyncio.Future[Any], float]] = deque()
        self._loop = asyncio.get_running_loop()
        self._watchdog: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport, self.open = cast(asyncio.Transport, transport), True  # (uvloop's is not a subclass)
        self._watchdog = self._loop.call_later(self.timeout / 8, self._watch)

    def send(self, command: bytes) -> asyncio.Future[Any]:
        """Write ``command``; the future of its reply (an error reply is a `ResponseError` value)."""
        if not self.open:  # failed already: nothing would answer, nor time it out
            raise RedisConnectionError("the connection to Redis is closed")
        future = self._loop.create_future()
        self._waiting.append((future, self._loop.time()))
        assert self._transport is not None
        self._transport.write(command)
        return future

    def data_received(self, data: bytes) -> None:
        reader, waiting = self._reader, self._waiting
        reader.feed(data)
        try:
            while waiting:
                reply = reader.gets()
                if reply is False:  # (hiredis: no whole reply yet)
                    return
                future = waiting.popleft()[0]
                if not future.done():  # else its caller stopped waiting: the reply is dropped
                    future.set_result(reply)
            if reader.gets() is not False:  # a reply to nothing: the stream is out of step
                raise hiredis.ProtocolError("a reply no command asked for")
        except hiredis.ProtocolError as exc:
            self._fail(RedisConnectionError(f"Redis sent what is not RESP: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"the connection to Redis closed{f': {exc}' if exc else ''}"))

    def close(self) -> None:
        self._fail(RedisConnectionError("the connection to Redis was closed by this process"))

    def _watch(self) -> None:
        if self._waiting and self._loop.time() - self._waiting[0][1] > self.timeout:
            self._fail(RedisTimeoutError(f"Redis did not answer within {self.timeout} s"))
        elif self.open:
            self._watchdog = self._loop.call_later(self.timeout / 8, self._watch)

    def _fail(self, error: Exception) -> None:
        self.open = False
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._transport is not None:
            self._transport.abort()
        while self._waiting:
            future = self._waiting.popleft()[0]
            if not future.done():
                future.set_exception(error)


class PackedCommands:
    """Commands to the Redis at ``url`` from one event loop (see the module docstring); each call
    returns the command's reply, and raises an error reply as `ResponseError` (`NoScriptError`
    for NOSCRIPT) and a failed or timed-out connection as redis-py's ``ConnectionError`` /
    ``TimeoutError``.

    From the URL: ``redis://[[user]:password@]host[:port][/db]``, ``unix://path[?db=N]``, and
    ``rediss://`` for TLS (``ssl_cert_reqs`` none/optional/required, ``ssl_ca_certs``,
    ``ssl_certfile``, ``ssl_keyfile`` in its query). ``scripts`` (name -> Lua source) run with
    `script`: by their SHA, loaded again when the server forgot them."""

    def __init__(self, url: str, timeout: float, scripts: Mapping[str, str] | None = None) -> None:
        self.url = url
        self.timeout = timeout
        self._options = parse_url(url)
        self._wire: _Wire | None = None
        self._opening: asyncio.Lock | None = None
        self._sources = dict(scripts or {})
        self._shas = {name: hashlib.sha1(text.encode()).hexdigest().encode() for name, text in self._sources.items()}

    async def call(self, *args: Arg) -> Any:
        """The reply to the command ``args`` (``"HMGET", key, "version"``)."""
        return await self._exchange(packed(args))

    async def script(self, name: str, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        """The reply of the script ``name`` run on ``keys`` and ``args``."""
        return await self.script_packed(name, len(keys), len(args), bulks((*keys, *args)))

    async def script_packed(self, name: str, count_keys: int, count_args: int, packed_args: bytes) -> Any:
        """`script` with its keys and then its args given packed, each a `bulk`, ``count_keys``
        and ``count_args`` of them (for a caller that packs many at once, or keeps them packed)."""
        command = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n%s%s" % (
            3 + count_keys + count_args, self._shas[name], bulk(b"%d" % count_keys), packed_args)
        try:
            return await self._exchange(command)
        except NoScriptError:  # the server lost its scripts (a restart, SCRIPT FLUSH)
            await self.call("SCRIPT", "LOAD", self._sources[name])
            return await self._exchange(command)

    async def _exchange(self, command: bytes) -> Any:
        wire = self._wire
        if wire is None or not wire.open:
            wire = await self._connected()
        reply = await wire.send(command)
        if type(reply) is ResponseError:
            raise NoScriptError(str(reply)) if str(reply).startswith("NOSCRIPT") else reply
        return reply

    async def _connected(self) -> _Wire:
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:  # one connection for everyone waiting
            if self._wire is None or not self._wire.open:
                self._wire = await self._open()
            return self._wire

    async def _open(self) -> _Wire:
        options, loop = self._options, asyncio.get_running_loop()
        wire: _Wire | None = None
        try:
            async with asyncio.timeout(self.timeout):
                if "path" in options:
                    _, wire = await loop.create_unix_connection(lambda: _Wire(self.timeout), options["path"])
                else:
                    context = _tls(options) if self.url.startswith("rediss://") else None
                    host, port = options.get("host", "localhost"), options.get("port", 6379)
                    _, wire = await loop.create_connection(lambda: _Wire(self.timeout), host, port, ssl=context)
                for reply in await asyncio.gather(*map(wire.send, _handshake(options))):
                    if isinstance(reply, ResponseError):
                        raise RedisConnectionError(f"Redis refused the connection's setup: {reply}")
        except BaseException as exc:
            if wire is not None:
                wire.close()
            if isinstance(exc, TimeoutError):
                raise RedisTimeoutError(f"could not connect to Redis at {self.url!r} within {self.timeout} s") from None
            if isinstance(exc, OSError):
                raise RedisConnectionError(f"could not connect to Redis at {self.url!r}: {exc}") from exc
            raise
        return wire

    async def close(self) -> None:
        """Close the connection (commands still waiting fail)."""
        if self._wire is not None:
            self._wire.close()
            self._wire = None


def _handshake(options: Mapping[str, Any]) -> list[bytes]:
    """The commands a new connection sends first: AUTH and SELECT, as the URL asks."""
    commands = []
    if options.get("password") is not None:
        user = (options["username"],) if options.get("username") else ()
        commands.append(packed(("AUTH", *user, options["password"])))
    if options.get("db"):
        commands.append(packed(("SELECT", options["db"])))
    return commands


def _tls(options: Mapping[str, Any]) -> ssl.SSLContext:
    """The TLS context of a ``rediss://`` URL's query (redis-py's names)."""
    context = ssl.create_default_context(cafile=options.get("ssl_ca_certs"))
    modes = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
    asked = options.get("ssl_cert_reqs") or "required"
    if asked not in modes:
        raise ValueError(f"ssl_cert_reqs={asked!r} in the Redis URL: use none, optional or required")
    if modes[asked] == ssl.CERT_NONE:
        context.check_hostname = False
    context.verify_mode = modes[asked]
    if options.get("ssl_certfile"):
        context.load_cert_chain(options["ssl_certfile"], options.get("ssl_keyfile"))
    return context
