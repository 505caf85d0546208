"""Who a request acts for. Every session, run and interrupt is scoped to the user `Identity.user`
returns, so one client cannot write into, read back or stop another user's thread.

Run ids too: the server's own (``run_<24 hex>``, `new_run_id`) cannot be guessed, and the ids an
AG-UI client chooses are registered under its user (`run_key`), so one user's ``runId`` never
collides with another's: nobody can claim, block or probe another user's ids."""

from __future__ import annotations

import inspect
import re
import secrets
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.types import Scope

from ._errors import HTTPError

__all__ = ["DEFAULT_USER", "USER_HEADER", "Authenticate", "Identity", "client_run_id", "header_value", "new_run_id",
           "run_key", "run_keys"]

USER_HEADER = "x-user-id"
"""Without ``authenticate`` and without a token, requests may name their user with this header."""

DEFAULT_USER = "default"
_USER_KEY = USER_HEADER.encode("latin-1")


def header_value(scope: Scope, name: bytes) -> str | None:
    """The first value of the header ``name`` (lower case, as ASGI gives names), as
    ``request.headers.get`` reads it, without building its `Headers` for one look-up (and
    without the `KeyError` its ``get`` catches for a header that is not there)."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


Authenticate = Callable[[Request], "str | Awaitable[str | None] | None"]
"""``fn(request) -> user_id`` (or a coroutine function): the user the request proves it is, from
the bearer token, a header set by a trusted proxy or a cookie; ``None`` or ``""`` means not
authenticated (401)."""


class Identity:
    """The one place that decides a request's user (other endpoints call `user` too).

    * With ``authenticate``: its answer. A user id the client also sends (``X-User-Id``, a body's
      ``user_id``) must be the same one, or the request is refused (403).
    * With a shared token and no ``authenticate``: everyone holding the token is the same user,
      ``"default"``; a client-chosen id is refused (403), since nothing proves it.
    * With neither: whatever the client says (default ``"default"``). Anyone who can reach the
      server can then act as any user: fit for a single user on loopback, not more."""

    def __init__(self, authenticate: Authenticate | None, token_configured: bool) -> None:
        self.authenticate = authenticate
        self.token_configured = token_configured

    async def user(self, request: Request, claimed: str | None = None) -> str:
        """The user ``request`` acts for; ``claimed`` is a user id from its body."""
        header = header_value(request.scope, _USER_KEY) or None
        claims = [c for c in (claimed, header) if c]
        if self.authenticate is not None:
            answer = self.authenticate(request)
            user = await answer if inspect.isawaitable(answer) else answer
            if not user:
                raise HTTPError(401, "unauthenticated", "the request is not authenticated")
            if not isinstance(user, str):
                raise TypeError(f"authenticate() returned {type(user).__name__}, not a user id string")
            if any(c != user for c in claims):
                raise HTTPError(403, "forbidden", "the user id in the request is not the authenticated user")
            return user
        if self.token_configured:
            if any(c != DEFAULT_USER for c in claims):
                raise HTTPError(403, "forbidden", "this server cannot tell users apart (one shared token): "
                                "a client may not choose its user id; the server needs create_app(authenticate=...)")
            return DEFAULT_USER
        return claimed or header or DEFAULT_USER


_SERVER_RUN_ID = re.compile(r"run_[0-9a-f]{24}")
_SCOPED = "agui/"


def new_run_id() -> str:
    """A run id of the server's own (native runs): unguessable, so global."""
    return "run_" + secrets.token_hex(12)


def run_key(user_id: str, run_id: str) -> str:
    """Where a run whose id its client chose is registered: under its user. A client's run id
    never holds ``/`` (it names the run in URL paths: `check_run_id`), so the key splits back
    into its parts and never equals an id a URL can name."""
    return f"{_SCOPED}{user_id}/{run_id}"


def client_run_id(key: str) -> str:
    """The run id its client knows, of a run registered under ``key`` (`run_key`, or an id as it is)."""
    return key.rsplit("/", 1)[-1] if key.startswith(_SCOPED) else key


def run_keys(user_id: str, run_id: str) -> tuple[str, str]:
    """Where the run that ``user_id`` names ``run_id`` in a URL may be registered, likeliest
    first: under the user (an id their client chose), or as it is (a server id, or a run a log
    holds under the id it was given, such as a durable run started outside this server). The
    latter never finds another user's client-chosen id: those keys hold a ``/``, which a URL's
    path segment cannot."""
    scoped = run_key(user_id, run_id)
    return (run_id, scoped) if _SERVER_RUN_ID.fullmatch(run_id) else (scoped, run_id)
