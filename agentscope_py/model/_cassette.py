"""Cassettes: the HTTP exchanges of real model calls, as they went over the wire, in a JSON file.

A cassette holds, per model call, the request (method, path, JSON body; never headers, so no key
is written down) and the response (status, the headers that shape how it is read, and the body
exactly as the transport delivered it, piece by piece, with how it ended). `RecordingTransport`
writes one while a provider talks to a real server; `ReplayTransport` plays it back to the same
provider code, checking every request against the recorded one. Both sit below the SDKs, at the
httpx transport, so what is recorded and replayed is the wire and not our reading of it.
"""

from __future__ import annotations

import asyncio
import base64
import difflib
import functools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from .._jsondiff import MISSING, first_difference
from ..errors import CassetteMismatchError

__all__ = ["Cassette", "CassetteMismatchError", "Interaction", "RecordingTransport", "ReplayTransport"]

VERSION = 1

End = Literal["complete", "closed", "cut", "timeout", "connect_error"]
"""How a response ended: read to the end; closed by the client (a cancelled run); the connection
dropped mid-body; a read timed out; or no response at all (the connection failed)."""

# Response headers that change how a body is read; the rest (dates, ids, cookies) are left out.
_KEPT_HEADERS = ("content-type", "content-encoding", "retry-after", "retry-after-ms")


@dataclass
class Interaction:
    method: str
    path: str
    body: Any
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)
    end: End | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "request": {"method": self.method, "path": self.path, "body": self.body},
            "response": {
                "status": self.status,
                "headers": self.headers,
                "body": [_chunk_json(c) for c in self.chunks],
                "end": self.end,
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Interaction:
        request, response = data["request"], data["response"]
        return cls(
            method=request["method"],
            path=request["path"],
            body=request["body"],
            status=response["status"],
            headers=dict(response["headers"]),
            chunks=[_chunk_bytes(c) for c in response["body"]],
            end=response["end"],
        )


def _chunk_json(chunk: bytes) -> str | dict[str, str]:
    try:
        return chunk.decode("utf-8")  # readable in review and in diffs
    except UnicodeDecodeError:  # a piece cut inside a character, or a compressed body
        return {"base64": base64.b64encode(chunk).decode("ascii")}


def _chunk_bytes(chunk: str | dict[str, str]) -> bytes:
    if isinstance(chunk, str):
        return chunk.encode("utf-8")
    return base64.b64decode(chunk["base64"])


@dataclass
class Cassette:
    """The recorded calls of one model, with what it takes to rebuild that model for replay."""

    provider: str
    model: str
    base_url: str
    settings: dict[str, Any] = field(default_factory=dict)
    note: str | None = None
    interactions: list[Interaction] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": VERSION, "provider": self.provider, "model": self.model,
                               "base_url": self.base_url, "settings": self.settings}
        if self.note:
            out["note"] = self.note
        out["interactions"] = [i.to_json() for i in self.interactions]
        return out

    def save(self, path: str | Path) -> None:
        text = json.dumps(self.to_json(), indent=1, ensure_ascii=False)
        Path(path).write_text(text + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Cassette:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if data.get("version") != VERSION:
            raise ValueError(f"{path}: cassette version {data.get('version')!r}, expected {VERSION}")
        return cls(
            provider=data["provider"],
            model=data["model"],
            base_url=data["base_url"],
            settings=dict(data.get("settings") or {}),
            note=data.get("note"),
            interactions=[Interaction.from_json(i) for i in data["interactions"]],
        )

    def check(self, index: int, method: str, path: str, body: Any, *, source: str = "the cassette") -> Interaction:
        """The recorded interaction ``index`` if the request matches it, else a
        `CassetteMismatchError` naming the first differing field, with a diff."""
        if index >= len(self.interactions):
            raise CassetteMismatchError(
                f"request {index + 1} ({method} {path}) was not recorded: {source} holds "
                f"{len(self.interactions)} request(s)",
                index=index,
                field="request",
            )
        recorded = self.interactions[index]
        first = first_difference(
            {"method": recorded.method, "path": recorded.path, "body": recorded.body},
            {"method": method, "path": path, "body": body},
        )
        if first is None:
            return recorded
        where, was, now = first
        diff = "\n".join(difflib.unified_diff(
            _pretty(recorded.body).splitlines(), _pretty(body).splitlines(), "recorded", "sent", n=2, lineterm="",
        ))
        raise CassetteMismatchError(
            f"request {index + 1} ({method} {path}) differs from {source}: first at {where}: "
            f"recorded {_short(was)} but sent {_short(now)}\n{_clip(diff)}",
            index=index,
            field=where,
        )


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=1, ensure_ascii=False, sort_keys=False)


def _short(value: Any) -> str:
    text = value if value == MISSING else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 120 else text[:117] + "..."


def _clip(diff: str, lines: int = 40) -> str:
    kept = diff.splitlines()
    return "\n".join(kept[:lines] + ([f"... ({len(kept) - lines} more diff lines)"] if len(kept) > lines else []))


def request_body(content: bytes) -> Any:
    """A request body as recorded: JSON when it is JSON, else its text."""
    if not content:
        return None
    try:
        return json.loads(content)
    except ValueError:
        return content.decode("utf-8", errors="replace")


# -- transports ----------------------------------------------------------------------------------
# The providers' SDKs use httpx (Ollama) or httpx2 (OpenAI, Anthropic); a client accepts only its
# own library's responses and streams, so the classes are made per library module.


class RecordingTransport:
    """Passes requests to ``inner`` and writes each exchange to ``cassette`` (saved to ``path``
    whenever a response ends)."""

    def __init__(self, inner: Any, cassette: Cassette, path: Path, http: ModuleType) -> None:
        self.inner = inner
        self.cassette = cassette
        self.path = path
        self.http = http

    async def handle_async_request(self, request: Any) -> Any:
        entry = Interaction(request.method, request.url.raw_path.decode("ascii"), request_body(await request.aread()))
        self.cassette.interactions.append(entry)  # in request order, also for concurrent calls
        try:
            response = await self.inner.handle_async_request(request)
        except self.http.TimeoutException:
            self._finish(entry, "timeout")
            raise
        except self.http.TransportError:
            self._finish(entry, "connect_error")
            raise
        entry.status = response.status_code
        entry.headers = {k: response.headers[k] for k in _KEPT_HEADERS if k in response.headers}
        response.stream = _tee(self.http)(response.stream, entry, self._finish)
        return response

    def _finish(self, entry: Interaction, end: End) -> None:
        if entry.end is None:
            entry.end = end
            self.cassette.save(self.path)

    async def aclose(self) -> None:
        await self.inner.aclose()


@functools.cache
def _tee(http: ModuleType) -> Any:
    class Tee(http.AsyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, inner: Any, entry: Interaction, finish: Any) -> None:
            self.inner, self.entry, self.finish = inner, entry, finish

        async def __aiter__(self) -> AsyncIterator[bytes]:
            try:
                async for chunk in self.inner:
                    self.entry.chunks.append(bytes(chunk))
                    yield chunk
            except http.TimeoutException:
                self.finish(self.entry, "timeout")
                raise
            except http.TransportError:
                self.finish(self.entry, "cut")
                raise
            self.finish(self.entry, "complete")

        async def aclose(self) -> None:
            self.finish(self.entry, "closed")  # no-op when the body was read to its end
            await self.inner.aclose()

    return Tee


class ReplayTransport:
    """Answers each request with the next recorded response, after checking it against the
    recorded request. The first mismatch is kept in ``mismatch`` too: SDKs wrap transport
    exceptions in their own connection errors, and the replaying model digs it out again."""

    def __init__(self, cassette: Cassette, http: ModuleType, *, source: str, stall_seconds: float = 2.0) -> None:
        self.cassette = cassette
        self.http = http
        self.source = source
        self.stall_seconds = stall_seconds
        self.position = 0
        self.mismatch: CassetteMismatchError | None = None

    async def handle_async_request(self, request: Any) -> Any:
        index = self.position
        self.position += 1
        body = request_body(await request.aread())
        try:
            recorded = self.cassette.check(index, request.method, request.url.raw_path.decode("ascii"), body,
                                           source=self.source)
        except CassetteMismatchError as exc:
            self.mismatch = self.mismatch or exc
            raise
        if recorded.end == "connect_error":
            raise self.http.ConnectError("recorded: the connection failed", request=request)
        if recorded.end == "timeout" and recorded.status is None:
            raise self.http.ConnectTimeout("recorded: the connection timed out", request=request)
        stream = _replay(self.http)(recorded, self, request, index)
        return self.http.Response(recorded.status or 200, headers=recorded.headers, stream=stream, request=request)

    async def aclose(self) -> None:
        pass


@functools.cache
def _replay(http: ModuleType) -> Any:
    class Replay(http.AsyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, recorded: Interaction, transport: ReplayTransport, request: Any, index: int) -> None:
            self.recorded, self.transport, self.request, self.index = recorded, transport, request, index

        async def __aiter__(self) -> AsyncIterator[bytes]:
            for chunk in self.recorded.chunks:
                yield chunk
            end = self.recorded.end
            if end == "cut":
                raise http.RemoteProtocolError("recorded: the connection dropped mid-body", request=self.request)
            if end == "timeout":
                raise http.ReadTimeout("recorded: the read timed out", request=self.request)
            if end == "closed":
                # The recorded client hung up here while the server was still sending. A reader
                # may look ahead a little further now than it did live; wait for it to close,
                # as a server would, but not for ever: reading on means the run went elsewhere.
                await asyncio.sleep(self.transport.stall_seconds)
                error = CassetteMismatchError(
                    f"the replay read past the point where the recorded run closed response "
                    f"{self.index + 1} (after {len(self.recorded.chunks)} pieces)",
                    index=self.index,
                    field="response",
                )
                self.transport.mismatch = self.transport.mismatch or error
                raise error

    return Replay
