"""Server-sent events: framing, and an ASGI response that streams frames with backpressure,
heartbeats and disconnect detection.

Framing follows what the strict AG-UI client parser accepts: frames are ``data: <json>\\n\\n``
(never CRLF), comments (``: ping``) are heartbeats, and there is no ``[DONE]`` sentinel.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import types
import typing
from collections.abc import AsyncIterator, Callable, Mapping
from functools import partial
from typing import Any

import pydantic_core
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..events import AgentEvent, EventBase
from ..stream import Channel, aclosing
from ._ticks import ticker

_dumps: Callable[[Any], bytes] | None
try:  # the server extra installs it; without it every frame is encoded by pydantic
    from orjson import dumps as _dumps
except ImportError:  # pragma: no cover - exercised by forcing the fallback in the tests
    _dumps = None

plain_json: Callable[[Any], bytes] = _dumps if _dumps is not None else pydantic_core.to_json
"""JSON bytes of a dict of strings (the AG-UI delta frames): orjson's when installed, else
pydantic-core's; the two write the same bytes for these (a test holds them to ag-ui's encoder)."""

__all__ = ["HEARTBEAT", "SSE_HEADERS", "SSEResponse", "encode_error", "encode_sse", "with_heartbeat"]

log = logging.getLogger("agentscope_py.server")

HEARTBEAT = b": ping\n\n"
SSE_HEADERS: dict[str, str] = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",  # nginx: do not buffer the stream
}
_SSE_RAW = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in SSE_HEADERS.items()]
BODY_SEND = "agentscope.body_send"
"""The scope key of the ``send`` an `SSEResponse` writes its body to, when the app's `Guard` set
it: the ``send`` the guard was given (see `SSEResponse`)."""
BUFFER = 16
"""Frames the producer may run ahead of the client: a small constant, so a slow reader pauses the
agent (and, through its bounded prefetch, the model request) instead of growing memory."""
BUFFER_BYTES = 256 * 1024
"""Bytes of frames the producer may run ahead of the client (a frame larger than this still goes,
alone): with big chunks, frames rather than their count are what costs memory."""


def encode_sse(event: AgentEvent) -> bytes:
    """One native SSE frame, ``data: <event JSON>\\n\\n``; ``parse_event`` reads the JSON back.

    An event of a `flat_event_types` class with no metadata (every delta the runtime makes) is
    its fields dict, which orjson encodes to the bytes pydantic would give in under half the time
    (this is the server's largest cost per token). Anything else, or a value orjson refuses (an
    int beyond 64 bits, a lone surrogate), is encoded by pydantic. Either way one ``%`` copies the
    JSON into the frame."""
    if type(event) in _FLAT:
        fields = event.__dict__
        try:
            if not fields["metadata"]:
                return b"data: %b\n\n" % plain_json(fields)  # orjson: _FLAT is empty without it
        except (KeyError, TypeError):  # not a whole fields dict, or orjson refused a value (its error is a TypeError)
            pass
    return b"data: %b\n\n" % type(event).__pydantic_serializer__.to_json(event)


_PLAIN = (str, int, float, bool, type(None))


def _flat(cls: type[EventBase]) -> bool:
    """Whether pydantic's JSON of a ``cls`` with empty metadata is its ``__dict__`` as orjson
    writes it: fields of plain JSON types (``str``, ``int``, ``float``, ``bool``, ``None``, str
    literals, str enums and unions of these), no aliases, exclusions or custom serialisers."""
    decorators = cls.__pydantic_decorators__
    if decorators.field_serializers or decorators.model_serializers or cls.__pydantic_computed_fields__:
        return False
    if cls.model_config.get("alias_generator") or cls.model_config.get("extra") not in (None, "ignore"):
        return False

    def plain(annotation: Any) -> bool:
        if annotation in _PLAIN:
            return True
        if isinstance(annotation, type) and issubclass(annotation, str) and issubclass(annotation, enum.Enum):
            return True
        origin = typing.get_origin(annotation)
        if origin is typing.Literal:
            return all(type(v) is str for v in typing.get_args(annotation))
        if origin in (typing.Union, types.UnionType):
            return all(plain(a) for a in typing.get_args(annotation))
        return False

    for name, f in cls.model_fields.items():
        if f.alias not in (None, name) or f.serialization_alias not in (None, name) or f.exclude:
            return False
        if name != "metadata" and not plain(f.annotation):  # metadata: checked empty per event
            return False
    return True


def flat_event_types() -> frozenset[type[EventBase]]:
    """The event classes `encode_sse` hands to orjson (none when orjson is not installed)."""
    return _FLAT


_FLAT: frozenset[type[EventBase]] = frozenset(
    cls for cls in typing.get_args(typing.get_args(AgentEvent)[0]) if _dumps is not None and _flat(cls)
)


def encode_error(error: BaseException, *, message: str | None = None, code: str | None = None,
                 request_id: str | None = None) -> bytes:
    """The native stream's terminal error frame: ``event: error`` with ``{"type": "error",
    "message", "code"}`` (``code`` is the exception class), so clients tell it from events. The
    server passes a safe ``message`` and ``code`` and the ``request_id`` its log line carries."""
    body: dict[str, Any] = {"type": "error", "message": message or str(error) or type(error).__name__,
                            "code": code or type(error).__name__}
    if request_id is not None:
        body["request_id"] = request_id
    return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"


async def with_heartbeat(source: AsyncIterator[bytes], interval: float | None,
                         buffer_bytes: int = BUFFER_BYTES, *, coalesce: bool = False) -> AsyncIterator[bytes]:
    """``source``'s frames, plus `HEARTBEAT` whenever nothing was sent for ``interval`` seconds.

    ``source`` runs in one producer task (so the agent's generators keep one task and context
    throughout) feeding a `Channel` of at most `BUFFER` frames and ``buffer_bytes`` bytes; closing
    this iterator cancels the producer once and waits for its cleanup, which is how a disconnect
    cancels the run. ``coalesce``: every frame waiting when the consumer takes one comes joined
    to it, in order, as one item (one socket write for tokens that arrived together; a frame that
    arrives alone still goes at once: nothing waits to be batched)."""
    channel = Channel(BUFFER)
    loop = channel.loop
    # The channel bounds the frame count; the bytes are a second bound, checked by the producer
    # before each put and released by the consumer as frames leave.
    bytes_room = asyncio.Event()
    buffered = 0

    async def produce() -> None:
        nonlocal buffered
        error: BaseException | None = None
        try:
            async with aclosing(source):
                async for frame in source:
                    while buffered and buffered + len(frame) > buffer_bytes:
                        bytes_room.clear()
                        await bytes_room.wait()
                    buffered += len(frame)
                    await channel.put(frame)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # we were cancelled: the consumer is gone
            error = exc  # a stray one the run raised: the consumer reports it
        except BaseException as exc:  # reported to the consumer, which decides
            error = exc
        channel.finish(error)

    producer = loop.create_task(produce())
    beat = _Heartbeat(channel, interval) if interval is not None and interval > 0 else None
    try:
        while True:
            if channel.items:
                frame = channel.take()
                if coalesce and channel.items:
                    parts = [frame]
                    while channel.items:
                        parts.append(channel.take())
                    frame = b"".join(parts)
                buffered -= len(frame)
                bytes_room.set()
                yield frame
                if beat is not None:
                    beat.sent()
            elif channel.done:
                channel.end()
                return
            elif beat is not None and beat.due:
                yield HEARTBEAT
                beat.sent()
            else:
                await channel.wait()
    finally:
        if beat is not None:
            beat.stop()
        if not producer.done():
            producer.cancel()
        # Shielded: an ASGI server that cancels us repeatedly must not cut the run's cleanup short.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(asyncio.gather(producer, return_exceptions=True))


class _Heartbeat:
    """Sets ``due`` and wakes the consumer once nothing was sent for ``interval`` seconds. One
    timer per interval, re-armed for the time left: a timeout around every wait for a frame would
    cost a timer per frame, and most frames are waited for (the model is slower than the socket)."""

    __slots__ = ("channel", "due", "handle", "interval", "last")

    def __init__(self, channel: Channel, interval: float) -> None:
        self.channel = channel
        self.interval = interval
        self.due = False
        self.last = channel.loop.time()
        self.handle = channel.loop.call_later(interval, self._check)

    def sent(self) -> None:
        self.last = self.channel.loop.time()
        self.due = False

    def _check(self) -> None:
        loop = self.channel.loop
        left = self.last + self.interval - loop.time()
        if left > 0.001:  # something was sent since: wait for the rest of the interval
            self.handle = loop.call_later(left, self._check)
            return
        self.due = True
        self.channel.wake()
        self.handle = loop.call_later(self.interval, self._check)

    def stop(self) -> None:
        self.handle.cancel()


class SSEResponse(Response):
    """A Starlette response streaming ``frames()`` as ``text/event-stream``.

    The body is pulled only as fast as ``send`` completes (the server's flow control), a heartbeat
    comment goes out when idle, and a client disconnect (``http.disconnect``) cancels the stream
    at once, even while the agent is waiting on a tool. A client that takes no frame for
    ``stall_timeout`` seconds (its socket buffers full) is dropped the same way.

    The start (status and headers) goes through the ``send`` the response is given; in an app
    whose `Guard` set `BODY_SEND` in the scope, the body's frames go to that ``send`` instead:
    the one the guard was given, so every middleware outside the guard (all that ``add_middleware``
    adds) sees every frame. The wrappers between the guard and the route (Starlette's exception
    handling, twice, and the guard's own) look at a response's start only, and a frame — one per
    token at light load — passing three calls that only pass it on is a cost per token."""

    media_type = "text/event-stream"

    def __init__(
        self,
        frames: Callable[[], AsyncIterator[bytes]],
        *,
        heartbeat: float | None = 15.0,
        headers: Mapping[str, str] | None = None,
        buffer_bytes: int = BUFFER_BYTES,
        stall_timeout: float | None = None,
        direct: bool = False,
    ) -> None:
        # Like StreamingResponse, no body to render: only status and headers are set up here.
        self.frames = frames
        self.heartbeat = heartbeat
        self.buffer_bytes = buffer_bytes
        self.stall_timeout = stall_timeout
        # ``frames()`` paces itself and sends its own heartbeats (a run log follower): the write
        # loop pulls it directly, without a producer task and buffer in between.
        self.direct = direct
        self.status_code = 200
        self.background = None
        if headers is None or SSE_HEADERS.keys().isdisjoint(headers):
            # What ``init_headers`` makes of these, with the constant part encoded once.
            self.raw_headers = [*_SSE_RAW, *[(k.lower().encode("latin-1"), v.encode("latin-1"))
                                             for k, v in (headers or {}).items()]]
        else:
            self.init_headers({**SSE_HEADERS, **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        # The body is written by a task of its own (each frame resumes only that short chain of
        # coroutines, not the whole ASGI stack's), a second task watches for the disconnect and
        # the stall watch for a stall; whichever ends first resolves ``ended``. Not `asyncio.wait`
        # over three tasks: per request that was a task, a wait and a wider gather more.
        loop = asyncio.get_running_loop()
        self._sent = 0
        self._sending = False
        ended: asyncio.Future[None] = loop.create_future()
        pump = loop.create_task(self._pump(scope.get(BODY_SEND, send)))
        watch = loop.create_task(_disconnected(receive))
        pump.add_done_callback(partial(_end, ended))
        watch.add_done_callback(partial(_end, ended))
        stall = None
        if self.stall_timeout is not None and self.stall_timeout > 0:
            stall = _StallWatch(self, self.stall_timeout, ended)
        try:
            await ended
        finally:
            if stall is not None:
                stall.cancel()
            if pump.done():
                # The usual end: the body is written. The watch only waits on ``receive``, with
                # nothing to clean up, so it is cancelled and left to end on its own: no gather
                # and shield per request for a task that holds nothing.
                if not watch.done():
                    watch.cancel()
                elif not watch.cancelled():
                    watch.exception()  # retrieved (a failed ``receive``), as the gather would
            else:
                for task in (pump, watch):
                    if not task.done():
                        task.cancel()
                # Shielded: an ASGI server that cancels us repeatedly must not cut the run's cleanup short.
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(asyncio.gather(pump, watch, return_exceptions=True))
        if not pump.cancelled() and (exc := pump.exception()) is not None and not isinstance(exc, OSError):
            log.error("SSE stream failed", exc_info=exc)

    async def _pump(self, send: Send) -> None:
        # Coalesced: under load the upstream's tokens arrive several per read, and each body
        # message costs a trip through the middleware's send wrappers, the HTTP protocol and a
        # socket write, so the frames that wait go together. A run's followers
        # (``direct``) read frames joined already by the run log.
        frames = self.frames() if self.direct else with_heartbeat(self.frames(), self.heartbeat, self.buffer_bytes,
                                                                  coalesce=True)
        async with aclosing(frames):
            async for frame in frames:
                # Two stores per frame instead of a timer per send: `_StallWatch` reads them.
                self._sending = True
                await send({"type": "http.response.body", "body": frame, "more_body": True})
                self._sending = False
                self._sent += 1
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _end(ended: asyncio.Future[None], task: asyncio.Task[None]) -> None:
    if not ended.done():
        ended.set_result(None)


class _StallWatch:
    """Drops the client (resolves ``ended``) once one ``send`` has waited ``seconds``: its socket
    buffers are full and it is not reading. Checked every ``seconds / 4`` at the ticks of the
    loop's ticker of that step (`_ticks`), reading the response's two counters: not a timer per
    send, nor a timer or a task of its own."""

    __slots__ = ("ended", "last", "response", "seconds", "step", "ticker", "waited")

    def __init__(self, response: SSEResponse, seconds: float, ended: asyncio.Future[None]) -> None:
        self.response, self.seconds, self.ended = response, seconds, ended
        self.step = seconds / 4
        self.waited, self.last = 0.0, -1
        self.ticker = ticker(self.step)
        self.ticker.join(self)

    def tick(self) -> None:
        response = self.response
        if response._sending and response._sent == self.last:
            self.waited += self.step
        else:
            self.waited, self.last = 0.0, response._sent
        if self.waited >= self.seconds:
            # Not finishing the response makes the server close the connection.
            log.warning("dropped a client that took nothing for %s s", self.seconds)
            if not self.ended.done():
                self.ended.set_result(None)
            self.cancel()

    def cancel(self) -> None:
        self.ticker.leave(self)


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (the request body was already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
