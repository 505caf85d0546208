"""The clients of `bench_server.py`: N concurrent AG-UI SSE streams against each server under
test, all at once, in one process of their own.

Each stream is a raw asyncio protocol: it sends ``POST /agui`` (``connection: close``) and counts
``TEXT_MESSAGE_CONTENT`` frames in the bytes as they arrive, without parsing them (so the client
costs little next to the servers). A stream is an error unless the status is 200, the body ends
with ``RUN_FINISHED``, no ``RUN_ERROR`` came, and exactly ``tokens`` text deltas arrived.

The time to first token is from writing the request to the first byte that holds a text delta,
for the runs without a tool turn; the upstream writes the first token as soon as it has read the
request, so all of it is time the server under test (and loopback) added.

    python benchmarks/serving_clients.py --spec '{"targets": {"relay": 8001}, "n": 100, ...}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

DELTA = b"TEXT_MESSAGE_CONTENT"
FINISHED = b"RUN_FINISHED"
FAILED = b"RUN_ERROR"
_TAIL = max(len(DELTA), len(FINISHED), len(FAILED)) - 1


class Stream(asyncio.Protocol):
    __slots__ = ("buf", "code", "deltas", "done", "failed", "finished", "first", "head", "sent", "status", "tail",
                 "transport")

    def __init__(self, request: bytes, done: asyncio.Future[None]) -> None:
        self.head = request
        self.done = done
        self.tail = b""
        self.buf = b""
        self.status = 0
        self.deltas = 0
        self.finished = False
        self.failed = False
        self.code = ""
        self.first: float | None = None
        self.sent = 0.0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.sent = time.perf_counter()
        transport.write(self.head)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if not self.status:
            self.buf += data
            end = self.buf.find(b"\r\n")
            if end < 0:
                return
            self.status = int(self.buf[9:12])
            data, self.buf = self.buf, b""
        chunk = self.tail + data
        n = chunk.count(DELTA)
        if n:
            if self.first is None:
                self.first = time.perf_counter()
            self.deltas += n
        if FINISHED in chunk:
            self.finished = True
        if FAILED in chunk and not self.failed:
            self.failed = True
            at = chunk.find(b'"code":"', chunk.find(FAILED))
            self.code = chunk[at + 8:chunk.find(b'"', at + 8)].decode(errors="replace") if at >= 0 else "?"
        self.tail = chunk[-_TAIL:]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


def request(port: int, body: bytes) -> bytes:
    return (b"POST /agui HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
            b"accept: text/event-stream\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%b"
            % (port, len(body), body))


def body(name: str, i: int, tokens: int, dt: float, tool: bool, level: str) -> bytes:
    run = f"{level}-{name}-{i}"
    text = f"Answer. tokens={tokens} dt={dt:.6f} tool={int(tool)}"
    return json.dumps({"threadId": f"t-{run}", "runId": f"r-{run}", "state": {}, "tools": [], "context": [],
                       "forwardedProps": {}, "messages": [{"id": f"m-{run}", "role": "user", "content": text}]}
                      ).encode()


async def one(loop: asyncio.AbstractEventLoop, port: int, payload: bytes, delay: float,
              deadline: float) -> dict[str, Any]:
    await asyncio.sleep(delay)
    done: asyncio.Future[None] = loop.create_future()
    started = time.perf_counter()
    try:
        transport, stream = await asyncio.wait_for(
            loop.create_connection(lambda: Stream(request(port, payload), done), "127.0.0.1", port), 30)
    except (TimeoutError, OSError) as exc:
        return {"error": f"connect: {type(exc).__name__}", "started": started, "ended": time.perf_counter()}
    try:
        await asyncio.wait_for(asyncio.shield(done), max(0.1, deadline - loop.time()))
    except TimeoutError:
        transport.close()
        return {"error": "deadline", "started": started, "ended": time.perf_counter(), "deltas": stream.deltas}
    return {"status": stream.status, "deltas": stream.deltas, "finished": stream.finished,
            "failed": stream.code if stream.failed else None,
            "ttft": None if stream.first is None else stream.first - stream.sent,
            "started": started, "ended": time.perf_counter()}


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    n, tokens, dt, ramp = spec["n"], spec["tokens"], spec["dt"], spec["ramp"]
    tool_share, level = spec["tool_share"], spec["level"]
    deadline = loop.time() + spec["deadline"]
    rng = random.Random(7)
    tasks: dict[str, list[asyncio.Task[dict[str, Any]]]] = {}
    for name, port in spec["targets"].items():
        tasks[name] = []
        for i in range(n):
            tool = rng.random() < tool_share
            tasks[name].append(loop.create_task(
                one(loop, port, body(name, i, tokens, dt, tool, level), ramp * i / max(1, n), deadline),
                name=f"{name}:{i}:{int(tool)}"))
    out: dict[str, Any] = {}
    for name, group in tasks.items():
        results = await asyncio.gather(*group)
        errors: dict[str, int] = {}
        ttft: list[float] = []
        deltas = 0
        for task, r in zip(group, results, strict=True):
            deltas += r.get("deltas", 0)
            kind = r.get("error")
            if kind is None and r["status"] != 200:
                kind = f"status {r['status']}"
            elif kind is None and r["failed"]:
                kind = f"RUN_ERROR {r['failed']}"
            elif kind is None and not r["finished"]:
                kind = "no RUN_FINISHED"
            elif kind is None and r["deltas"] != tokens:
                kind = "wrong token count"
            if kind is not None:
                errors[kind] = errors.get(kind, 0) + 1
            elif r["ttft"] is not None and task.get_name().endswith(":0"):
                ttft.append(r["ttft"])
        span = max(r["ended"] for r in results) - min(r["started"] for r in results)
        out[name] = {"streams": n, "completed": n - sum(errors.values()), "errors": errors, "tokens": deltas,
                     "span_s": span, "tokens_per_s": deltas / span if span > 0 else None,
                     "ttft_ms_p50": None if not ttft else 1000 * (_quantile(ttft, 0.5) or 0),
                     "ttft_ms_p99": None if not ttft else 1000 * (_quantile(ttft, 0.99) or 0)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="JSON: targets {name: port}, n, tokens, dt, ramp, ...")
    spec = json.loads(parser.parse_args().spec)
    try:
        import uvloop  # the harness, not a server under test

        result = uvloop.run(run(spec))
    except ImportError:
        result = asyncio.run(run(spec))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
