"""`Connection`: one HTTP/1.1 connection to a model server, an asyncio protocol over llhttp.

Why this exists: behind ``agentscope-py serve`` every relayed token is one read of the model
server's reply, and httpx2's default transport spends ~100 Python calls on it (an anyio timeout
scope per read, h11's pure-Python event machinery, five layers of async iterators). Here the
loop hands the bytes to `data_received`, llhttp (httptools' C parser, which the providers'
extras install) calls `on_body` once, and the one waiting reader is woken: a token costs a few
calls. `Http1Transport` (``_transport.py``) pools these and speaks httpx2's
transport interface, so everything above it (the SDK, httpx2's client, its exceptions) is the
same.

One response at a time: the transport writes a request (`send`), awaits `head`, then the body is
read through `iter_body`, and the connection goes back for reuse only when the body ended as its
framing said and both sides keep it alive.

The read timeout without a timer per read: while a response is outstanding a watchdog fires every
eighth of the timeout; a tick that finds a reader waiting and no byte since the last tick counts
as idle, and eight idle ticks in a row fail the read. So a read fails after between 1 and 9/8
times the timeout without data (never before), and a token costs one attribute store.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any, NoReturn, cast

import httptools
import httpx2

__all__ = ["Connection"]

# Bytes of body held for a reader that is not reading before the socket stops being read (the
# server then blocks on its side: back-pressure instead of memory).
_HIGH_WATER = 256 * 1024
_TICKS = 8


class Connection(asyncio.Protocol):
    """One connection; see the module docstring. Owned by one request at a time."""

    def __init__(self, origin: tuple[bytes, bytes, int]) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.responses = 0  # responses completed on this connection (a reused one had some)
        self.idle_since = 0.0
        self.on_lost: Any = None  # the pool's callback while the connection is idle
        self.on_done: Any = None  # the pool's callback at a response's end
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpResponseParser(self)
        self._fault: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._write_waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._timer: asyncio.TimerHandle | None = None
        self._tick = 0.0
        self._idle_ticks = 0
        self._fresh = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.chunks: list[bytes] = []
        self._buffered = 0
        self.got_bytes = False
        self._head_only = False
        self._until_close = False
        self._keep_alive = False

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (a stream connection's)

    def data_received(self, data: bytes) -> None:
        self._fresh = True
        self.got_bytes = True
        if self.complete:
            # Bytes after a complete response and before the next request: the server broke the
            # framing (or sent an unasked response); the connection cannot be trusted again.
            self._fail(httpx2.RemoteProtocolError("the server sent bytes after a complete response"))
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx2.RemoteProtocolError("the server switched protocols, which a model call never asks for"))
            return
        except httptools.HttpParserError as exc:
            self._fail(httpx2.RemoteProtocolError(f"malformed HTTP response: {exc}"))
            return
        waiter = self._waiter  # (`_wake`, inline: this runs per token)
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_watchdog()
        if self.head_done and not self.complete and self._until_close:
            self.complete = True  # a body framed by the connection's end has ended
        elif not self.complete:
            what = ("the server closed the connection without sending a response" if not self.head_done
                    else "the server closed the connection before the response's end")
            self._fault = self._fault or httpx2.RemoteProtocolError(what + (f" ({exc})" if exc else ""))
        self._wake()
        self.resume_writing()  # a writer waiting for room finds the connection closed
        if self.on_lost is not None:
            self.on_lost(self)

    def pause_writing(self) -> None:
        self._write_waiter = self._loop.create_future()

    def resume_writing(self) -> None:
        waiter, self._write_waiter = self._write_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- llhttp's callbacks --------------------------------------------------------------------

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            self.headers = []  # an interim response (100 Continue, 103): the real one follows
            self.reason = b""
            return
        self.status = status
        self.head_done = True
        # (asked here: llhttp forgets the message's flags once it is complete)
        self._keep_alive = self._parser.should_keep_alive()
        lengths = {name.lower() for name, _ in self.headers} & {b"content-length", b"transfer-encoding"}
        self._until_close = not lengths and status not in (204, 304)
        if self._head_only:
            self.complete = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        if self.head_done:
            self.complete = True

    # -- what the transport calls -------------------------------------------------------------

    async def send(self, head: bytes, body: bytes | None, chunks: Any, *, head_only: bool,
                   timeouts: tuple[float | None, float | None]) -> None:
        """Write one request (``body`` whole, or ``chunks`` an async iterable written as they
        come) and start the read watchdog."""
        transport = self.transport
        if transport is None or self.closed:
            self._raise()
        self._reset()
        self._head_only = head_only
        write_timeout, read_timeout = timeouts
        self._start_watchdog(read_timeout)
        transport.write(head + body if body else head)
        if chunks is not None:
            async for piece in chunks:
                transport.write(piece)
                await self._drain(write_timeout)
        await self._drain(write_timeout)

    async def _drain(self, seconds: float | None) -> None:
        waiter = self._write_waiter
        if waiter is None:
            if self.closed:
                self._raise()
            return
        async with asyncio.timeout(seconds):
            await waiter
        if self.closed:
            self._raise()

    async def head(self) -> None:
        """Wait for the response's status line and headers."""
        while not self.head_done:
            await self._wait()

    async def iter_body(self) -> AsyncGenerator[bytes, None]:
        """The body, as the bytes that came together; `done` runs at its end, however it ends.

        The loop is this generator's own (no read coroutine under it): it runs per token."""
        try:
            while True:
                chunks = self.chunks
                if chunks:
                    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                    self.chunks = []
                    self._buffered = 0
                    if self._paused:
                        self._resume()
                    yield data
                elif self.complete:
                    return
                else:  # (`_wait`, inline: a coroutine fewer per token)
                    if self._fault is not None:
                        self._raise()
                    self._fresh = True
                    self._waiter = waiter = self._loop.create_future()
                    await waiter
        finally:
            self.done()

    def _resume(self) -> None:
        self._paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def done(self) -> None:
        """The response is over (read to its end, failed, or abandoned): hand the connection
        back through ``on_done``, once."""
        self._stop_watchdog()
        on_done, self.on_done = self.on_done, None
        if on_done is not None:
            on_done(self)

    async def _wait(self) -> None:
        if self._fault is not None:
            self._raise()
        self._fresh = True  # the wait starts now: the watchdog counts from here
        self._waiter = waiter = self._loop.create_future()
        await waiter

    def _raise(self) -> NoReturn:
        raise self._fault or httpx2.RemoteProtocolError("the connection is closed")

    def reusable(self) -> bool:
        """Whether the next request may use this connection: the response ended as framed and
        both sides keep the connection alive."""
        return (self.complete and not self.closed and self._fault is None and not self._until_close
                and not self._head_only and self._keep_alive)

    def close(self) -> None:
        self._stop_watchdog()
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    def abort(self) -> None:
        """Close without flushing (a response abandoned midway)."""
        self._stop_watchdog()
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()

    # -- the watchdog -------------------------------------------------------------------------

    def _start_watchdog(self, timeout: float | None) -> None:
        self._stop_watchdog()
        if timeout is None:
            return
        self._tick = timeout / _TICKS
        self._idle_ticks = 0
        self._timer = self._loop.call_later(self._tick, self._on_tick)

    def _stop_watchdog(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_tick(self) -> None:
        if self._fresh or self._waiter is None:
            self._fresh = False
            self._idle_ticks = 0
        else:
            self._idle_ticks += 1
            if self._idle_ticks >= _TICKS:
                self._timer = None
                self._fail(httpx2.ReadTimeout(f"no data from the server for {self._tick * _TICKS:g} s"))
                return
        self._timer = self._loop.call_later(self._tick, self._on_tick)

    def _fail(self, fault: BaseException) -> None:
        if self._fault is None:
            self._fault = fault
        self.abort()
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
