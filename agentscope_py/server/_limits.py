"""What one request may cost: the body's size, its JSON's nesting, the number and length of its
messages, and what one client may keep buffered; everything is checked before anything runs. And
how many idle sessions a served process keeps in memory."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from starlette.requests import Request
from starlette.types import Receive

from .._deadline import SharedTimeout
from ..agent.store import check_session_bounds
from ._errors import HTTPError
from ._identity import header_value

__all__ = ["Limits", "check_shape", "read_json"]


@dataclass(frozen=True)
class Limits:
    """Per-request and per-client limits of `create_app` (each refusal is a 422 naming the limit).

    ``max_json_depth``: how deep the body's JSON may nest (``{"a": [1]}`` is 2);
    ``max_messages``: messages in one request (AG-UI ``messages``, native ``input``);
    ``max_message_chars``: characters of text in one message (inline binary data not counted);
    ``buffer_bytes``: bytes a run not detached may make ahead of its slowest client before it waits for
    it (with at most `_runs.live.PACE` frames; docs/server.md, "A stalled client's cost"), and the frames one
    client may have waiting for its socket, for a response fed by a producer task;
    ``stall_timeout``: seconds a client may go without taking a frame before it is dropped, as if it
    had disconnected (a run not detached is cancelled; the client may resume from the log; ``None``:
    never);
    ``body_timeout``: seconds a client has to send its whole body (408 after; ``None``: no limit);
    ``max_sessions`` and ``session_idle_ttl``: the bounds given to the agent's state store when it
    is an `InMemoryStateStore` without bounds of its own (the builder's default), so a served
    process does not keep every session it ever saw (``None`` for both: keep them all);
    ``max_runs``: runs in progress in this process (those waiting for their session's turn
    included), ``max_runs_per_user``: of them, one user's (``None``: no limit); past either a new
    run is refused with 429 and ``Retry-After: retry_after`` seconds."""

    max_json_depth: int = 32
    max_messages: int = 1_000
    max_message_chars: int = 200_000
    buffer_bytes: int = 256 * 1024
    stall_timeout: float | None = 30.0
    body_timeout: float | None = 30.0
    max_sessions: int | None = 10_000
    session_idle_ttl: float | None = 3600.0
    max_runs: int | None = 10_000
    max_runs_per_user: int | None = None
    retry_after: float = 1.0

    def __post_init__(self) -> None:
        check_session_bounds(self.max_sessions, self.session_idle_ttl, "session_idle_ttl")
        for name in ("max_runs", "max_runs_per_user"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value > 0):
                raise ValueError(f"Limits({name}=...) must be a positive int or None (no limit), got {value!r}")
        if not self.retry_after > 0:
            raise ValueError(f"Limits(retry_after=...) must be positive seconds, got {self.retry_after!r}")


async def read_json(request: Request, limit: int, depth: int, seconds: float | None = None) -> Any:
    """The JSON body, counting the bytes actually read (a lying Content-Length cannot pass), and
    read within ``seconds`` (a body sent a byte at a time holds a connection otherwise)."""
    declared = header_value(request.scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, "body_too_large", f"request body too large: limit is {limit} bytes")
    try:
        # The loop's shared clock, not a loop timer per request: the body has nearly always
        # arrived with the headers.
        with SharedTimeout(seconds):
            body = await _body(request.receive, limit)
    except TimeoutError:
        raise HTTPError(408, "body_timeout", f"the body did not arrive within body_timeout={seconds} s") from None
    try:
        # RFC 8259 §8.1: JSON between systems is UTF-8; json.loads also takes UTF-16/32 and a BOM,
        # which the byte scan below would misread, so such a body is first made UTF-8.
        encoding = json.detect_encoding(body)
        if encoding != "utf-8":
            body = body.decode(encoding).encode()
        if _nests_deeper(body, depth):
            raise _too_deep(depth)
        # UTF-8 by now: decoded as json.loads decodes bytes, without it finding the encoding again.
        return json.loads(body.decode("utf-8", "surrogatepass"))
    except RecursionError:  # the parser's own guard, for a max_json_depth set near it
        raise _too_deep(depth) from None
    except UnicodeDecodeError as exc:  # the codec's own words name neither the body nor the remedy
        raise HTTPError(422, "invalid_json", f"the body is not valid {exc.encoding.upper()}: {exc.reason} at byte "
                        f"{exc.start}; send the JSON encoded as UTF-8") from None
    except json.JSONDecodeError as exc:
        raise HTTPError(422, "invalid_json", f"the body is not valid JSON: {exc}") from None
    except ValueError:  # the parser's bound on an integer's digits (its words name a Python call)
        raise HTTPError(422, "invalid_json", f"the body holds an integer of more than {sys.get_int_max_str_digits()} "
                        "digits, longer than this server reads; send it as a string") from None


async def _body(receive: Receive, limit: int) -> bytes:
    """The request's body from its ASGI messages (what Starlette's ``request.stream()`` reads,
    without an async generator in between: most bodies are one message)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        kind = message["type"]
        if kind == "http.request":
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, "body_too_large", f"request body too large: limit is {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        elif kind == "http.disconnect":
            raise HTTPError(400, "client_disconnected", "the client disconnected while sending the body")


def check_shape(data: Any, key: str, limits: Limits) -> None:
    """Refuse a body whose ``data[key]`` holds more than ``max_messages`` messages or a message
    with more than ``max_message_chars`` characters of text (a string ``data[key]`` is one)."""
    if not isinstance(data, dict):
        return
    messages = data.get(key)
    if isinstance(messages, str):
        messages = [messages]
    if not isinstance(messages, list):
        return
    if len(messages) > limits.max_messages:
        raise HTTPError(422, "limit_exceeded",
                        f"{key}: {len(messages)} messages; the limit is max_messages={limits.max_messages}")
    for i, message in enumerate(messages):
        chars = _chars(message)
        if chars > limits.max_message_chars:
            raise HTTPError(422, "limit_exceeded", f"{key}.{i}: {chars} characters; the limit is "
                            f"max_message_chars={limits.max_message_chars}")


def _too_deep(depth: int) -> HTTPError:
    return HTTPError(422, "limit_exceeded", f"the body's JSON nests too deep; the limit is max_json_depth={depth}")


def _nests_deeper(body: bytes, limit: int) -> bool:
    """Whether the JSON in ``body`` nests deeper than ``limit``, read from its bytes.

    Why before parsing: json.loads recurses once per level, so a deep body took the parser to the
    interpreter's recursion limit, and whatever ran there (a garbage collection's finalizers, the
    hook that reports their errors) failed for want of stack. Outside strings every bracket of valid
    JSON is structural, and with the escaped backslashes and then the escaped quotes taken out, the
    quotes left delimit the strings (no backslash stands outside one); with the strings cut out the
    depth is the running sum of +1 per opening and -1 per closing bracket. All of it runs in C
    (replace, split, translate, accumulate), and a body with fewer brackets than the limit cannot
    nest past it. Invalid JSON: up to its first error, where the parser stops, the parser sees the
    strings and brackets this counts, so it never goes deeper than counted here."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    if b"\\" in body:
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = b"".join(body.split(b'"')[::2]).translate(None, _NOT_BRACKET)
    return max(accumulate(map(_STEP.__getitem__, structure)), default=0) > limit


_NOT_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")
_STEP = [1 if c in b"[{" else -1 if c in b"]}" else 0 for c in range(256)]


def _chars(value: Any) -> int:
    """Characters of text in a message's JSON. Inline binary data (an AG-UI ``{"type": "data",
    "value"}`` source, a native ``DataBlock``) is not text: ``max_body_bytes`` bounds it."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            if item.get("type") != "data":
                stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def admit_run(limits: Limits, running: int, mine: int) -> None:
    """429 with ``Retry-After`` when one more run (``running`` in this process, ``mine`` of its
    user's) would pass ``limits``."""
    if limits.max_runs is not None and running >= limits.max_runs:
        raise _busy(f"this server is running its limit of {limits.max_runs} runs (max_runs)", limits)
    if limits.max_runs_per_user is not None and mine >= limits.max_runs_per_user:
        raise _busy(f"you have {mine} runs in progress, the limit per user (max_runs_per_user)", limits)


def _busy(message: str, limits: Limits) -> HTTPError:
    seconds = max(1, round(limits.retry_after))
    return HTTPError(429, "too_many_runs", f"{message}; retry in {seconds} s", headers={"retry-after": str(seconds)})
