"""`Http1Transport`: a deprecated name, kept importable, for httpx2's own transport.

By default the providers send over aiohttp (`AioHttpSender`), and an SDK client a user passes keeps
whatever HTTP client it was given. Code that builds an SDK client over ``Http1Transport`` gets
httpx2's default transport with the same ``verify`` and ``limits``.
"""

from __future__ import annotations

import ssl
import warnings

import httpx2

__all__ = ["Http1Transport"]


class Http1Transport(httpx2.AsyncHTTPTransport):
    """Deprecated: httpx2's ``AsyncHTTPTransport`` (HTTP/1.1, proxies, TLS) under its old name;
    construct ``httpx2.AsyncHTTPTransport`` instead, or let the model make its own client."""

    def __init__(self, *, verify: ssl.SSLContext | bool = True,
                 limits: httpx2.Limits = httpx2.Limits(max_connections=100, max_keepalive_connections=20)) -> None:
        warnings.warn("agentscope_py.model.Http1Transport is deprecated: it is httpx2.AsyncHTTPTransport now; "
                      "use that, or let the model make its own client (it sends over aiohttp)",
                      DeprecationWarning, stacklevel=2)
        super().__init__(verify=verify, limits=limits)
