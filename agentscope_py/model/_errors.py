"""Turning provider failures into the typed `ModelError`s, the same way for every provider.

The agent's retry policy decides on ``ModelError.retryable`` and ``retry_after`` alone, so every
provider must classify HTTP statuses, error bodies and transport failures identically.
"""

from __future__ import annotations

import email.utils
import re
import time
from collections.abc import Mapping
from typing import Any

from .base import (
    AuthenticationError,
    BadRequestError,
    ContextLengthError,
    MalformedStreamError,
    ModelConnectionError,
    ModelError,
    ModelTimeoutError,
    OverloadedError,
    RateLimitError,
    ServerError,
)

__all__ = [
    "error_from_body",
    "error_from_status",
    "malformed",
    "message_of",
    "parse_retry_after",
    "quote",
    "transport_error",
    "undecodable",
]

QUOTE_LIMIT = 500
"""How much of what a server sent goes into an error message: enough to recognise an HTML error
page or a proxy's complaint, not so much that a log line becomes the whole body."""

_CONTEXT = re.compile(
    r"context[ _-]?(length|window|size)|maximum context|too long|too many tokens|exceeds? the context",
    re.IGNORECASE,
)
# Error types that name an overflowing prompt: OpenAI's code, llama.cpp's server's type.
_CONTEXT_KINDS = frozenset({"context_length_exceeded", "exceed_context_size_error"})

# llama-cpp-python's server answers a request its pydantic model refuses with HTTP 500 and
# "N validation errors:\n  {'type': …, 'loc': ('body', …), …}": a bad request, not a server fault,
# and retrying it cannot help.
_REQUEST_VALIDATION = re.compile(r"validation errors?:?\s.*'loc': \('body'", re.DOTALL)

# Error ``type`` / ``code`` strings of OpenAI-compatible servers and Anthropic, for error frames
# that arrive without an HTTP status (mid-stream).
_BY_TYPE: dict[str, type[ModelError]] = {
    "overloaded_error": OverloadedError,
    "rate_limit_error": RateLimitError,
    "rate_limit_exceeded": RateLimitError,
    "authentication_error": AuthenticationError,
    "permission_error": AuthenticationError,
    "invalid_api_key": AuthenticationError,
    "invalid_request_error": BadRequestError,
    "not_found_error": BadRequestError,
    "request_too_large": BadRequestError,
    "context_length_exceeded": ContextLengthError,
    "exceed_context_size_error": ContextLengthError,
    "timeout_error": ModelTimeoutError,
    "api_error": ServerError,
    "server_error": ServerError,
}


def parse_retry_after(headers: Mapping[str, str] | None) -> float | None:
    """Seconds to wait, from ``retry-after-ms``, ``retry-after`` (seconds or an HTTP date)."""
    if not headers:
        return None
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            return max(0.0, float(millis) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def message_of(body: Any, fallback: str) -> str:
    """The provider's own message from a JSON error body (``{"error": {"message": …}}``,
    ``{"message": …}`` or ``{"error": "…"}``), else ``fallback``."""
    if isinstance(body, Mapping):
        inner = body.get("error", body)
        if isinstance(inner, str) and inner:
            return inner
        if isinstance(inner, Mapping):
            message = inner.get("message")
            if isinstance(message, str) and message:
                return message
    return fallback


def _kind_of(body: Any) -> tuple[str | None, Any]:
    """The ``type`` (or string ``code``) and the raw ``code`` of a JSON error body."""
    if not isinstance(body, Mapping):
        return None, None
    inner = body.get("error", body)
    if not isinstance(inner, Mapping):
        return None, None
    code = inner.get("code")
    kind = inner.get("type")
    if isinstance(code, str) and code in _BY_TYPE:
        kind = code  # OpenAI puts the precise reason in ``code`` ("context_length_exceeded")
    return (kind if isinstance(kind, str) else None), code


def _bad_request(message: str, kind: str | None) -> type[ModelError]:
    if kind in _CONTEXT_KINDS or _CONTEXT.search(message):
        return ContextLengthError
    return BadRequestError


def error_from_status(
    status: int,
    message: str,
    *,
    provider: str,
    headers: Mapping[str, str] | None = None,
    body: Any = None,
) -> ModelError:
    """The error for an HTTP error response."""
    kind, code = _kind_of(body)
    retry_after = parse_retry_after(headers)
    cls: type[ModelError]
    retryable: bool | None = None
    if status in (401, 403):
        cls = AuthenticationError
    elif status == 429:
        cls = RateLimitError
        if code == "insufficient_quota":  # a 429 that waiting does not fix
            retryable = False
    elif status == 408:
        cls = ModelTimeoutError
    elif status == 529 or kind == "overloaded_error":
        cls = OverloadedError
    elif status == 500 and _REQUEST_VALIDATION.search(message):
        cls = BadRequestError
    elif status >= 500:
        cls = ServerError
    elif status >= 400:
        cls = _bad_request(message, kind)
    else:
        cls = ModelError
    return cls(
        f"{provider}: {message}",
        provider=provider,
        status_code=status,
        retry_after=retry_after,
        retryable=retryable,
    )


def error_from_body(body: Any, *, provider: str) -> ModelError:
    """The error for an error frame inside a stream (no HTTP status to go by)."""
    message = message_of(body, "the stream reported an error")
    kind, code = _kind_of(body)
    if isinstance(code, int) and 400 <= code < 600:
        return error_from_status(code, message, provider=provider, body=body)
    cls = _BY_TYPE.get(kind or "", ServerError)
    if cls is BadRequestError:
        cls = _bad_request(message, kind)
    return cls(f"{provider}: {message}", provider=provider)


def quote(text: str | bytes, limit: int = QUOTE_LIMIT) -> str:
    """The first ``limit`` characters of ``text`` as a Python literal, marked when cut short."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    head = repr(text[:limit])
    return head + "…" if len(text) > limit else head


def malformed(provider: str, detail: str) -> MalformedStreamError:
    return MalformedStreamError(f"{provider}: malformed stream: {detail}", provider=provider)


def undecodable(provider: str, exc: BaseException) -> MalformedStreamError:
    """A body that says it is compressed (``Content-Encoding``) and is not: broken by the server."""
    return malformed(provider, f"the response's body could not be decoded: {quote(str(exc) or type(exc).__name__)}")


def transport_error(provider: str, exc: BaseException, *, in_body: bool, timeout: bool) -> ModelError:
    """A failure below HTTP: a timeout, a refused connection, or a response cut off."""
    detail = str(exc) or type(exc).__name__
    if timeout:
        return ModelTimeoutError(f"{provider}: request timed out ({detail})", provider=provider)
    if in_body:  # the response had started: the stream is incomplete
        return malformed(provider, f"the connection closed before the stream ended ({detail})")
    return ModelConnectionError(f"{provider}: connection failed ({detail})", provider=provider)
