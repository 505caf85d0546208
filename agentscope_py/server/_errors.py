"""What clients hear about failures: a type, a safe message and the request id. The details (the
exception, its traceback, file paths a store put in its message) go to the server log under the
same request id, so an operator can find them from what a user reports."""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Match, Route

__all__ = ["STORE_UNAVAILABLE", "ClientError", "HTTPError", "JSONAnswer", "StoreUnavailable", "describe",
           "log_failure", "new_request_id", "no_route", "request_id"]

from ..errors import (
    BusyError,
    InputError,
    MiddlewareTermination,
    ModelError,
    PendingToolCallsError,
    ResumeError,
    StateConflictError,
    StateStoreError,
    StructuredOutputError,
    ToolArgumentError,
)

log = logging.getLogger("agentscope_py.server")

REQUEST_ID_HEADER = "x-request-id"

# Exceptions whose messages are written for the person using the agent (a provider's error, a
# guardrail, a budget, a mistake in the input): shown as they are.
_SHOWN: tuple[type[BaseException], ...] = (
    ModelError, ResumeError, ToolArgumentError, StructuredOutputError, MiddlewareTermination, InputError,
)
# ... except these, whose messages name files, hosts or keys of the deployment.
_HIDDEN: tuple[type[BaseException], ...] = (StateStoreError,)
# The client asked for something that cannot be done: one log line, no traceback.
_MISTAKES: tuple[type[BaseException], ...] = (ResumeError, ToolArgumentError, InputError)

Vocabulary = Literal["agui", "native"]


def new_request_id() -> str:
    """A fresh id (never one the client sent: it goes into log lines)."""
    return "req_" + secrets.token_hex(8)


def request_id(request: Request) -> str:
    """The id `Guard` gave this request (one is made when the app runs without it)."""
    state = request.scope.setdefault("state", {})
    rid = state.get("request_id")
    if not isinstance(rid, str):
        rid = state["request_id"] = new_request_id()
    return rid


class JSONAnswer(JSONResponse):
    """A JSON response that can quote what a client sent: a lone UTF-16 surrogate (JSON's
    ``"\\ud800"``, in an id a refusal names) has no UTF-8 form, so it is written back as the same
    JSON escape, which is valid inside the string it stands in."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
            "utf-8", "backslashreplace")


class HTTPError(Exception):
    """A refusal before anything runs: ``status``, a stable ``type`` and a readable ``detail``."""

    def __init__(self, status: int, type: str, detail: str, errors: list[dict[str, Any]] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.type = type
        self.detail = detail
        self.errors = errors
        self.headers = headers  # e.g. Retry-After of a 429

    def response(self, rid: str, headers: dict[str, str] | None = None) -> JSONAnswer:
        body: dict[str, Any] = {"type": self.type, "detail": self.detail, "request_id": rid}
        if self.errors:
            body["errors"] = self.errors
        return JSONAnswer(body, status_code=self.status, headers={**(self.headers or {}), **(headers or {})})


def no_route(request: Request, exc: Exception) -> JSONAnswer:
    """The router's refusals in the shape of every other: a 404 for a path no route has, naming
    the routes there are; a 405 for a method the path does not take, with ``Allow`` listing the
    methods of every route at that path (Starlette's own names only the first route's)."""
    rid = request_id(request)
    routes = [r for r in request.app.router.routes if isinstance(r, Route)]
    asked = f"{request.method} {request.url.path[:200]}"
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    if status == 405:
        allowed = sorted({m for r in routes if r.matches(request.scope)[0] is not Match.NONE for m in r.methods or ()})
        if allowed:
            return HTTPError(405, "method_not_allowed", f"{asked}: this path takes {', '.join(allowed)}",
                             headers={"allow": ", ".join(allowed)}).response(rid)
    served = ", ".join(f"{m} {r.path}" for r in sorted(routes, key=lambda r: r.path)
                       for m in sorted(r.methods or ()) if m != "HEAD")
    return HTTPError(404, "not_found", f"{asked}: no such path here; this server serves {served}").response(rid)


STORE_UNAVAILABLE = "StateStoreUnavailable"
"""The code of an AG-UI ``RUN_ERROR`` for a run refused because the session store failed, and of
the terminal frame of a run the store failed under (Redis restarted, a disk full)."""


class StoreUnavailable(Exception):
    """The session store failed while a request read it, before its run started (a file it
    cannot open, a database down). The client hears that the server cannot serve it now: HTTP
    503 with ``Retry-After`` (AG-UI: a ``RUN_ERROR`` with code `STORE_UNAVAILABLE`); the store's
    own error, which names files and hosts, goes to the log."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause

    def message(self, rid: str, retry_after: int) -> str:
        return f"the session store is unavailable; try again in {retry_after} s (request id {rid})"

    def http_error(self, rid: str, retry_after: int) -> HTTPError:
        return HTTPError(503, "state_store_unavailable", self.message(rid, retry_after),
                         headers={"retry-after": str(retry_after)})


@dataclass(frozen=True)
class ClientError:
    """How a failure is reported: ``code`` (the exception class when its message is shown, else
    ``InternalError``), ``message`` (safe to show) and whether it was the client's mistake."""

    code: str
    message: str
    client_mistake: bool


def describe(exc: BaseException, rid: str, vocabulary: Vocabulary, pending: Sequence[str] = ()) -> ClientError:
    """The client's view of ``exc``, in the words of the endpoint it used (``pending``: the ids of
    the session's waiting tool calls, for a `PendingToolCallsError`)."""
    if isinstance(exc, PendingToolCallsError):
        message = (_in_doubt_message(vocabulary, exc.in_doubt) if exc.in_doubt
                   else _pending_message(vocabulary, exc.tool_call_ids or pending))
        return ClientError(type(exc).__name__, message, True)
    if isinstance(exc, BusyError):  # the code a 409 refusal has too (`_multitask`)
        return ClientError(exc.code, str(exc), True)
    if isinstance(exc, _SHOWN) and not isinstance(exc, _HIDDEN):
        message = str(exc) or type(exc).__name__
        if isinstance(exc, ResumeError):
            message = message.replace(_PYTHON_CONFIRM, _HTTP_CONFIRM[vocabulary])
            if vocabulary == "agui":
                message = (message.replace("confirm results were", "resume entries were")
                           .replace("confirm result", "resume entry").replace("for confirmation", "for approval"))
        elif isinstance(exc, InputError) and message.startswith(_PYTHON_EMPTY):
            message = _HTTP_EMPTY[vocabulary]
        return ClientError(type(exc).__name__, message, isinstance(exc, _MISTAKES))
    # The store's own messages name hosts, files and versions (the log has them); the client hears
    # what it can act on: the store, not the agent, failed, and the turn may be missing.
    if isinstance(exc, StateConflictError):  # another run saved the session: its lock was lost
        return ClientError(type(exc).__name__, "another run saved this session while this one ran (the session's "
                           "lock was lost: its store restarted, or the lock expired), so this turn was not saved; "
                           f"send it again (request id {rid})", False)
    if isinstance(exc, StateStoreError):
        return ClientError(STORE_UNAVAILABLE, "the session store failed during the run, so its turn may not be "
                           f"saved; try again in a moment (request id {rid})", False)
    return ClientError("InternalError", f"the run failed on the server (request id {rid})", False)


# The agent's words for a Python caller, and a client's over HTTP: the part of a refusal that
# names a Python call (the agent's message, `_resume` and `_input`), and what replaces it.
_PYTHON_CONFIRM = "build answers with confirm_message(...), over HTTP with `confirm`"
_HTTP_CONFIRM: dict[Vocabulary, str] = {
    "native": "send answers in `confirm` ([{\"tool_call_id\": ..., \"confirmed\": true}])",
    "agui": "answer interrupts with `resume` entries",
}
_PYTHON_EMPTY = "the agent input is empty"
_HTTP_EMPTY: dict[Vocabulary, str] = {
    "native": "nothing to run: no tool call of this session waits for an answer any more; send \"input\" "
              "(the user's text, e.g. \"hello\")",
    "agui": "nothing to run: no tool call of this thread waits for an answer any more; send the user's new "
            "message last in `messages` (e.g. {\"id\": \"msg-2\", \"role\": \"user\", \"content\": \"hello\"})",
}


def _pending_message(vocabulary: Vocabulary, pending: Sequence[str]) -> str:
    ids = ", ".join(pending) or "see the last run"
    if vocabulary == "agui":
        return (f"this thread has tool calls waiting ({ids}): answer them first with `resume` (one entry per "
                "interrupt: interruptId = the tool call id, status \"resolved\" with payload {\"approved\": true} "
                "or {\"approved\": false}, or status \"cancelled\"), or with `tool` messages for frontend tools")
    return (f"this session has tool calls waiting ({ids}): answer them first with `confirm` "
            "([{\"tool_call_id\": ..., \"confirmed\": true}]), or with tool-role messages in `input` "
            "for external tools")


def _in_doubt_message(vocabulary: Vocabulary, ids: Sequence[str]) -> str:
    """Calls whose run stopped while they ran: the user hears of them here first (the run that
    would have asked died), so the message says what they are and the answer they take."""
    head = (f"this {'thread' if vocabulary == 'agui' else 'session'} has tool calls in doubt ({', '.join(ids)}): "
            "the run that made them stopped while they ran, so they may or may not have taken effect. ")
    if vocabulary == "agui":
        return head + ("Answer each first with `resume` (interruptId = the tool call id, status \"resolved\" with "
                       "payload {\"done\": true} if it took effect or {\"done\": false} to run it now, or status "
                       "\"cancelled\" to skip it), or send a run with no new messages to be asked about them")
    return head + ("Answer each first with `confirm` ([{\"tool_call_id\": ..., \"confirmed\": true, \"answer\": "
                   "{\"done\": true}}] if it took effect, {\"done\": false} to run it now, or \"confirmed\": false "
                   "to skip it)")


def log_failure(exc: BaseException, error: ClientError, rid: str, what: str) -> None:
    """One line for a client's mistake; the traceback for anything else."""
    if error.client_mistake:
        log.info("request %s: %s refused: %s: %s", rid, what, type(exc).__name__, exc)
    else:
        log.warning("request %s: %s failed: %s: %s", rid, what, type(exc).__name__, exc, exc_info=exc)
