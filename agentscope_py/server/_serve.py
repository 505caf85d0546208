"""Running the app: uvicorn with the limits a server exposed to a network needs (a deadline for
request headers, idle keep-alive connections closed, a cap on connections per process), an access
log that never shows a token, and the page's URL printed only once the server answers."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.supervisors import Multiprocess

try:  # uvicorn's faster parser (the server extra installs it through uvicorn[standard])
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - uvicorn without httptools
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

__all__ = ["GC_THRESHOLDS", "HTTP_PARSERS", "HeaderTimeoutProtocol", "redact_access_log", "serve", "serve_workers",
           "tune_gc", "uvicorn_config"]

log = logging.getLogger("agentscope_py.server")

HEADER_TIMEOUT = 10.0
"""Seconds a connection has to send a request's headers (slowloris holds connections otherwise)."""
IDLE_TIMEOUT = 5
"""Seconds an idle keep-alive connection stays open."""
MAX_CONNECTIONS = 1_000
"""Concurrent connections per process; past it requests get 503 (each connection is a file
descriptor: 1,024 is a common default limit)."""

SEND_BUFFER = 64 * 1024
"""Bytes of a connection's kernel send buffer (``SO_SNDBUF``; Linux keeps twice this). Left to
itself the kernel grows it to megabytes (``tcp_wmem``) for a client that does not read: a run
not detached then makes all that before it waits for its client, and holds it. Fixed, it bounds
what a stalled client costs; a stream of tokens needs far less (one buffer per round trip)."""

GC_THRESHOLDS = (2_000, 10, 5_000)
"""The collector's thresholds `tune_gc` sets (Python's are 700, 10, 10): young collections a little
rarer than Python's and as short (a generation-1 collection walks at most ~20,000 young objects),
full collections at most once per 5,000 generation-1 ones (~100 million allocations) where Python
runs one whenever the old generation has grown by a quarter."""


class _HeaderTimeout:
    """A mixin over one of uvicorn's HTTP protocols, closing a connection whose request headers are not complete
    within ``config.header_timeout`` seconds of it opening (or of its previous response ending).
    uvicorn's own timeouts cover idle keep-alive connections, not a client sending slowly.

    After a response, while uvicorn's keep-alive timer (the shorter) watches the idle connection,
    the deadline waits unarmed: it is armed, for what is left of it, only when bytes come without
    whole headers (`data_received`). A request that arrives whole — nearly every one — needs no
    timer of its own."""

    _timer: Any = None
    _armed_cycle: Any = None
    _idle_since: float | None = None  # when the previous response ended, the deadline unarmed
    # The protocol's own (uvicorn's) attributes this mixin reads:
    cycle: Any
    loop: Any
    config: Any
    transport: Any
    timeout_keep_alive: Any
    timeout_keep_alive_task: Any

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()
        size = getattr(self.config, "send_buffer", SEND_BUFFER)
        sock = transport.get_extra_info("socket")
        if size and sock is not None:
            with contextlib.suppress(OSError):  # not a TCP socket (a test's pipe): nothing to bound
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)

    def _arm(self, seconds: float | None = None) -> None:
        self._disarm()
        self._armed_cycle = self.cycle
        self._idle_since = None
        self._timer = self.loop.call_later(self._seconds() if seconds is None else seconds, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _seconds(self) -> float:
        return float(getattr(self.config, "header_timeout", HEADER_TIMEOUT))

    def _expire(self) -> None:
        self._timer = None
        cycle = self.cycle
        waiting = cycle is self._armed_cycle and (cycle is None or cycle.response_complete)
        if not waiting or self.transport.is_closing():
            return
        if _unread(self.transport):
            # The client did send; we have not read it: the loop is behind (uvloop runs due timers
            # before it polls the sockets). Dropping it would fail a healthy client under load
            # (measured: 1,138 of 5,000 streams at once). Look again once the loop has read it.
            self._timer = self.loop.call_later(_RECHECK, self._expire)
            return
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not self._armed_cycle:  # headers are in
            self._idle_since = None
            self._disarm()
        elif self._idle_since is not None and not self.transport.is_closing():
            # The first bytes after a response, and the headers are not whole: the deadline
            # counts from the response's end.
            self._arm(max(self._seconds() - (self.loop.time() - self._idle_since), 0.0))

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if self.transport.is_closing():
            return
        if self.timeout_keep_alive_task is not None and self.timeout_keep_alive <= self._seconds():
            # Idle: uvicorn's keep-alive timer closes the connection before the deadline would.
            self._disarm()
            self._armed_cycle = self.cycle
            self._idle_since = self.loop.time()
        else:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]


_RECHECK = 0.5
"""Seconds before the header deadline is checked again for a client whose bytes wait unread."""


def _unread(transport: Any) -> bool:
    """Whether bytes wait in the connection's socket that the loop has not read yet (a peek on a
    duplicate of its descriptor: the loop's own socket object may not offer ``recv``)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        with socket.socket(fileno=os.dup(sock.fileno())) as peek:
            return bool(peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing waiting (BlockingIOError), or the connection is gone
        return False


class H11HeaderTimeoutProtocol(_HeaderTimeout, H11Protocol):
    """`_HeaderTimeout` over uvicorn's pure-Python h11 parser."""


if HttpToolsProtocol is not None:
    class HttpToolsHeaderTimeoutProtocol(_HeaderTimeout, HttpToolsProtocol):
        """`_HeaderTimeout` over uvicorn's httptools (llhttp) parser."""

    HeaderTimeoutProtocol: type = HttpToolsHeaderTimeoutProtocol
else:  # pragma: no cover - uvicorn without httptools
    HeaderTimeoutProtocol = H11HeaderTimeoutProtocol

HTTP_PARSERS = {"auto": "HeaderTimeoutProtocol", "h11": "H11HeaderTimeoutProtocol",
                "httptools": "HttpToolsHeaderTimeoutProtocol"}
"""``http=`` of `uvicorn_config` → the protocol class. ``auto`` is httptools when installed: over
real HTTP it cuts the server's CPU per relayed token at saturation by about a quarter against h11."""


_SECRET_PARAM = re.compile(r"([?&#](?:token|access_token|api_key|key)=)[^&\s]*", re.I)


class _Redact(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_SECRET_PARAM.sub(r"\1[redacted]", a) if isinstance(a, str) else a
                                for a in record.args)
        return True


def redact_access_log() -> None:
    """Blank ``token=``-like query values in uvicorn's access log (idempotent). The server never
    takes a token from a URL, but an old bookmark may still carry one."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _Redact) for f in access.filters):
        access.addFilter(_Redact())


def uvicorn_config(app: Any, host: str = "127.0.0.1", port: int = 8000, *, header_timeout: float = HEADER_TIMEOUT,
                   idle_timeout: int = IDLE_TIMEOUT, max_connections: int | None = MAX_CONNECTIONS,
                   http: str = "auto", send_buffer: int | None = SEND_BUFFER, **uvicorn_options: Any) -> Any:
    """The ``uvicorn.Config`` `serve` runs: the header-timeout protocol over the ``http`` parser
    (``auto``, ``h11`` or ``httptools``; see `HTTP_PARSERS`), ``timeout_keep_alive`` =
    ``idle_timeout``, at most ``max_connections`` open connections (past them a request gets 503;
    ``None``: no cap), each connection's kernel send buffer ``send_buffer`` bytes (`SEND_BUFFER`;
    ``None``: the kernel's own), no ``Server`` header (``server_header=True`` brings uvicorn's
    back); other options (``loop``: ``auto`` is uvloop when installed) pass through."""
    if send_buffer is not None and not (isinstance(send_buffer, int) and send_buffer > 0):
        raise ValueError(f"send_buffer must be a positive int (bytes) or None, got {send_buffer!r}")
    if http not in HTTP_PARSERS or (http == "httptools" and HttpToolsProtocol is None):
        raise ValueError(f"http={http!r}: use 'auto' or 'h11'" + ("" if HttpToolsProtocol is None else
                                                                  " or 'httptools'"))
    # uvicorn refuses a request once the open connections, the asking one among them, reach
    # ``limit_concurrency`` (or its requests in flight, the asking one not yet among them, do): a
    # cap of N connections is N + 1 there, or the Nth connection is refused.
    limit = None if max_connections is None else max_connections + 1
    # No ``Server: uvicorn`` header (``server_header``): it tells a client nothing it needs, names
    # the software to anyone probing, and uvicorn checks every header of every response.
    options: dict[str, Any] = {"http": f"{__name__}:{HTTP_PARSERS[http]}", "timeout_keep_alive": idle_timeout,
                               "limit_concurrency": limit, "server_header": False, **uvicorn_options}
    config = uvicorn.Config(app, host=host, port=port, **options)
    # Options of ours on uvicorn's config: read by the protocol, pickled to the workers with it.
    config.__dict__["header_timeout"] = header_timeout
    config.__dict__["send_buffer"] = send_buffer
    redact_access_log()
    return config


def tune_gc(thresholds: tuple[int, int, int] = GC_THRESHOLDS) -> None:
    """Collector settings for a long-running server with many streams in flight. What start-up
    allocated (modules, schemas, the agent) moves to the permanent generation (``gc.freeze``), and
    full collections come at most once per ~100 million allocations (`GC_THRESHOLDS`). Why: Python
    collects everything whenever the old generation has grown by a quarter, and a full collection
    walks every tracked object — ~1 µs each on a served heap, ~450 ms at 1,000 streams in flight —
    so while a thousand streams start, four such pauses hold up every first token arriving
    meanwhile. Young collections stay as short as
    Python's: raising their threshold to tens of thousands made each one a pause of its own. The
    runtime makes no reference cycles per run, so collecting rarely does not grow its memory;
    cycles made by other code live until the next full collection. Process-wide: `serve` calls it
    when asked (``--tune-gc``), the library never does on its own."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)


def _announce(host: str, port: int, token: bool) -> None:
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/"
    hint = f" (the API needs the token: open {url}#token=<your token>)" if token else ""
    # The token itself is never printed: consoles end up in logs.
    print(f"agentscope-py is serving at {url}{hint}", file=sys.stdout, flush=True)


def _wait_then_announce(host: str, port: int, token: bool, stop: threading.Event) -> None:
    """For worker processes: print once ``/healthz`` answers."""
    import urllib.error
    import urllib.request

    target = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    url = f"http://{f'[{target}]' if ':' in target else target}:{port}/healthz"
    while not stop.is_set():
        try:
            with urllib.request.urlopen(url, timeout=1):
                pass
        except urllib.error.HTTPError:
            pass  # an answer all the same (a Host outside allowed_hosts is a 400)
        except OSError:  # not listening or not serving yet (URLError is an OSError)
            time.sleep(0.05)
            continue
        _announce(host, port, token)
        return


def warn_if_open(host: str, allowed_hosts: Sequence[str] | None) -> None:
    """Off loopback the Host check is the caller's to configure: without it a rebinding name
    that resolves to this machine's address is answered."""
    from ._security import is_loopback

    if allowed_hosts is None and not is_loopback(host):
        print(f"warning: serving on {host} without allowed_hosts answers any Host name (DNS rebinding); "
              "pass allowed_hosts (--allowed-host) with the names clients use", file=sys.stderr, flush=True)


def serve(
    agent_or_factory: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    auth_token: str | None = None,
    gc_tuning: bool = False,
    *,
    allowed_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] | None = None,
    header_timeout: float = HEADER_TIMEOUT,
    idle_timeout: int = IDLE_TIMEOUT,
    max_connections: int | None = MAX_CONNECTIONS,
    app_options: dict[str, Any] | None = None,
    **uvicorn_options: Any,
) -> None:
    """Serve the app with uvicorn (blocking) and print the page's URL once it answers. ``port=0``
    picks a free one. ``gc_tuning``: apply `tune_gc` once the app is built (opt-in: it changes the
    whole process's collector); ``app_options`` go to
    `create_app` (``authenticate``, ``limits``…); the timeouts and ``max_connections`` are
    `uvicorn_config`'s."""
    from .app import create_app

    warn_if_open(host, allowed_hosts)
    app: Starlette = create_app(agent_or_factory, auth_token=auth_token, allowed_origins=allowed_origins,
                                allowed_hosts=allowed_hosts, **(app_options or {}))
    if gc_tuning:
        tune_gc()
    config = uvicorn_config(app, host, port, header_timeout=header_timeout, idle_timeout=idle_timeout,
                            max_connections=max_connections, **uvicorn_options)
    sock = config.bind_socket()
    server = _AnnouncingServer(config, host, sock.getsockname()[1], bool(auth_token))
    server.run(sockets=[sock])


def serve_workers(import_string: str, host: str, port: int, workers: int, token: bool, *,
                  allowed_hosts: Sequence[str] | None = None, **options: Any) -> None:
    """Serve with ``workers`` processes sharing the socket (blocking), each building its app from
    ``import_string`` (``"module:factory"``, a function returning the app), and print the page's
    URL once it answers (``token``: whether the URL needs one). ``allowed_hosts``: what the apps
    check the Host against, warned about as `serve` does; ``options`` are `uvicorn_config`'s."""
    warn_if_open(host, allowed_hosts)
    config = uvicorn_config(import_string, host, port, factory=True, workers=workers, **options)
    sock = config.bind_socket()
    stop = threading.Event()
    threading.Thread(target=_wait_then_announce, args=(host, sock.getsockname()[1], token, stop),
                     daemon=True).start()
    try:
        Multiprocess(config, sockets=[sock]).run()
    finally:
        stop.set()
        sock.close()


class _AnnouncingServer(uvicorn.Server):
    """Prints the URL after startup: the app's lifespan (the agent factory) has run and the
    socket is being served, so the URL works the moment it appears."""

    def __init__(self, config: Any, host: str, port: int, token: bool) -> None:
        super().__init__(config)
        self._where = (host, port, token)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            _announce(*self._where)
