"""`AioHttpSender`: the providers' streamed requests over aiohttp's public client API.

Why aiohttp: a model's reply is relayed token by token, and aiohttp's client reads a streamed body
with a parser in C and one call per piece of bytes (``StreamReader.iter_any``), where httpx's
client crosses several layers of generators per piece. Measured side by side behind ``serve``,
the SDKs' default (httpx) client and their aiohttp one (an httpx client over an aiohttp transport)
both cost more CPU per token than speaking the provider's HTTP API over aiohttp directly
(docs/providers.md has the figures).

What the SDKs still do: the URL, the auth and platform headers and the default timeout come from
the SDK client the model makes (its public ``base_url``, ``default_headers``, ``auth_headers``,
``default_query``); what the sender adds is the body (JSON, as the SDKs write it) and the
per-call ``extra_headers``, ``extra_query`` and ``timeout``. The Ollama model, whose client has
no public URL or headers, resolves them as that client does.

What aiohttp gives: one connection pool per sender (``ClientSession``), TLS, proxies, and a
connection closed, not pooled, when a response is given up before its end (cancellation
included). The environment's proxy for a host (``HTTP_PROXY`` / ``HTTPS_PROXY``, ``NO_PROXY``, as
aiohttp's ``trust_env`` reads them, credentials in the proxy's URL) is looked up once per host and
given to aiohttp with each request: with ``trust_env`` aiohttp looks it up, and the API host in
``~/.netrc``, in a worker thread on every request, and a ``.netrc`` entry for the API host would
clash with the auth header the SDK client gives.
The read timeout is kept here, not by aiohttp's ``sock_read``, which makes and cancels a timer on
every read of the socket: a timer per streamed token (`_Body` says how).
A request that went out on a pooled connection of the sender's own session and failed before any
byte of the response (``ServerDisconnectedError``, ``ClientOSError``: the server closed the idle
connection just as it was reused) is sent once more, as httpx and the SDKs do
(aiohttp resends only idempotent methods; a model request is a ``POST``). It is no retry of the
agent's: the call is one attempt (docs/providers.md, "A stale pooled connection").
Failures are the model error tree's: an HTTP status through `error_from_status`, a refused or
failed connection `ModelConnectionError`, a timeout `ModelTimeoutError`, a response that is not
valid HTTP `MalformedStreamError` (`_not_http`).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any, NamedTuple

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError
from yarl import URL

from .._deadline import SharedTimeout
from ._errors import error_from_status, malformed, message_of, quote, transport_error
from .base import MalformedStreamError

__all__ = ["AioHttpSender", "Timeouts", "body_bytes", "client_timeout"]

_orjson_dumps: Callable[..., bytes] | None
try:  # the server extra brings it; without it the stdlib writes every body
    from orjson import OPT_PASSTHROUGH_DATACLASS, OPT_PASSTHROUGH_DATETIME, JSONEncodeError
    from orjson import dumps as _orjson_dumps
except ImportError:  # pragma: no cover - exercised only without orjson
    _orjson_dumps = None

POOL_SIZE = 1000
"""Connections a sender keeps at most (the SDKs' default pool size): a stream waits for a free
one past it."""

TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError,)
"""What reading a body raises when the connection fails midway (timeouts are `TimeoutError`)."""


def body_bytes(body: Mapping[str, Any]) -> bytes | None:
    """The body as the SDKs write plain JSON: the stdlib's compact UTF-8, refusing NaN as they do
    (``ValueError``). None for a value only an SDK's encoder writes (a datetime, a pydantic model
    in an option): that call goes through the SDK.

    orjson, when installed, writes the same JSON in a tenth of the stdlib's time (the stdlib's
    encoder would be the largest part of building a request), and the stdlib writes whatever orjson
    does not write as the SDKs would: orjson refuses an int past 64 bits, a key that is no string
    (the stdlib writes ``{1: …}`` as ``{"1": …}``), a datetime and a dataclass (passed through to
    its missing ``default``), and writes NaN and the infinities as ``null``, so a body with a
    ``null`` in it is written again by the stdlib, which refuses them. orjson also writes a UUID
    (its string) and an enum member (its value), which the stdlib's and the SDKs' encoders refuse
    with a ``TypeError``. Floats are the same numbers, not always the same digits (``1e-07`` is
    orjson's ``1e-7``)."""
    if _orjson_dumps is not None:
        try:
            written = _orjson_dumps(body, option=OPT_PASSTHROUGH_DATETIME | OPT_PASSTHROUGH_DATACLASS)
        except JSONEncodeError:
            pass
        else:
            if b"null" not in written:
                return written
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except TypeError:
        return None


class Timeouts(NamedTuple):
    """A request's bounds (`client_timeout`): aiohttp's for getting a connection, then the wait for
    the response's headers and each wait for bytes of its body, which the sender keeps."""

    connect: aiohttp.ClientTimeout
    """The wait for a pooled connection and the TCP and TLS handshake (aiohttp's, no ``sock_read``)."""
    headers: float | None
    """The wait for the response's headers, from the request's start: the connect's bound plus the read's."""
    read: float | None
    """Each wait for bytes of the body (`_Body`)."""


def client_timeout(timeout: Any) -> Timeouts:
    """The bounds for seconds or an httpx-style ``Timeout`` (``connect``, ``read``, ``pool``): the
    connect bounds the TCP and TLS handshake, the pool the wait for a connection (connecting
    included), the read every wait for bytes, the response's headers counting from the request's
    start (so with the connect's time). None or 0 bounds nothing, as in aiohttp's timeouts."""
    if timeout is None or isinstance(timeout, int | float):
        seconds = float(timeout) if timeout else None
        return Timeouts(aiohttp.ClientTimeout(total=None, connect=seconds, sock_connect=seconds, sock_read=None),
                        None if seconds is None else 2 * seconds, seconds)
    connect = getattr(timeout, "connect", None)
    pool = getattr(timeout, "pool", None)
    read = getattr(timeout, "read", None) or None
    connecting = None if pool is None or connect is None else pool + connect
    return Timeouts(aiohttp.ClientTimeout(total=None, sock_connect=connect, connect=connecting, sock_read=None),
                    None if read is None else read + (connecting or 0.0), read)


class _Response:
    """An aiohttp response as the SSE reader (`_convert.stream_chunks`) reads it."""

    __slots__ = ("_body", "_read", "_response", "body")

    def __init__(self, response: aiohttp.ClientResponse, read: float | None) -> None:
        self._response = response
        self._read = read
        self._body = b""
        self.body: _Body | None = None

    @property
    def headers(self) -> Mapping[str, str]:
        return self._response.headers

    def aiter_bytes(self) -> _Body:
        # The bytes as they arrive, one piece per read of the socket: what a reply streamed token
        # by token needs, without cutting or joining lines (the SSE reader does that).
        self.body = _Body(self._response, self._read)
        return self.body

    async def aread(self) -> bytes:
        async with asyncio.timeout(self._read):  # (a whole body read at once: one bound for it)
            self._body = await self._response.read()
        return self._body

    def json(self) -> Any:
        """The body `aread` read, as JSON."""
        return json.loads(self._body)


class _Body:
    """A response's body as it arrives (``StreamReader.readany``: the bytes there are, one piece
    per read of the socket), each wait for bytes bounded by the read timeout.

    Why not aiohttp's ``sock_read``: aiohttp cancels and makes its timer again on every read of
    the socket, and a reply streamed token by token is a read per token. Here one timer watches
    the stream: each wait notes when it began (a clock read), and the timer, re-armed for the time
    that wait has left, closes the response once a wait lasted the whole timeout; the pending read
    then fails, and is told as aiohttp's own `aiohttp.SocketTimeoutError`. Time the reader spends
    away from the socket (its consumer is slower than the model) is no wait for the server and
    does not count, as aiohttp's timer stops while its buffer is full. One timer per read timeout
    per stream, a few per request, instead of one per token."""

    __slots__ = ("_content", "_expired", "_handle", "_loop", "_read", "_response", "_since")

    def __init__(self, response: aiohttp.ClientResponse, read: float | None) -> None:
        self._response = response
        self._content = response.content
        self._read = read
        self._loop = asyncio.get_running_loop()
        self._since: float | None = None  # when the pending wait began; None while not waiting
        self._expired = False
        self._handle = None if read is None else self._loop.call_later(read, self._check)

    def __aiter__(self) -> _Body:
        return self

    def at_eof(self) -> bool:
        """Whether the body is read to its end (nothing is left to wait for)."""
        return self._content.at_eof()

    async def __anext__(self) -> bytes:
        self._since = self._loop.time()
        try:
            piece = await self._content.readany()
        except aiohttp.ClientConnectionError as exc:
            if self._expired:
                raise aiohttp.SocketTimeoutError(f"no bytes from the server for {self._read} s") from exc
            raise
        finally:
            self._since = None
        if not piece:
            raise StopAsyncIteration
        return piece

    def _check(self) -> None:
        read = self._read
        if read is None:  # (never armed without one)
            return
        since = self._since
        left = read if since is None else since + read - self._loop.time()
        if left > 0:
            self._handle = self._loop.call_later(left, self._check)
            return
        self._handle = None
        self._expired = True
        self._response.close()  # the pending read fails: `__anext__` tells it as the timeout

    def stop(self) -> None:
        """The stream is over: no more watching."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class _Opened:
    """`AioHttpSender.open`'s async context manager: the streamed response, closed on the way out
    (its connection back to the pool only when the body was read to its end)."""

    __slots__ = ("_args", "_opened", "_provider", "_response", "_sender")

    def __init__(self, sender: AioHttpSender, provider: str, args: tuple[str, dict[str, str], bytes, Timeouts]) -> None:
        self._sender = sender
        self._provider = provider
        # Taken once the request goes out: the body is sent once and not held while the reply
        # streams (a conversation's body, per stream in flight, for as long as its reply takes).
        self._args: tuple[str, dict[str, str], bytes, Timeouts] | None = args
        self._response: aiohttp.ClientResponse | None = None
        self._opened: _Response | None = None

    async def __aenter__(self) -> _Response:
        args, self._args = self._args, None
        if args is None:
            raise RuntimeError("a streamed response is opened once: call open() again for another request")
        url, headers, body, timeout = args
        provider = self._provider
        sender = self._sender
        target = sender.url(url)
        proxy, proxy_auth = sender.proxy_for(target)
        proxy_headers = None
        if proxy_auth is not None:
            # To the proxy: in the CONNECT that opens a tunnel to an https host, else in the
            # request itself, which goes to the proxy whole.
            if target.scheme == "https":
                proxy_headers = {"Proxy-Authorization": proxy_auth}
            else:
                headers["Proxy-Authorization"] = proxy_auth
        try:
            session = await sender.session()
            # On the loop's shared clock (`SharedTimeout`): a loop timer made and cancelled per
            # request is what most requests would pay for a bound they never reach. The headers'
            # bound is the request's, its resend included.
            with SharedTimeout(timeout.headers):
                pooled = _Pooled() if sender.watches_pool else None
                try:
                    response = await session.post(target, data=body, headers=headers, timeout=timeout.connect,
                                                  proxy=proxy, proxy_headers=proxy_headers, trace_request_ctx=pooled)
                except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                    if pooled is None or not pooled.reused or isinstance(exc, aiohttp.ClientConnectorError):
                        raise
                    # A pooled connection the server closed while it was idle (module docstring):
                    # nothing of the response was read, so the request goes once more (aiohttp drops
                    # the closed connection and takes another).
                    response = await session.post(target, data=body, headers=headers, timeout=timeout.connect,
                                                  proxy=proxy, proxy_headers=proxy_headers)
        except TimeoutError as exc:  # aiohttp's connect timeouts and the headers' are TimeoutErrors
            raise transport_error(provider, exc, in_body=False, timeout=True) from exc
        except aiohttp.ClientError as exc:
            if isinstance(exc.__cause__, HttpProcessingError):
                raise _not_http(provider, exc.__cause__) from exc
            raise transport_error(provider, exc, in_body=False, timeout=False) from exc
        self._response = response
        if response.status >= 400:
            try:
                raise await _status_error(response, provider, timeout.read)
            finally:
                self._response = None
                response.close()
        self._opened = _Response(response, timeout.read)
        return self._opened

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        response, self._response = self._response, None
        opened, self._opened = self._opened, None
        if opened is not None and opened.body is not None:
            opened.body.stop()
        if response is None:
            return
        if exc_type is None and response.content.at_eof():
            response.release()  # read to its end: the connection goes back to the pool
        else:
            response.close()  # given up midway (an error, a cancellation): the server sees the close


def _not_http(provider: str, exc: HttpProcessingError) -> MalformedStreamError:
    """The error for a response whose bytes break HTTP (a garbled chunk size, bytes past the
    ``Content-Length``, a status line that is none): the server broke the stream's protocol, as a
    body cut mid-way does. aiohttp fails the request itself when the bad bytes come in one read
    with the response's head, and the body's read when they come later; both are this error, so
    that the same fault is the same error however the network split the bytes."""
    return malformed(provider, f"the server's response is not valid HTTP: {quote(exc.message or type(exc).__name__)}")


async def _status_error(response: aiohttp.ClientResponse, provider: str, read: float | None) -> Exception:
    """The typed error of an HTTP error response, from its status, headers and JSON body."""
    try:
        async with asyncio.timeout(read):
            raw = await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raw = f"(the error body could not be read: {exc})".encode()
    try:
        body: Any = json.loads(raw)
    except (ValueError, RecursionError):
        body = None
    # The SDKs' wording when the body names no message, with what a body that is no JSON says
    # (a proxy's HTML page), which the SDKs leave out.
    fallback = f"Error code: {response.status}" + ("" if body is not None or not raw.strip() else f" - {quote(raw)}")
    return error_from_status(response.status, message_of(body, fallback), provider=provider,
                             headers=response.headers, body=body)


class _Pooled:
    """A request's note of whether it went out on a pooled connection (`_REUSED`)."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


async def _note_reused(session: aiohttp.ClientSession, trace: Any, params: Any) -> None:
    pooled = trace.trace_request_ctx
    if type(pooled) is _Pooled:
        pooled.reused = True


_REUSED = aiohttp.TraceConfig()
"""Tells a request (its ``trace_request_ctx``, a `_Pooled`) that it took a pooled connection."""
_REUSED.on_connection_reuseconn.append(_note_reused)
_REUSED.freeze()


class AioHttpSender:
    """One model's HTTP client: an aiohttp session made on first use (on the running event loop)
    with a pool of ``pool_size`` connections, or the ``session`` given (its owner configures and
    closes it)."""

    __slots__ = ("_closer", "_given", "_loop", "_pool_size", "_proxies", "_session", "_url")

    def __init__(self, session: aiohttp.ClientSession | None = None, *, pool_size: int = POOL_SIZE) -> None:
        self._given = session
        self._pool_size = pool_size
        self._session: aiohttp.ClientSession | None = None
        self._closer: AsyncGenerator[None, None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proxies: dict[tuple[str, str | None, int | None], tuple[URL | None, str | None]] = {}
        self._url: tuple[str, URL] | None = None  # the last URL parsed: a model posts to one

    @property
    def watches_pool(self) -> bool:
        """Whether the sender's requests are told when they take a pooled connection (`_REUSED`):
        those of the session it made, not a given one's (whose tracing is its owner's)."""
        return self._given is None

    def url(self, url: str) -> URL:
        """``URL(url)``, parsed once for the URL every request of a model goes to."""
        last = self._url
        if last is None or last[0] != url:
            last = self._url = (url, URL(url))
        return last[1]

    def proxy_for(self, url: URL) -> tuple[URL | None, str | None]:
        """The environment's proxy for ``url``'s host, and its ``Proxy-Authorization`` (see the
        module docstring): none for a given session, which has its owner's settings."""
        if self._given is not None:
            return None, None
        key = (url.scheme, url.host, url.port)
        found = self._proxies.get(key)
        if found is None:
            found = self._proxies[key] = _environment_proxy(url)
        return found

    async def session(self) -> aiohttp.ClientSession:
        if self._given is not None:
            return self._given
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # A session belongs to one event loop: a model used from a second ``asyncio.run``
            # gets a new one (the old loop closed the old one as it shut down, see `_closing`).
            self._loop = loop
            self._session = session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._pool_size, limit_per_host=0),
                # No default timeout: each request carries its own.
                timeout=aiohttp.ClientTimeout(total=None),
                trace_configs=[_REUSED],
            )
            self._closer = _closing(session)
            await anext(self._closer)
        return self._session

    def open(self, provider: str, url: str, headers: dict[str, str], body: bytes, timeout: Timeouts) -> _Opened:
        """The streamed response to ``POST url``, as an async context manager; an HTTP error
        status, a failed connection or a timeout raise the typed `ModelError`."""
        return _Opened(self, provider, (url, headers, body, timeout))

    async def aclose(self) -> None:
        """Close the session this sender made (its pooled connections); a given one is its owner's."""
        closer, self._closer, self._session = self._closer, None, None
        if closer is not None and self._loop is asyncio.get_running_loop():
            await closer.aclose()


async def _closing(session: aiohttp.ClientSession) -> AsyncGenerator[None, None]:
    """Parked at its ``yield`` for as long as the session lives, so that the session is closed
    even when its model never is: by ``aclose()``, by the event loop shutting down its async
    generators (``asyncio.run`` does, before it closes the loop), or by the generator's collection
    with its model's. aiohttp reports a session left open as an error; a model's owner need not
    close it any more than the SDKs' own HTTP clients."""
    try:
        yield
    finally:
        await session.close()


def _environment_proxy(url: URL) -> tuple[URL | None, str | None]:
    """The proxy the environment names for ``url`` as aiohttp's ``trust_env`` reads it: the
    scheme's own (``HTTP_PROXY``, ``HTTPS_PROXY``; an ``https://`` proxy aiohttp cannot speak is
    left out, as aiohttp leaves it), none for a host ``NO_PROXY`` covers."""
    if url.host is not None and urllib.request.proxy_bypass(url.host):
        return None, None
    found = urllib.request.getproxies().get(url.scheme)
    if not found:
        return None, None
    proxy = URL(found)
    if proxy.scheme not in ("http", ""):
        return None, None
    auth = aiohttp.BasicAuth.from_url(proxy)
    return proxy.with_user(None), None if auth is None else auth.encode()
