"""`Http1Transport`: an httpx2 transport over our own HTTP/1.1 connections (`_http1.Connection`).

What it keeps from httpx2's default transport: requests exactly as httpx2 builds them (method,
target, headers, body, chunked bodies), the timeout extension's ``connect``/``read``/``write``/
``pool`` seconds, the pool's limits (``max_connections``, ``max_keepalive_connections``,
``keepalive_expiry``), TLS through `httpx2.create_ssl_context`, and httpx2's exception classes
(``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``, ``WriteTimeout``, ``PoolTimeout``,
``RemoteProtocolError``), so the SDKs above it behave as they do over the default transport.
What it leaves out: HTTP/2, proxies (`usable_for` says whether an environment proxy applies; the
models then keep httpx2's own transport), protocol upgrades.

A pooled connection the server closed while idle is noticed when it closes (the connection keeps
reading); one the server closes just as a request is written fails before any byte of a response
came, and such a request goes once more on a new connection, as browsers and urllib3 do: the
server never read it.

A response's body is the connection's own generator; the response's extensions carry it as
``agentscope_py.body`` so that a reader of undecoded bodies (`_convert.stream_chunks`) can skip
httpx2's per-chunk layers, which would otherwise cost a few calls per token again (only while
the response reads that body itself: a transport wrapping this one that tees or replaces the
stream keeps httpx2's path).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import httpx2

from ._convert import BODY_EXTENSION
from ._http1 import Connection

__all__ = ["Http1Transport", "usable_for"]

_DEFAULT_PORTS = {b"http": 80, b"https": 443}


def usable_for(url: str) -> bool:
    """Whether requests to ``url`` can go over `Http1Transport`: plain http or https with no
    environment proxy in the way (httpx2's default transport honours ``HTTP(S)_PROXY`` and
    ``ALL_PROXY``; this one does not)."""
    parsed = httpx2.URL(url)
    if parsed.scheme not in ("http", "https"):
        return False
    proxies = {k.lower(): v for k, v in urllib.request.getproxies().items()}
    if not any(proxies.get(k) for k in (parsed.scheme, "all")):
        return True
    return bool(urllib.request.proxy_bypass(parsed.host))


class _Body(httpx2.AsyncByteStream):
    """A response's body for httpx2: the connection's generator, closed with the response."""

    __slots__ = ("_conn", "_iter")

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._iter = conn.iter_body()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._iter

    async def aclose(self) -> None:
        await self._iter.aclose()
        self._conn.done()  # (a generator never started runs no ``finally``)


class Http1Transport(httpx2.AsyncBaseTransport):
    """An httpx2 transport speaking HTTP/1.1 over asyncio protocols; see the module docstring."""

    def __init__(self, *, verify: ssl.SSLContext | bool = True,
                 limits: httpx2.Limits = httpx2.Limits(max_connections=100, max_keepalive_connections=20)) -> None:
        self._verify = verify
        self._ssl: ssl.SSLContext | None = None  # made at the first https request (it reads files)
        self._max = limits.max_connections
        self._max_idle = limits.max_keepalive_connections
        self._expiry = limits.keepalive_expiry
        self._idle: dict[tuple[bytes, bytes, int], list[Connection]] = {}
        self._open = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # -- httpx2's interface ---------------------------------------------------------------------

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if self._closed:
            raise RuntimeError("the transport is closed")
        self._bind()
        timeouts = request.extensions.get("timeout") or {}
        scheme = request.url.raw_scheme
        port = request.url.port or _DEFAULT_PORTS.get(scheme)
        if scheme not in _DEFAULT_PORTS or port is None:
            raise httpx2.UnsupportedProtocol(f"request URL has an unsupported scheme: {request.url}",
                                             request=request)
        origin = (scheme, request.url.raw_host, port)
        head, body, chunks = _encode(request)
        head_only = request.method == "HEAD"
        for attempt in (1, 2):
            conn = await self._acquire(origin, timeouts, request)
            reused = conn.responses > 0
            try:
                await conn.send(head, body, chunks, head_only=head_only,
                                timeouts=(timeouts.get("write"), timeouts.get("read")))
                await conn.head()
            except BaseException as exc:
                conn.abort()
                self._release(conn)
                stale = isinstance(exc, httpx2.RemoteProtocolError) and reused and not conn.got_bytes
                if stale and attempt == 1 and chunks is None:
                    continue  # a stale keep-alive connection: the server never read the request
                if isinstance(exc, TimeoutError):  # (only the write waits under asyncio.timeout)
                    raise httpx2.WriteTimeout("timed out writing the request", request=request) from exc
                raise
            break
        conn.on_done = self._finished
        stream = _Body(conn)
        return httpx2.Response(conn.status, headers=conn.headers, stream=stream, extensions={
            "http_version": b"HTTP/1.1", "reason_phrase": conn.reason, BODY_EXTENSION: stream})

    @property
    def open_connections(self) -> int:
        """Connections open now, idle in the pool or carrying a response."""
        return self._open

    async def aclose(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.on_lost = None
                conn.close()
        self._idle.clear()

    # -- the pool -------------------------------------------------------------------------------

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # A new event loop (a second asyncio.run): connections of the old one cannot be used
            # or closed from here; forget them.
            self._loop = loop
            self._idle.clear()
            self._open = 0
            self._waiters.clear()

    async def _acquire(self, origin: tuple[bytes, bytes, int], timeouts: dict[str, Any],
                       request: httpx2.Request) -> Connection:
        idle = self._idle.get(origin)
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()
            conn.on_lost = None
            if not conn.closed and (self._expiry is None or now - conn.idle_since < self._expiry):
                return conn
            conn.close()
            self._open -= 1
        if self._max is not None and self._open >= self._max:
            await self._wait_for_room(timeouts.get("pool"), request)
            return await self._acquire(origin, timeouts, request)
        self._open += 1
        try:
            return await self._connect(origin, timeouts.get("connect"), request)
        except BaseException:
            self._open -= 1
            self._wake_one()
            raise

    async def _wait_for_room(self, seconds: float | None, request: httpx2.Request) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(seconds):
                await waiter
        except TimeoutError as exc:
            raise httpx2.PoolTimeout("no connection free in the pool in time", request=request) from exc
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    async def _connect(self, origin: tuple[bytes, bytes, int], seconds: float | None,
                       request: httpx2.Request) -> Connection:
        scheme, host, port = origin
        name = host.decode("ascii")
        loop = asyncio.get_running_loop()
        tls = self._context() if scheme == b"https" else None
        conn = Connection(origin)
        try:
            async with asyncio.timeout(seconds):
                await loop.create_connection(lambda: conn, name, port, ssl=tls,
                                             server_hostname=name if tls else None)
        except TimeoutError as exc:
            raise httpx2.ConnectTimeout(f"timed out connecting to {name}:{port}", request=request) from exc
        except (OSError, ssl.SSLError) as exc:
            raise httpx2.ConnectError(f"cannot connect to {name}:{port}: {exc}", request=request) from exc
        return conn

    def _context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = httpx2.create_ssl_context(verify=self._verify)
            self._ssl.set_alpn_protocols(["http/1.1"])
        return self._ssl

    def _finished(self, conn: Connection) -> None:
        if conn.reusable():
            conn.responses += 1
        else:
            conn.abort()
        self._release(conn)

    def _release(self, conn: Connection) -> None:
        idle = self._idle.setdefault(conn.origin, [])
        if (not conn.closed and not self._closed and asyncio.get_running_loop() is self._loop
                and (self._max_idle is None or sum(map(len, self._idle.values())) < self._max_idle)):
            conn.idle_since = asyncio.get_running_loop().time()
            conn.on_lost = self._lost
            idle.append(conn)
        else:
            conn.close()
            self._open -= 1
        self._wake_one()

    def _lost(self, conn: Connection) -> None:
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)
            self._open -= 1
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


def _encode(request: httpx2.Request) -> tuple[bytes, bytes | None, Any]:
    """The request's head, and its body whole or as an async iterable of framed pieces."""
    lines = [b"%s %s HTTP/1.1\r\n" % (request.method.encode("ascii"), request.url.raw_path)]
    chunked = False
    has_host = False
    for name, value in request.headers.raw:
        if b"\r" in name or b"\n" in name or b"\r" in value or b"\n" in value or b":" in name:
            raise httpx2.LocalProtocolError(f"illegal header {name!r}", request=request)
        lower = name.lower()
        has_host = has_host or lower == b"host"
        chunked = chunked or (lower == b"transfer-encoding" and b"chunked" in value.lower())
        lines.append(b"%s: %s\r\n" % (name, value))
    if not has_host:
        lines.insert(1, b"Host: %s\r\n" % request.url.netloc)
    lines.append(b"\r\n")
    head = b"".join(lines)
    try:
        return head, request.content, None
    except httpx2.RequestNotRead:
        return head, None, _pieces(request.stream, chunked)


async def _pieces(stream: Any, chunked: bool) -> AsyncIterator[bytes]:
    async for piece in stream:
        if not piece:
            continue
        yield b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
    if chunked:
        yield b"0\r\n\r\n"
