"""Pieces every provider shares: request options, block helpers and the SSE framing.

The SSE reader is our own rather than the SDKs': theirs end quietly when a stream is cut off or
never sends its terminator, and skip lines they do not understand, while we must report both as
`MalformedStreamError` so a partial reply is never taken for a complete one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..message import DataBlock, TextBlock, ToolResultBlock, ToolUseBlock
from ._errors import error_from_body, malformed, quote, transport_error
from .base import ChatChunk

__all__ = [
    "SSEvent",
    "arguments_text",
    "data_url",
    "merge_options",
    "reference",
    "result_parts",
    "sse_events",
    "stream_chunks",
]

PAYLOAD_ERRORS: tuple[type[Exception], ...] = (
    AttributeError, IndexError, KeyError, TypeError, ValueError, OverflowError, RecursionError,
)
"""What reading a JSON payload of the wrong shape raises (``"index": Infinity`` is an
OverflowError in ``int()``, JSON nested thousands deep a RecursionError): the server's fault, so a
`MalformedStreamError`, never a raw exception that retry and fallback would not recognise."""

# Keys the agent core puts in the options that are not provider request parameters.
_INTERNAL_OPTIONS = frozenset({"structured_output"})


def merge_options(defaults: Mapping[str, Any], request: Mapping[str, Any]) -> dict[str, Any]:
    """Constructor defaults overridden by per-request options, minus the core's own keys."""
    merged = {**defaults, **request}
    for key in _INTERNAL_OPTIONS:
        merged.pop(key, None)
    return merged


def arguments_text(call: ToolUseBlock) -> str:
    """The argument text to send back: what the model wrote if it was not valid JSON (so it sees
    its own mistake), else the parsed input."""
    if call.raw_input is not None:
        return call.raw_input
    return json.dumps(call.input, ensure_ascii=False)


def result_parts(result: ToolResultBlock) -> list[TextBlock | DataBlock]:
    if isinstance(result.output, str):
        return [TextBlock(text=result.output)] if result.output else []
    return list(result.output)


def data_url(block: DataBlock) -> str | None:
    """A URL for the data: its ``url``, or a ``data:`` URL of its base64 ``data``."""
    if block.data is not None:
        return f"data:{block.media_type};base64,{block.data}"
    return block.url


def reference(block: DataBlock) -> str:
    """A short text standing in for data a provider cannot take, so the model knows it exists."""
    if block.url is not None:
        return f"[{block.media_type}: {block.url}]"
    size = len(block.data or "")
    return f"[{block.media_type} data omitted: {size} base64 characters]"


# -- server-sent events --------------------------------------------------------------------------


_loads: Callable[[str], Any] | None
try:  # the server extra brings it; without it the stdlib reads every payload
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - exercised only without orjson
    _loads = None


@dataclass(frozen=True, slots=True)
class SSEvent:
    event: str | None
    data: str

    def json(self, provider: str) -> Any:
        if _loads is not None:
            try:
                return _loads(self.data)  # several times faster than json.loads on a chunk payload
            except ValueError:
                pass  # what orjson refuses and json may take (NaN, ints past 64 bits, lone surrogates)
        try:
            return json.loads(self.data)
        except (ValueError, RecursionError):
            raise malformed(provider, f"invalid JSON in event data: {quote(self.data)}") from None


class _EventParser:
    """SSE lines (bytes, without their endings) → events; the state between lines."""

    __slots__ = ("data", "event", "provider")

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self.event: str | None = None
        self.data: list[bytes] = []

    def feed(self, lines: list[bytes]) -> list[SSEvent]:
        out: list[SSEvent] = []
        for line in lines:
            if not line:
                if self.data or self.event is not None:
                    out.append(self.end())
                continue
            if line[0] == 58:  # ":" a comment, used as a keep-alive
                continue
            field, _, value = line.partition(b":")
            if value[:1] == b" ":
                value = value[1:]
            if field == b"data":
                self.data.append(value)
            elif field == b"event":
                self.event = value.decode("utf-8", "replace")
            elif field not in (b"id", b"retry"):
                raise malformed(self.provider, f"unexpected line: {quote(line.decode('utf-8', 'replace'))}")
        return out

    def end(self) -> SSEvent:
        """The event the lines so far make (and a fresh start)."""
        sse = SSEvent(self.event, b"\n".join(self.data).decode("utf-8", "replace"))
        self.event, self.data = None, []
        return sse


async def sse_events(body: AsyncIterator[bytes], provider: str) -> AsyncGenerator[SSEvent, None]:
    """Events of an SSE body given as byte chunks, split into lines here.

    Lines end at CR, LF or CRLF, the SSE spec's three, and nowhere else: a payload may hold a raw
    U+2028 or form feed (JSON allows them in strings), where httpx's ``aiter_lines`` would cut it.
    One generator over the bytes, instead of the text decoder and the line decoder under
    ``aiter_lines``: this reader runs once per token. A line that is neither a known field nor a
    comment raises `MalformedStreamError`; an event left open at the end of the body is still
    dispatched (so a cut-off JSON payload fails to parse rather than vanishing, and a final
    ``[DONE]`` without its blank line still counts)."""
    parser = _EventParser(provider)
    rest = b""  # the start of a line the next chunk ends
    after_cr = False  # the last chunk ended with CR: a LF first in the next one belongs to it
    try:
        async for chunk in body:
            if after_cr:
                after_cr = False
                if chunk[:1] == b"\n":
                    chunk = chunk[1:]
            if not chunk:
                continue
            if rest:
                chunk = rest + chunk
            lines = chunk.splitlines()  # bytes: CR, LF and CRLF only
            last = chunk[-1]
            after_cr = last == 13
            rest = lines.pop() if last not in (10, 13) else b""
            for sse in parser.feed(lines):
                yield sse
        if rest:  # the body ended without a line ending
            for sse in parser.feed([rest]):
                yield sse
        if parser.data or parser.event is not None:
            yield parser.end()
    finally:
        aclose = getattr(body, "aclose", None)
        if aclose is not None:
            await aclose()


class EventDecoder(Protocol):
    """Turns a provider's events into chunks; ``done`` is set by its terminating event."""

    done: bool

    def read(self, sse: SSEvent) -> Iterable[ChatChunk]: ...


class StreamingResponse(Protocol):
    """The part of an httpx (or httpx2) response we read."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...

    async def aread(self) -> bytes: ...

    def json(self) -> Any: ...


# How long to keep reading after the terminator, so the connection can go back to the pool.
_DRAIN_SECONDS = 0.1


async def stream_chunks(
    response: StreamingResponse,
    decoder: EventDecoder,
    *,
    provider: str,
    terminator: str,
    timeout_errors: type[BaseException] | tuple[type[BaseException], ...],
    transport_errors: type[BaseException] | tuple[type[BaseException], ...],
) -> AsyncGenerator[ChatChunk, None]:
    """The chunks of an SSE response; raises `MalformedStreamError` if it ends before the
    decoder saw ``terminator``, and maps the HTTP library's read errors (given as classes, so
    this module needs neither library) to `TimeoutError` / `MalformedStreamError`."""
    content_type = response.headers.get("content-type", "")
    if content_type.startswith(("application/json", "text/html", "text/plain")):
        # An error (or an unstreamed reply, or a proxy's HTML page) sent as 200.
        raw = await response.aread()
        try:
            body = response.json()
        except (ValueError, RecursionError):
            body = None
        if isinstance(body, Mapping) and body.get("error"):
            raise error_from_body(body, provider=provider)
        raise malformed(provider, f"expected an event stream, got {content_type}: {quote(raw)}")
    try:
        async with contextlib.aclosing(sse_events(response.aiter_bytes(), provider)) as events:
            async for sse in events:
                try:
                    chunks = list(decoder.read(sse))
                except PAYLOAD_ERRORS as exc:  # a payload of the wrong shape
                    raise malformed(provider, f"unexpected event {quote(sse.data)} ({_reason(exc)})") from exc
                for chunk in chunks:
                    yield chunk
                if decoder.done:
                    await _drain(events)
                    break
    except timeout_errors as exc:
        raise transport_error(provider, exc, in_body=True, timeout=True) from exc
    except transport_errors as exc:
        raise transport_error(provider, exc, in_body=True, timeout=False) from exc
    if not decoder.done:
        raise malformed(provider, f"the stream ended without {terminator}; the reply is incomplete")


def _reason(exc: BaseException) -> str:
    # A RecursionError's text names Python's stack, not the payload; say what it means.
    if isinstance(exc, RecursionError):
        return "JSON nested too deeply"
    return f"{type(exc).__name__}: {exc}"


async def _drain(events: AsyncIterator[SSEvent]) -> None:
    # The reply is complete; the rest of the body only matters for connection reuse, so give up
    # quickly and ignore whatever comes.
    with contextlib.suppress(Exception):
        async with asyncio.timeout(_DRAIN_SECONDS):
            async for _ in events:
                pass
