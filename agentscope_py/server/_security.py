"""The checks every request passes before an endpoint sees it, as one ASGI middleware (so SSE
responses stream through untouched):

1. a request id (the ``X-Request-Id`` response header; errors and log lines carry it);
2. the ``Host`` header: on a loopback connection only loopback names, unless ``allowed_hosts``
   is given (DNS rebinding: a page on ``evil.example`` whose name now resolves to 127.0.0.1);
3. the bearer token, when one is configured (compared in constant time);
4. for ``POST``: the ``Origin`` against an allow-list (default: the server's own origin) and a
   JSON content type (CSRF: a cross-site form or ``text/plain`` fetch needs no preflight);
5. headers that keep the page out of frames and its scripts to itself: the page gets its Content
   Security Policy with ``X-Frame-Options`` and ``Referrer-Policy``; every other response (the API's
   JSON and event streams) ``nosniff`` and a policy that loads nothing and is framed nowhere
   (``frame-ancestors 'none'``, which every current browser reads in place of
   ``X-Frame-Options``; a stream or a JSON body is no document whose links could send a referrer):
   the HTTP server checks every header of every response, and none of these says what another
   already does.
"""

from __future__ import annotations

import fnmatch
import functools
import hmac
import ipaddress
from collections.abc import Awaitable, Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._errors import REQUEST_ID_HEADER, HTTPError, new_request_id
from .sse import BODY_SEND

__all__ = ["PAGE_CSP", "Guard", "is_loopback"]

PAGE_CSP = ("default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self' data:; "
            "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
_API_CSP = "default-src 'none'; frame-ancestors 'none'"
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_RID = REQUEST_ID_HEADER.encode("latin-1")
_NOSNIFF = (b"x-content-type-options", b"nosniff")
_PAGE = (_NOSNIFF, (b"x-frame-options", b"DENY"), (b"referrer-policy", b"no-referrer"),
         (b"content-security-policy", PAGE_CSP.encode("latin-1")))
_API = (_NOSNIFF, (b"content-security-policy", _API_CSP.encode("latin-1")))
_POLICY_NAMES = frozenset(name for name, _ in _PAGE)
JSON_TYPES = ("application/json",)
"""Body types accepted for POST; ``application/<anything>+json`` (e.g. AG-UI's vendor types) too."""


@functools.lru_cache(maxsize=256)
def is_loopback(host: str) -> bool:
    # Cached: every request asks it of the address the server listens on.
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _hostname(host: str) -> str:
    """``example.com`` of ``example.com:8000``, ``::1`` of ``[::1]:8000``."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if ":" in host else host


class Guard:
    """See the module docstring. ``allowed_hosts`` are host names or ``*.domain`` patterns
    (``["*"]``: any); ``allowed_origins`` are ``scheme://host[:port]`` origins allowed besides
    the server's own."""

    def __init__(self, app: ASGIApp, *, token: str | None, allowed_hosts: Sequence[str] | None,
                 allowed_origins: Sequence[str], public_paths: Sequence[str] = ("/", "/healthz")) -> None:
        self.app = app
        self.token = token.encode() if token else None
        self.allowed_hosts = [h.lower() for h in allowed_hosts] if allowed_hosts is not None else None
        self.allowed_origins = {o.rstrip("/").lower() for o in allowed_origins}
        self.public_paths = frozenset(public_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = new_request_id()
        scope.setdefault("state", {})["request_id"] = rid
        scope[BODY_SEND] = send  # a streamed body's frames skip the wrappers inside (`SSEResponse`)
        page = scope["path"] == "/"

        def send_with_headers(message: Message) -> Awaitable[None]:
            # A plain function handing back ``send``'s awaitable: a streamed response sends every
            # frame through here, and an ``async def`` would be one coroutine more per frame.
            if message["type"] == "http.response.start":
                # The id is always ours; the policy headers only where the response set none.
                # (Names compared in lower case, as `MutableHeaders` does.)
                # One pass over the response's names; the others only when one of ours is there.
                headers = message.get("headers", ())
                present = {k.lower() for k, _ in headers}
                raw = [h for h in headers if h[0].lower() != _RID] if _RID in present else headers
                policy: tuple[tuple[bytes, bytes], ...] = _PAGE if page else _API
                if not present.isdisjoint(_POLICY_NAMES):
                    policy = tuple(h for h in policy if h[0] not in present)
                message["headers"] = [*raw, (_RID, rid.encode("latin-1")), *policy]
            return send(message)

        error = self._check(scope)
        if error is not None:
            extra = {"www-authenticate": "Bearer"} if error.status == 401 else None
            await error.response(rid, extra)(scope, receive, send_with_headers)
            return
        await self.app(scope, receive, send_with_headers)

    def _check(self, scope: Scope) -> HTTPError | None:
        headers = dict(scope["headers"])  # later duplicates win; only single-valued ones are read
        host = headers.get(b"host", b"").decode("latin-1").lower()
        if not self._host_allowed(scope, host):
            return HTTPError(400, "invalid_host", "the Host header is not one this server answers to")
        if self.token is not None and scope["path"] not in self.public_paths and not self._token_ok(headers):
            return HTTPError(401, "unauthorized",
                             "missing or invalid bearer token (send Authorization: Bearer <token>)")
        if scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            origin = headers.get(b"origin")
            if origin is not None and not self._origin_allowed(scope, origin.decode("latin-1"), host):
                return HTTPError(403, "forbidden_origin", "cross-origin requests are not allowed from this origin")
            if origin is None and headers.get(b"sec-fetch-site", b"same-origin") not in (b"same-origin", b"none"):
                return HTTPError(403, "forbidden_origin", "cross-site requests are not allowed")
            media = headers.get(b"content-type", b"").decode("latin-1").partition(";")[0].strip().lower()
            # A DELETE has no body to type; a browser preflights it cross-site like a JSON POST.
            typed = media in JSON_TYPES or (media.startswith("application/") and media.endswith("+json"))
            if scope["method"] != "DELETE" and not typed:
                return HTTPError(415, "unsupported_media_type", "send the body as Content-Type: application/json")
        return None

    def _host_allowed(self, scope: Scope, host: str) -> bool:
        name = _hostname(host)
        if self.allowed_hosts is not None:
            return any(p == "*" or fnmatch.fnmatchcase(name, p) for p in self.allowed_hosts)
        server = scope.get("server")
        if server is None or not is_loopback(str(server[0])):
            return True  # bound elsewhere: give allowed_hosts to check names
        return name in LOOPBACK_NAMES

    def _token_ok(self, headers: dict[bytes, bytes]) -> bool:
        assert self.token is not None
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.token)

    def _origin_allowed(self, scope: Scope, origin: str, host: str) -> bool:
        origin = origin.rstrip("/").lower()
        return origin in self.allowed_origins or origin == f"{scope.get('scheme', 'http')}://{host}"
