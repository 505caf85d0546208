"""Pieces every provider shares: request options, block helpers and the SSE framing.

The SSE reader is our own rather than the SDKs': theirs end quietly when a stream is cut off or
never sends its terminator, and skip lines they do not understand, while we must report both as
`MalformedStreamError` so a partial reply is never taken for a complete one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from ..message import DataBlock, Msg, TextBlock, ToolResultBlock, ToolUseBlock
from ._errors import error_from_body, malformed, quote, transport_error
from .base import ChatChunk

__all__ = [
    "FED_TURN",
    "MAX_TOKENS",
    "OPENING",
    "ChunkFeed",
    "SSEvent",
    "arguments_text",
    "data_url",
    "event_json",
    "exact_json",
    "merge_options",
    "reference",
    "result_parts",
    "stream_chunks",
    "text_or_none",
    "token_count",
    "tool_turns_joined",
    "user_and_tool_messages",
]

PAYLOAD_ERRORS: tuple[type[Exception], ...] = (
    AttributeError, IndexError, KeyError, TypeError, ValueError, OverflowError, RecursionError,
)
"""What reading a JSON payload of the wrong shape raises (``"index": Infinity`` is an
OverflowError in ``int()``, JSON nested thousands deep a RecursionError): the server's fault, so a
`MalformedStreamError`, never a raw exception that retry and fallback would not recognise."""


def text_or_none(value: Any) -> str | None:
    """``value`` if it is a non-empty text, else None: a reader takes a field of another type
    (an id, a name, a text) as absent, so no chunk carries it into the agent, where it would
    fail as a raw exception."""
    return value if isinstance(value, str) and value else None


MAX_TOKENS = 2**53
"""Past any call's token count; a float holds every count below it exactly (a budget prices
counts as floats, and a JSON int can be hundreds of digits long)."""


def token_count(value: Any) -> int | None:
    """A provider's token count as an exact ``int`` (a JSON ``true`` is 1), or None: a count no
    call has (negative: a budget would be credited; `MAX_TOKENS` or more: a budget's price may
    overflow) is read as absent, as a value of another type is."""
    if isinstance(value, int) and 0 <= value < MAX_TOKENS:
        return int(value)
    return None


# Keys the agent core puts in the options that are not provider request parameters.
_INTERNAL_OPTIONS = frozenset({"structured_output"})


OPENING = "(The conversation so far was shortened; it continues below.)"
"""The text of the user turn a converter puts first when the conversation would open with the
assistant's (a trimmer or compressor cut what came before). Anthropic, Bedrock, Gemini and the
chat templates of many open models (Gemma, Mistral, served by llama.cpp or vLLM) refuse a
conversation whose first non-system message is not the user's; a turn that says what happened
is accepted everywhere and misleads the model less than dropping the assistant's turn would."""


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


def tool_turns_joined(msgs: Sequence[Msg]) -> Sequence[Msg]:
    """``msgs`` with each run of consecutive tool messages joined into one (``msgs`` itself when
    there is none). The results of one round's calls may be remembered in several tool messages
    (those that ran before an approval pause, the rest on the resume); on the OpenAI-shaped
    wires the data a result carries goes in a user message after the tool messages
    (`user_and_tool_messages`), and it must come after all of them: a user message between an
    assistant's calls and one of their tool messages is refused."""
    out: list[Msg] | None = None
    for i in range(1, len(msgs)):
        msg = msgs[i]
        if msg.role == "tool" and msgs[i - 1].role == "tool":
            if out is None:
                out = list(msgs[:i])
            out[-1] = out[-1].model_copy(update={"content": [*out[-1].content, *msg.content]})
        elif out is not None:
            out.append(msg)
    return msgs if out is None else out


def user_and_tool_messages(
    msg: Msg, *, text_type: str, data_part: Callable[[DataBlock], dict[str, Any]],
    tool_message: Callable[[ToolResultBlock, str], dict[str, Any]],
) -> list[dict[str, Any]]:
    """A user message on the OpenAI-shaped wires (chat completions, Responses), which differ only
    in the names of their parts (``text_type``, ``data_part``) and of a tool result's message
    (``tool_message(result, text)``): each tool result as a message of its own, then the text and
    data as one user message (a lone text as a plain string). A tool message holds text only, so
    a result's data follows in the user message, after a line naming the result."""
    out: list[dict[str, Any]] = []
    attachments: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block in msg.content:
        if isinstance(block, ToolResultBlock):
            text: list[str] = []
            data: list[DataBlock] = []
            for part in result_parts(block):
                if isinstance(part, TextBlock):
                    text.append(part.text)
                else:
                    text.append(f"[{part.media_type} attached below]")
                    data.append(part)
            if data:
                intro = f"Attachments of tool result {block.id} ({block.name}):"
                attachments.append({"type": text_type, "text": intro})
                attachments.extend(data_part(b) for b in data)
            out.append(tool_message(block, "".join(text)))
        elif isinstance(block, TextBlock):
            parts.append({"type": text_type, "text": block.text})
        elif isinstance(block, DataBlock):
            parts.append(data_part(block))
    parts.extend(attachments)
    if len(parts) == 1 and parts[0]["type"] == text_type:
        out.append({"role": "user", "content": parts[0]["text"]})
    elif parts:
        out.append({"role": "user", "content": parts})
    return out


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


_loads: Callable[[bytes | str], Any] | None
try:  # the server extra brings it; without it the stdlib reads every payload
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - exercised only without orjson
    _loads = None


SSEvent = tuple[str | None, bytes]
"""One server-sent event: its ``event`` field (None without one) and its data lines, joined (the
bytes as they came: a payload is decoded once, by the JSON parser, `event_json`)."""


def event_json(data: bytes, provider: str) -> Any:
    """An event's data as JSON, parsed from its bytes; `MalformedStreamError` when it is none.
    Bytes that are no UTF-8 read as the replacement character, as a text decoder with
    ``errors="replace"`` would have them.

    orjson reads an int past 64 bits as a float: good for what a reader takes from a payload as
    numbers (token counts, indexes), not for values it hands on (a tool's input sent whole), which
    it reads with `exact_json`."""
    if _loads is not None:
        try:
            return _loads(data)  # several times faster than json.loads on a chunk payload
        except ValueError:
            pass  # what orjson refuses and json may take (NaN, lone surrogates, bad UTF-8)
    return exact_json(data, provider)


def exact_json(data: bytes, provider: str) -> Any:
    """`event_json` by the stdlib's parser, which keeps every int exact."""
    try:
        return json.loads(data.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        raise malformed(provider, f"invalid JSON in event data: {quote(data)}") from None


class _EventParser:
    """An SSE body's bytes → events: the line splitting and the state between lines and chunks.

    Lines end at CR, LF or CRLF, the SSE spec's three, and nowhere else: a payload may hold a raw
    U+2028 or form feed (JSON allows them in strings), where httpx's ``aiter_lines`` would cut it.
    Plain calls per chunk of bytes, not a generator: this runs once per token, in the one
    generator that reads the body (`stream_chunks`). A line that is neither a known field nor a
    comment raises `MalformedStreamError`; an event left open at the end of the body is still
    dispatched (`finish`), so a cut-off JSON payload fails to parse rather than vanishing, and a
    final ``[DONE]`` without its blank line still counts."""

    __slots__ = ("after_cr", "data", "event", "provider", "rest")

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self.event: str | None = None
        self.data: list[bytes] = []
        self.rest = b""  # the start of a line the next chunk ends
        self.after_cr = False  # the last chunk ended with CR: a LF first in the next one belongs to it

    def feed_bytes(self, chunk: bytes) -> list[SSEvent]:
        # What OpenAI-compatible servers write, one or several to a read: whole events of one
        # ``data:`` line each, nothing pending. Their events at once, without splitting lines:
        # exactly what the general path below makes of them. (``13``, ``10``: CR, LF; an int is
        # a plain byte search.)
        if (chunk[:6] == b"data: " and chunk[-2:] == b"\n\n" and not self.rest and not self.after_cr
                and not self.data and self.event is None and 13 not in chunk):
            data = chunk[6:-2]
            if 10 not in data:  # one event: each token at light load
                return [(None, data)]
            events: list[SSEvent] = []
            for part in chunk[:-2].split(b"\n\n"):
                if part[:6] != b"data: " or 10 in part:
                    break
                events.append((None, part[6:]))
            else:
                return events
        if self.after_cr:
            self.after_cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        if not chunk:
            return []
        if self.rest:
            chunk = self.rest + chunk
        lines = chunk.splitlines()  # bytes: CR, LF and CRLF only
        last = chunk[-1]
        self.after_cr = last == 13
        self.rest = lines.pop() if last not in (10, 13) else b""
        return self.feed(lines)

    def finish(self) -> list[SSEvent]:
        """What the body's end dispatches: its last line without an ending, an event left open."""
        out = self.feed([self.rest]) if self.rest else []
        self.rest = b""
        if self.data or self.event is not None:
            out.append(self.end())
        return out

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
        sse = (self.event, b"\n".join(self.data))
        self.event, self.data = None, []
        return sse


async def _aclose(it: AsyncIterator[Any]) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        await aclose()


class EventDecoder(Protocol):
    """Turns a provider's events into chunks (a list per event: the reader runs once per token);
    ``done`` is set by its terminating event."""

    done: bool

    def read(self, event: str | None, data: bytes) -> list[ChatChunk]: ...


class StreamingResponse(Protocol):
    """The part of a response we read: an httpx (or httpx2) one, or the aiohttp one's wrapper."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...

    async def aread(self) -> bytes: ...

    def json(self) -> Any: ...


# How long to keep reading after the terminator, so the connection can go back to the pool.
_DRAIN_SECONDS = 0.1

ChunkFeed = Callable[[ChatChunk], object]
"""What a consumer of `stream_chunks` sends it to be handed every chunk that follows."""

FED_TURN = 32
"""Chunks `stream_chunks` hands to a feed from one piece of the body before it lets the loop run
once: a piece holding a whole reply (a server far ahead of its reader) is not fed in one step."""


async def stream_chunks(
    open_response: Callable[[], AbstractAsyncContextManager[StreamingResponse]],
    decoder: EventDecoder,
    *,
    provider: str,
    terminator: str,
    timeout_errors: type[BaseException] | tuple[type[BaseException], ...],
    transport_errors: type[BaseException] | tuple[type[BaseException], ...],
    open_error: Callable[[Exception], BaseException | None] | None = None,
) -> AsyncGenerator[ChatChunk, ChunkFeed | None]:
    """The chunks of the SSE response ``open_response()`` opens (and closes); raises
    `MalformedStreamError` if it ends before the decoder saw ``terminator``, maps the HTTP
    library's read errors (given as classes, so this module needs neither library) to
    `TimeoutError` / `MalformedStreamError`, and any other exception through ``open_error``
    (the SDK's errors; None: raised as it is).

    One generator from the body's bytes to the chunks, the parser and the decoder plain calls
    inside it: each layer of generators costs a resumption per token, and a provider's
    ``stream()`` returns this generator itself.

    **Feeding.** A consumer that hands every chunk to one function may send it in place of asking
    for the next chunk (``asend(feed)``, `ChunkFeed`): from then on the generator calls ``feed``
    with each chunk and yields none, so no chunk crosses a generator's hand-off (the model call's
    read, `_model_call._read`, does). It lets the loop run once after every `FED_TURN` chunks of
    one piece of the body, as a consumer taking them one by one would be let to."""
    try:
        async with open_response() as response:
            content_type = response.headers.get("content-type", "")
            if content_type.startswith(("application/json", "text/html", "text/plain")):
                try:
                    unstreamed = await _unstreamed(response, content_type, provider)
                except timeout_errors as exc:  # (the body read whole: its read fails as the stream's do)
                    raise transport_error(provider, exc, in_body=True, timeout=True) from exc
                except transport_errors as exc:
                    raise transport_error(provider, exc, in_body=True, timeout=False) from exc
                raise unstreamed
            parser = _EventParser(provider)
            body = response.aiter_bytes()
            feed: ChunkFeed | None = None
            try:
                async for piece in body:
                    fed = 0
                    for event, data in parser.feed_bytes(piece):
                        try:  # (`_read`, inlined: this runs per token)
                            chunks = decoder.read(event, data)
                        except PAYLOAD_ERRORS as exc:
                            raise _bad_payload(provider, data, exc) from exc
                        for chunk in chunks:
                            if feed is None:
                                feed = yield chunk
                            else:
                                feed(chunk)
                                fed += 1
                        if decoder.done:
                            await _drain(body)
                            return
                        if fed >= FED_TURN:
                            fed = 0
                            await asyncio.sleep(0)
                for event, data in parser.finish():
                    for chunk in _read(decoder, event, data, provider):
                        if feed is None:
                            feed = yield chunk
                        else:
                            feed(chunk)
            except timeout_errors as exc:
                raise transport_error(provider, exc, in_body=True, timeout=True) from exc
            except transport_errors as exc:
                raise transport_error(provider, exc, in_body=True, timeout=False) from exc
            finally:
                await _aclose(body)
    except Exception as exc:
        mapped = open_error(exc) if open_error is not None else None
        if mapped is None:
            raise
        raise mapped from exc
    if not decoder.done:
        raise malformed(provider, f"the stream ended without {terminator}; the reply is incomplete")


async def _unstreamed(response: StreamingResponse, content_type: str, provider: str) -> Exception:
    """The error for a body that is not an event stream: an error (or an unstreamed reply, or a
    proxy's HTML page) sent as 200."""
    raw = await response.aread()
    try:
        body = response.json()
    except (ValueError, RecursionError):
        body = None
    if isinstance(body, Mapping) and body.get("error"):
        return error_from_body(body, provider=provider)
    return malformed(provider, f"expected an event stream, got {content_type}: {quote(raw)}")


def _read(decoder: EventDecoder, event: str | None, data: bytes, provider: str) -> list[ChatChunk]:
    try:
        return decoder.read(event, data)
    except PAYLOAD_ERRORS as exc:  # a payload of the wrong shape
        raise _bad_payload(provider, data, exc) from exc


def _bad_payload(provider: str, data: bytes, exc: BaseException) -> Exception:
    return malformed(provider, f"unexpected event {quote(data)} ({_reason(exc)})")


def _reason(exc: BaseException) -> str:
    # A RecursionError's text names Python's stack, not the payload; say what it means.
    if isinstance(exc, RecursionError):
        return "JSON nested too deeply"
    return f"{type(exc).__name__}: {exc}"


async def _drain(body: AsyncIterator[bytes]) -> None:
    # The reply is complete; the rest of the body only matters for connection reuse, so give up
    # quickly and ignore whatever comes. A body that says it is read to its end (`_aiohttp`'s,
    # ``at_eof``: the end of the body came with the terminator, as it mostly does) has nothing
    # left to wait for, and no timer is armed.
    at_eof = getattr(body, "at_eof", None)
    if at_eof is not None and at_eof():
        return
    with contextlib.suppress(Exception):
        async with asyncio.timeout(_DRAIN_SECONDS):
            async for _ in body:
                pass
