"""The streamable-HTTP side of the cap: an httpx transport that cuts long answers as they stream.

The SDK's streamable-HTTP client reads a JSON body whole (``aread``) and an SSE event whole, and
parses it in its own task. It takes the ``httpx2.AsyncClient`` to use (a public parameter), so
the client given to it sends through `CappingTransport`: a response's bytes pass through unchanged
while a message is at most `read_whole` bytes; a longer JSON body, or a longer SSE event's
``data``, is read by a `MessageReader` as it streams, and the SDK receives the message it makes
(the capped answer, or an error answer to the request). The request a POST carries names the
answer's id, so its cap is known before the answer's first byte.

A compressed body cannot be read as it streams here (httpx decodes after the transport), so the
requests ask for none (``Accept-Encoding: identity``); a server that compresses anyway is read as
the SDK reads it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx2

from ._capped_reader import Answers, MessageReader, read_whole

__all__ = ["CappingTransport"]

logger = logging.getLogger(__name__)

_FIELD_LIMIT = 4096
"""Bytes of an event's field other than ``data`` that are passed on (a longer one is dropped)."""


class CappingTransport(httpx2.AsyncBaseTransport):
    """``inner`` with its MCP answers read under the caps ``answers`` knows."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, answers: Answers) -> None:
        self.inner = inner
        self.answers = answers

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        request.headers["Accept-Encoding"] = "identity"
        request_id = _request_id(request)
        response = await self.inner.handle_async_request(request)
        if response.headers.get("content-encoding", "identity").lower() != "identity":
            return response
        kind = response.headers.get("content-type", "").partition(";")[0].strip().lower()
        body = response.stream
        if not isinstance(body, httpx2.AsyncByteStream):
            return response
        stream: httpx2.AsyncByteStream
        if kind == "application/json":
            stream = _JsonBody(body, self.answers, request_id)
        elif kind == "text/event-stream":
            stream = _EventBody(body, self.answers, request_id)
        else:
            return response
        headers = [(k, v) for k, v in response.headers.raw if k.lower() != b"content-length"]
        return httpx2.Response(response.status_code, headers=headers, stream=stream,
                               extensions=response.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _encoded(message: dict[str, Any]) -> bytes:
    try:
        return json.dumps(message, ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate the server escaped: sent on escaped (six bytes a character)
        return json.dumps(message).encode()


def _request_id(request: httpx2.Request) -> Any:
    """The id of the JSON-RPC request a POST carries (None for anything else)."""
    if request.method != "POST":
        return None
    try:
        body = json.loads(request.content)
    except (httpx2.RequestNotRead, ValueError):
        return None
    if isinstance(body, dict) and "method" in body and isinstance(body.get("id"), str | int):
        return body["id"]
    return None


class _JsonBody(httpx2.AsyncByteStream):
    def __init__(self, body: httpx2.AsyncByteStream, answers: Answers, request_id: Any) -> None:
        self.body = body
        self.answers = answers
        self.request_id = request_id

    async def __aiter__(self) -> AsyncIterator[bytes]:
        held: list[bytes] = []
        size = 0
        reader: MessageReader | None = None
        whole = read_whole(self.answers, self.request_id)
        async for chunk in self.body:
            if reader is not None:
                reader.feed(chunk)
                continue
            held.append(chunk)
            size += len(chunk)
            if size > whole:
                reader = MessageReader(self.answers, request_id=self.request_id)
                for part in held:
                    reader.feed(part)
                held = []
        if reader is None:
            for part in held:
                yield part
            return
        message = reader.finish()
        if message is not None:
            yield _encoded(message)

    async def aclose(self) -> None:
        await self.body.aclose()


class _EventBody(httpx2.AsyncByteStream):
    """An SSE body: events passed on as they are, except one whose lines pass `read_whole`
    bytes, whose ``data`` is read by a `MessageReader` and sent on as one ``data`` line."""

    def __init__(self, body: httpx2.AsyncByteStream, answers: Answers, request_id: Any) -> None:
        self.body = body
        self.answers = answers
        self.request_id = request_id

    async def __aiter__(self) -> AsyncIterator[bytes]:
        event = _Event(self.answers, self.request_id)
        async for chunk in self.body:
            start = 0
            while start < len(chunk):
                end = chunk.find(b"\n", start)
                if end < 0:
                    event.add(chunk[start:])
                    break
                event.add(chunk[start:end + 1])
                start = end + 1
                if event.ended:
                    out = event.output()
                    if out:
                        yield out
                    event = _Event(self.answers, self.request_id)
        out = event.output()
        if out:
            yield out

    async def aclose(self) -> None:
        await self.body.aclose()


class _Event:
    """The lines of one SSE event, given piece by piece (a piece ends at a line's end or not).

    While the event is small its pieces are kept to pass on as they are; past `read_whole` they
    are read again with a `MessageReader`, which takes the ``data`` from there on."""

    def __init__(self, answers: Answers, request_id: Any) -> None:
        self.answers = answers
        self.request_id = request_id
        self.pieces: list[bytes] = []
        """The event's bytes while it is small."""
        self.size = 0
        self.whole = read_whole(answers, request_id)
        self.reader: MessageReader | None = None
        self.fields: list[bytes] = []
        """Its lines other than ``data`` and comments (``event``, ``id``, ``retry``)."""
        self.kind: str | None = None
        """The field of the line being added: "data", "other", or None (not known yet)."""
        self.head = b""
        """The line's first bytes while its field is not known."""
        self.field = b""
        self.data_lines = 0
        self.ended = False

    def add(self, piece: bytes) -> None:
        if self.reader is not None:
            self._parse(piece)
            return
        self.pieces.append(piece)
        self.size += len(piece)
        self._parse(piece)
        if self.size > self.whole and not self.ended:
            self.reader = MessageReader(self.answers, request_id=self.request_id)
            pieces, self.pieces = self.pieces, []
            self.kind, self.head, self.field, self.fields, self.data_lines = None, b"", b"", [], 0
            for old in pieces:
                self._parse(old)

    def _parse(self, piece: bytes) -> None:
        complete = piece.endswith(b"\n")
        body = piece.rstrip(b"\r\n") if complete else piece
        if self.kind is None:  # the line's field is not known yet
            self.head += body
            if not complete and len(self.head) < 5:
                return
            line, self.head = self.head, b""
            if complete and not line.rstrip(b"\r"):
                self.ended = True  # a blank line ends the event
                return
            if line.startswith(b"data:"):
                self.kind = "data"
                value = line[5:]
                self._data(value[1:] if value.startswith(b" ") else value, first=True)
            else:
                self.kind, self.field = "other", line[:_FIELD_LIMIT + 1]
        elif self.kind == "data":
            self._data(body, first=False)
        elif len(self.field) <= _FIELD_LIMIT:
            self.field += body
        if complete:
            if self.kind == "other" and not self.field.startswith(b":") and len(self.field) <= _FIELD_LIMIT:
                self.fields.append(self.field.rstrip(b"\r") + b"\n")  # event, id, retry (not a comment)
            self.kind = None

    def _data(self, value: bytes, *, first: bool) -> None:
        if self.reader is None:
            return
        if first:
            if self.data_lines:
                self.reader.feed(b"\n")  # the lines of one event's data are joined by newlines
            self.data_lines += 1
        self.reader.feed(value)

    def output(self) -> bytes:
        if self.reader is None:
            return b"".join(self.pieces)
        message = self.reader.finish()
        if message is None:
            logger.error("the MCP server sent a %d-byte event that could not be read, and it answers no "
                         "request: it is dropped", self.reader.size)
            return b""
        data = _encoded(message)
        return b"".join(self.fields) + b"data: " + data + b"\n\n"
