"""A loopback server that misbehaves at byte level, and the providers' replies as whole HTTP responses.

`CutServer` is a raw asyncio server: each request takes the next `Plan` (or the healthy reply its
``fallback`` makes), whose response bytes (status line, headers, body framed as chunked, by
``Content-Length`` or by the connection's close) are written up to a byte offset, where the plan's
fault happens: the connection closed (FIN), reset (RST), or left open with nothing more sent
(a stall, which only the client's read timeout ends). Everything each request got is logged, in
order, in a list the servers of one test may share.

`Spec` is a random well-formed reply (thinking, text, tool calls, usage), and `wire` writes it in
each provider's streaming format (the frames of `fakes` and `responses_wire`); `Wire` knows where
in its bytes the reply's terminator is complete, so a test can tell a cut that leaves the reply
incomplete from one that only cuts what follows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Literal

from .fakes import (
    DONE,
    an_block,
    an_end,
    an_event,
    an_start,
    an_text_block,
    an_tool_block,
    oa_chunk,
    oa_usage,
    ol_done,
    ol_line,
)
from .responses_wire import ResponseStream

PROVIDERS = ("openai", "anthropic", "ollama", "responses")

Framing = Literal["chunked", "length", "close"]
How = Literal["close", "reset", "stall"]


@dataclass(frozen=True)
class Spec:
    """A well-formed reply: ``tag`` makes its text and its usage unique among a run's replies."""

    tag: int
    thinking: tuple[str, ...] = ()
    text: tuple[str, ...] = ()
    calls: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    """(id, city, argument pieces) of each ``get_weather`` call."""

    @property
    def input_tokens(self) -> int:
        return 1000 + self.tag

    @property
    def output_tokens(self) -> int:
        return 7 + self.tag

    @property
    def full_text(self) -> str:
        return "".join(self.text)


def random_spec(rng: random.Random, tag: int, *, tools: bool = True) -> Spec:
    words = ["Hello", " wörld", " —", " 漢字", " sunny", " \\n", ' "q"', " 🙂", " end."]
    text = (f"<{tag}>", *(rng.choice(words) for _ in range(rng.randint(0, 6))))
    thinking = tuple(rng.choice(["Let me", " think", " ✓"]) for _ in range(rng.randint(0, 3)))
    calls: list[tuple[str, str, tuple[str, ...]]] = []
    if tools:
        for k in range(rng.choice((0, 0, 1, 2))):
            city = f"City{tag}x{k}"
            args = json.dumps({"city": city})
            cuts = sorted(rng.sample(range(1, len(args)), rng.randint(0, 3)))
            pieces = tuple(args[a:b] for a, b in zip([0, *cuts], [*cuts, len(args)], strict=True))
            calls.append((f"call_{tag}_{k}", city, pieces))
    return Spec(tag, thinking, text, tuple(calls))


@dataclass
class Wire:
    """A reply's response: ``head`` (status line and headers) and ``body`` (framed), and the offset
    into ``head + body`` past which the reply's terminator is complete (None: the reply has none)."""

    head: bytes
    body: bytes
    terminated_at: int | None
    keep_alive: bool

    @property
    def data(self) -> bytes:
        return self.head + self.body


def _frames(provider: str, spec: Spec) -> tuple[list[bytes], str]:
    """The body's frames (the last one the terminator) and its content type."""
    frames: list[bytes | float]
    if provider == "openai":
        frames = [oa_chunk({"role": "assistant", "content": ""})]
        frames += [oa_chunk({"reasoning_content": t}) for t in spec.thinking]
        frames += [oa_chunk({"content": t}) for t in spec.text]
        for i, (call_id, _, _) in enumerate(spec.calls):
            frames.append(oa_chunk({"tool_calls": [{"index": i, "id": call_id, "type": "function",
                                                    "function": {"name": "get_weather", "arguments": ""}}]}))
        for i, (_, _, pieces) in enumerate(spec.calls):
            frames += [oa_chunk({"tool_calls": [{"index": i, "function": {"arguments": p}}]}) for p in pieces]
        frames.append(oa_chunk({}, "tool_calls" if spec.calls else "stop"))
        frames += [oa_usage(spec.input_tokens, spec.output_tokens), DONE]
        return [f for f in frames if isinstance(f, bytes)], "text/event-stream"
    if provider == "anthropic":
        frames = [an_start(spec.input_tokens)]
        index = 0
        if spec.thinking:
            deltas = [{"type": "thinking_delta", "thinking": t} for t in spec.thinking]
            frames += an_block(index, {"type": "thinking", "thinking": "", "signature": ""},
                               [*deltas, {"type": "signature_delta", "signature": "sig=="}])
            index += 1
        frames += an_text_block(index, *spec.text)
        index += 1
        for call_id, _, pieces in spec.calls:
            frames += an_tool_block(index, call_id, "get_weather", *pieces)
            index += 1
        frames += an_end("tool_use" if spec.calls else "end_turn", spec.output_tokens)
        return [f for f in frames if isinstance(f, bytes)], "text/event-stream"
    if provider == "ollama":
        frames = [ol_line(thinking=t) for t in spec.thinking]
        frames += [ol_line(t) for t in spec.text]
        if spec.calls:
            frames.append(ol_line(tool_calls=[{"function": {"name": "get_weather", "arguments": {"city": city}}}
                                              for _, city, _ in spec.calls]))
        frames.append(ol_done(prompt=spec.input_tokens, output=spec.output_tokens))
        return [f for f in frames if isinstance(f, bytes)], "application/x-ndjson"
    stream = ResponseStream(response_id=f"resp_{spec.tag}")
    if spec.thinking:
        stream.reasoning(*spec.thinking, item_id=f"rs_{spec.tag}")
    stream.text(*spec.text, item_id=f"msg_{spec.tag}")
    for call_id, _, pieces in spec.calls:
        stream.call(call_id, "get_weather", *pieces)
    parts = stream.completed(given=spec.input_tokens, taken=spec.output_tokens)
    return [f for f in parts if isinstance(f, bytes)], "text/event-stream"


def _head(status: int, content_type: str, framing: Framing, length: int, extra: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}", f"content-type: {content_type}"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    if framing == "chunked":
        lines.append("transfer-encoding: chunked")
    elif framing == "length":
        lines.append(f"content-length: {length}")
    else:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def wire(provider: str, spec: Spec, framing: Framing = "chunked", *, error_at: int | None = None,
         error: bytes | None = None, length_delta: int = 0) -> Wire:
    """``spec`` as ``provider`` streams it; ``error`` (a frame) replaces the frames from the
    ``error_at``-th on (the reply then has no terminator); ``length_delta`` makes a
    ``Content-Length`` that says more (or fewer) bytes than the body has."""
    frames, content_type = _frames(provider, spec)
    terminated = True
    if error is not None and error_at is not None:
        frames = [*frames[:min(error_at, len(frames) - 1)], error]  # (the terminator goes at least)
        terminated = False
    if framing == "chunked":
        body = b"".join(b"%x\r\n%s\r\n" % (len(f), f) for f in frames) + b"0\r\n\r\n"
    else:
        body = b"".join(frames)
    head = _head(200, content_type, framing, len(body) + length_delta, {})
    at: int | None = None
    if terminated:
        last = frames[-1]
        # Where the terminator's own bytes end (a JSON object's "}", "[DONE]"), in the framed body.
        end = body.rindex(last) + len(last.rstrip(b"\n"))
        at = len(head) + end
        if length_delta < 0 and len(body) + length_delta < end:
            at = None  # the length cuts the terminator off: no client sees it
    return Wire(head, body, at, keep_alive=framing != "close" and length_delta == 0)


def status_wire(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Wire:
    raw = json.dumps(body).encode()
    head = _head(status, "application/json", "length", len(raw), headers or {})
    return Wire(head, raw, None, keep_alive=True)


def error_frame(provider: str, kind: str, message: str) -> bytes:
    """An error event inside a 200 stream, of the ``type`` ``kind``."""
    if provider == "openai":
        return b"data: " + json.dumps({"error": {"message": message, "type": kind}}).encode() + b"\n\n"
    if provider == "anthropic":
        return an_event({"type": "error", "error": {"type": kind, "message": message}})
    if provider == "ollama":
        return json.dumps({"error": message}).encode() + b"\n"
    data = {"type": "error", "sequence_number": 99, "code": kind, "message": message, "param": None}
    return f"event: error\ndata: {json.dumps(data)}\n\n".encode()


@dataclass
class Plan:
    """What one request gets: ``wire``'s bytes up to ``cut`` (all of them: None), then ``how``."""

    wire: Wire
    cut: int | None = None
    how: How = "close"
    idle_close: float | None = None
    """After a complete reply, close the kept-alive connection this many seconds later."""
    name: str = ""


@dataclass
class Served:
    server: str
    plan: Plan
    spec: Spec | None
    hung_up: bool = False


@dataclass
class CutServer:
    """Serves `Plan`s in order, then ``fallback(tag)``'s healthy reply for every further request."""

    name: str
    log: list[Served]
    fallback: Any  # (tag) -> (Spec, Plan)
    plans: list[tuple[Spec | None, Plan]] = field(default_factory=list)
    open_connections: int = 0
    closing_idle: int = 0
    """Connections the server is about to close once they have been idle (`Plan.idle_close`)."""
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def settled(self, seconds: float = 2.0) -> int:
        """The connections still open once the client's closes had time to arrive."""
        for _ in range(int(seconds / 0.01)):
            if self.open_connections == 0:
                break
            await asyncio.sleep(0.01)
        return self.open_connections

    async def idle_closed(self) -> None:
        """Once the idle connections the server closes are closed, and their close has reached
        the client (a loop iteration or two on loopback)."""
        while self.closing_idle:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.02)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        self.open_connections += 1
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self.open_connections -= 1
            self._tasks.discard(task)  # type: ignore[arg-type]
            writer.close()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await writer.wait_closed()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        length = 0
        for line in head.decode("latin-1").split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        body = await reader.readexactly(length)
        # A request that says "bystander" is another caller's on the same model: always answered well.
        scripted = self.plans and b"bystander" not in body
        spec, plan = self.plans.pop(0) if scripted else self.fallback(len(self.log))
        served = Served(self.name, plan, spec)
        self.log.append(served)
        data = plan.wire.data
        writer.write(data if plan.cut is None else data[:plan.cut])
        await writer.drain()
        if plan.cut is None:
            if plan.idle_close is not None:
                self.closing_idle += 1
                try:
                    await asyncio.sleep(plan.idle_close)
                finally:
                    self.closing_idle -= 1
                return False
            return plan.wire.keep_alive
        if plan.how == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return False
        if plan.how == "stall":
            with contextlib.suppress(ConnectionError):
                while await reader.read(65536):
                    pass
            served.hung_up = True
        return False
