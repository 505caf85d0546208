"""How to reach an MCP server: a subprocess over stdio, or a URL over streamable HTTP."""

from __future__ import annotations

import inspect
import os
import urllib.request
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx2
from mcp.client import Transport as SDKTransport
from mcp.client.streamable_http import streamable_http_client

from ._capped_reader import Answers
from ._http_cap import CappingTransport
from ._stdio import stdio_streams

__all__ = ["AuthCallback", "HttpTransport", "StdioTransport", "Transport"]

_HTTP_TIMEOUT = 30.0
"""Seconds to connect, write and wait for a pool slot (the SDK's default)."""
_HTTP_READ_TIMEOUT = 300.0
"""Seconds between two reads of a response: a server holds an SSE stream open (the SDK's default)."""

AuthCallback = Callable[[], Mapping[str, str] | Awaitable[Mapping[str, str]]]
"""Called before every HTTP request; returns headers to add (``{"Authorization": "Bearer …"}``)."""


@dataclass(frozen=True)
class StdioTransport:
    command: str
    args: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    cwd: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.command, str) or not self.command:
            raise ValueError("command must be the program that starts the MCP server, e.g. 'uvx' or sys.executable")
        if any(not isinstance(a, str) for a in self.args):
            raise TypeError("args must be strings")
        if self.cwd is not None and not os.path.isdir(self.cwd):
            raise ValueError(f"cwd {self.cwd!r} is not a directory")

    def default_name(self) -> str:
        script = next((a for a in self.args if not a.startswith("-")), None)
        base = os.path.basename(script if script is not None and self.command.startswith(("python", "/")) else
                                self.command)
        return os.path.splitext(base)[0] or "mcp"

    def sdk_transport(self, answers: Answers) -> SDKTransport:
        """A transport for the SDK: the started server's (read, write) streams, its long answers
        read under the caps ``answers`` knows."""
        return stdio_streams(self.command, list(self.args), self.env, self.cwd, answers)


@dataclass(frozen=True)
class HttpTransport:
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    auth: AuthCallback | httpx2.Auth | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url) if isinstance(self.url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"url must be an http(s) URL of the MCP endpoint, e.g. 'http://127.0.0.1:8000/mcp'; "
                             f"got {self.url!r}")
        if self.auth is not None and not (callable(self.auth) or isinstance(self.auth, httpx2.Auth)):
            raise TypeError("auth must be a callable returning headers, or an httpx2.Auth")

    def default_name(self) -> str:
        return urlsplit(self.url).hostname or "mcp"

    def sdk_transport(self, answers: Answers) -> SDKTransport:
        """A transport for the SDK: our own HTTP client (headers, auth; its long answers read
        under the caps ``answers`` knows), closed with the session."""
        auth = self.auth if isinstance(self.auth, httpx2.Auth) or self.auth is None else _CallbackAuth(self.auth)
        url, headers = self.url, self.headers

        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def transport() -> AsyncGenerator[Any, None]:
            # (a client given a transport takes no proxy from the environment: ours does)
            inner = httpx2.AsyncHTTPTransport(proxy=_environment_proxy(url))
            http = httpx2.AsyncClient(
                headers=dict(headers), auth=auth, timeout=httpx2.Timeout(_HTTP_TIMEOUT, read=_HTTP_READ_TIMEOUT),
                transport=CappingTransport(inner, answers))
            # The transport bounds every message (see _http_cap), so the SDK's own bound on one
            # SSE event, which a capped answer rewritten there may pass, is not wanted.
            async with http, streamable_http_client(url, http_client=http, max_sse_event_size=None) as streams:
                yield streams

        return transport()

    def __repr__(self) -> str:  # never print the headers: they may carry credentials
        return f"HttpTransport(url={self.url!r})"


Transport = StdioTransport | HttpTransport


def _environment_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``HTTPS_PROXY``, ``ALL_PROXY``, ``NO_PROXY``…)."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return proxy


class _CallbackAuth(httpx2.Auth):
    """Asks the callback for headers before each request, so a refreshed token is used at once."""

    def __init__(self, fn: AuthCallback) -> None:
        self.fn = fn

    async def async_auth_flow(self, request: httpx2.Request) -> AsyncGenerator[httpx2.Request, httpx2.Response]:
        headers = self.fn()
        if inspect.isawaitable(headers):
            headers = await headers
        for key, value in dict(headers).items():
            request.headers[key] = value
        yield request

    def sync_auth_flow(self, request: httpx2.Request) -> Generator[httpx2.Request, httpx2.Response, None]:
        raise RuntimeError("the MCP client is async only")
