"""The upstream of `bench_server.py`: a fake OpenAI-compatible Chat Completions server in its own
process, speaking the real streaming wire format (``chat.completion.chunk`` objects as SSE
``data:`` lines over chunked HTTP/1.1, a ``usage`` chunk when ``stream_options.include_usage`` is
set, then ``data: [DONE]``).

What each reply is, the request itself says (so the servers under test pass it on unchanged):
the first user message's text holds ``tokens=100 dt=0.010 tool=1``. ``tool=1`` makes the first
call answer with one tool call (``lookup``, streamed in two argument pieces); once a ``tool``
message is in the conversation the reply is ``tokens`` text tokens. Token ``k`` is written at
``t0 + k × dt``, ``t0`` being when the request was read: the reply's pace is the upstream's, as a
real model's is, and a server that falls behind receives the tokens it missed together.

It is a raw asyncio protocol with every frame encoded once at import: the upstream's own cost per
token (a timer and a socket write) must stay small next to the servers under test.

    python benchmarks/serving_upstream.py --port 0     # prints {"port": N} once listening
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from typing import Any

import serving_probe

PROBE: serving_probe.Probe | None = None

TOKEN = " tok"
_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_SPEC = re.compile(r"tokens=(\d+)\s+dt=([0-9.]+)\s+tool=([01])(?:\s+id=(\S+))?")


def _chunk(delta: dict[str, Any], finish: str | None = None, *, usage: dict[str, int] | None = None,
           choices: bool = True) -> bytes:
    body: dict[str, Any] = {
        "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1_700_000_000, "model": "bench-model",
        "system_fingerprint": "fp_bench",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}] if choices else [],
        "usage": usage,
    }
    data = b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(data), data)


def _frames(usage: bool) -> dict[str, bytes]:
    out = {
        "role": _chunk({"role": "assistant", "content": "", "refusal": None}),
        "token": _chunk({"content": TOKEN}),
        "stop": _chunk({}, "stop"),
        "tool_start": _chunk({"role": "assistant", "content": None, "tool_calls": [
            {"index": 0, "id": "call_bench", "type": "function", "function": {"name": "lookup", "arguments": ""}}]}),
        "tool_args1": _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"query": '}}]}),
        "tool_args2": _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"bench"}'}}]}),
        "tool_stop": _chunk({}, "tool_calls"),
        "done": b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n",
    }
    if usage:
        out["usage"] = _chunk({}, usage={"prompt_tokens": 10, "completion_tokens": 100, "total_tokens": 110},
                              choices=False)
    return out


FRAMES = {True: _frames(True), False: _frames(False)}


def _spec(body: dict[str, Any]) -> tuple[int, float, bool, bool, str | None]:
    """(tokens, dt, answer with a tool call, usage chunk wanted, the stream's id) for a request body."""
    messages = body.get("messages") or []
    text = ""
    for m in messages:
        if m.get("role") == "user":
            content = m.get("content")
            text = content if isinstance(content, str) else " ".join(
                p.get("text", "") for p in content if isinstance(p, dict))
            break
    found = _SPEC.search(text)
    tokens, dt, tool = (int(found[1]), float(found[2]), found[3] == "1") if found else (100, 0.01, False)
    answered = any(m.get("role") == "tool" for m in messages)
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return tokens, dt, tool and not answered, usage, found[4] if found else None


class Upstream(asyncio.Protocol):
    """One connection: requests in sequence (keep-alive), each answered by a paced stream."""

    requests = 0

    def __init__(self) -> None:
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.handle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.busy:
            self._next_request()

    def _next_request(self) -> None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buffer[:end].decode("latin-1")
        length = 0
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if len(self.buffer) < end + 4 + length:
            return
        body = json.loads(self.buffer[end + 4:end + 4 + length] or b"{}")
        self.buffer = self.buffer[end + 4 + length:]
        Upstream.requests += 1
        tokens, dt, tool, usage, stream = _spec(body)
        if stream is not None and not tool and PROBE is not None:
            # When the request was read, for the clients' split of the time to first token (token
            # 0 is written now): the same clock (CLOCK_MONOTONIC) in every process.
            PROBE.extra.setdefault("reads", {})[stream] = time.perf_counter()
        frames = FRAMES[usage]
        assert self.transport is not None
        self.busy = True
        loop = asyncio.get_running_loop()
        if tool:
            self.transport.write(_HEAD + frames["tool_start"] + frames["tool_args1"] + frames["tool_args2"]
                                 + frames["tool_stop"] + frames.get("usage", b"") + frames["done"])
            self._finished()
            return
        self.transport.write(_HEAD + frames["role"] + frames["token"])
        if tokens <= 1:
            self._end(frames)
            return
        t0 = loop.time()
        self._tick(loop, frames, t0, dt, 1, tokens)

    def _tick(self, loop: asyncio.AbstractEventLoop, frames: dict[str, bytes], t0: float, dt: float,
              k: int, tokens: int) -> None:
        # Every token already due goes now, in one write: as a model server behind on its
        # schedule would send them.
        now = loop.time()
        n = 0
        while k < tokens and t0 + k * dt <= now + 0.0005:
            k += 1
            n += 1
        if self.transport is None:
            return
        if n:
            self.transport.write(frames["token"] * n)
        if k >= tokens:
            self.handle = None
            self._end(frames)
            return
        self.handle = loop.call_at(t0 + k * dt, self._tick, loop, frames, t0, dt, k, tokens)

    def _end(self, frames: dict[str, bytes]) -> None:
        assert self.transport is not None
        self.transport.write(frames["stop"] + frames.get("usage", b"") + frames["done"])
        self._finished()

    def _finished(self) -> None:
        self.busy = False
        if self.buffer:
            self._next_request()


async def main(port: int) -> None:
    global PROBE
    loop = asyncio.get_running_loop()
    PROBE = serving_probe.install(loop)
    server = await loop.create_server(Upstream, "127.0.0.1", port, backlog=8192)
    print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    try:
        import uvloop  # the harness, not a server under test: the cheapest loop there is

        run: Any = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        run(main(args.port))
    except KeyboardInterrupt:
        sys.exit(0)
