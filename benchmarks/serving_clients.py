"""The clients of `bench_server.py`: N concurrent AG-UI SSE streams against each server under
test, all at once, in one process of their own.

Each stream is a raw asyncio protocol: it sends ``POST /agui`` (``connection: close``) and counts
``TEXT_MESSAGE_CONTENT`` frames in the bytes as they arrive, without parsing them (so the client
costs little next to the servers). A stream is an error unless the status is 200, the body ends
with ``RUN_FINISHED``, no ``RUN_ERROR`` came, and exactly ``tokens`` text deltas arrived.

The time to first token is from writing the request to the first byte that holds a text delta,
for the runs without a tool turn; the upstream writes the first token as soon as it has read the
request, so all of it is time the server under test (and loopback) added.

One process may hold a share of the streams only (``shard``: ``[i, k]`` takes every k-th stream
from the i-th): the client's own loop lag is measured (`serving_probe`) and reported with its
results, since a client that is behind delays the first deltas it timestamps as much as a server
does; `bench_server.py` spreads a level over several client processes and merges their results
(`summarise`). Each stream's text carries its id (``id=…``), which the upstream records with the
time it read the request, so a time to first token splits into the way in (request written →
upstream read it) and the way out (upstream wrote token 0 → the client read its delta).

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

import serving_probe

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


def stream_id(level: str, name: str, i: int) -> str:
    return f"{level}-{name}-{i}"


def body(name: str, i: int, tokens: int, dt: float, tool: bool, level: str) -> bytes:
    run = stream_id(level, name, i)
    text = f"Answer. tokens={tokens} dt={dt:.6f} tool={int(tool)} id={run}"
    return json.dumps({"threadId": f"t-{run}", "runId": f"r-{run}", "state": {}, "tools": [], "context": [],
                       "forwardedProps": {}, "messages": [{"id": f"m-{run}", "role": "user", "content": text}]}
                      ).encode()


CONNECT_WINDOW = 1024
"""Connects to one server a level keeps pending at most (over all client processes): a server's
loop that is far behind accepts slowly, and thousands of SYNs at once overflow its listen backlog
(4,096); the kernel then drops them and the client retries after 1, 3, 7, 15 s — a connect
timeout that measures the kernel's backoff, not the server. The window holds every server alike
to what its backlog takes; a stream still waits for its server as long as that takes."""
CONNECT_TIMEOUT = 120.0
"""Seconds a stream waits for its connection (the window's wait not counted): at 5,000 streams a
saturated server accepts them over tens of seconds."""


async def one(loop: asyncio.AbstractEventLoop, port: int, payload: bytes, delay: float,
              deadline: float, window: asyncio.Semaphore) -> dict[str, Any]:
    await asyncio.sleep(delay)
    done: asyncio.Future[None] = loop.create_future()
    started = time.perf_counter()
    try:
        async with window:
            transport, stream = await asyncio.wait_for(
                loop.create_connection(lambda: Stream(request(port, payload), done), "127.0.0.1", port),
                CONNECT_TIMEOUT)
    except (TimeoutError, OSError) as exc:
        return {"error": f"connect: {type(exc).__name__}", "started": started, "ended": time.perf_counter()}
    connected = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.shield(done), max(0.1, deadline - loop.time()))
    except TimeoutError:
        transport.close()
        return {"error": "deadline", "started": started, "ended": time.perf_counter(), "deltas": stream.deltas}
    return {"status": stream.status, "deltas": stream.deltas, "finished": stream.finished, "connected": connected,
            "failed": stream.code if stream.failed else None,
            "ttft": None if stream.first is None else stream.first - stream.sent, "sent": stream.sent,
            "first": stream.first,
            "started": started, "ended": time.perf_counter()}


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    """This process's share of the streams: per target its raw outcome (errors, tokens, the span's
    ends, and for each tool-free stream its id, write time and first delta's time)."""
    loop = asyncio.get_running_loop()
    probe = serving_probe.Probe()
    probe.start(loop)
    n, tokens, dt, ramp = spec["n"], spec["tokens"], spec["dt"], spec["ramp"]
    tool_share, level = spec["tool_share"], spec["level"]
    shard, shards = spec.get("shard", [0, 1])
    deadline = loop.time() + spec["deadline"]
    rng = random.Random(7)
    tasks: dict[str, list[tuple[str, bool, asyncio.Task[dict[str, Any]]]]] = {}
    for name, port in spec["targets"].items():
        tasks[name] = []
        window = asyncio.Semaphore(max(1, CONNECT_WINDOW // shards))
        for i in range(n):
            tool = rng.random() < tool_share  # drawn for every stream: the same runs have tools in every shard
            if i % shards != shard:
                continue
            task = loop.create_task(one(loop, port, body(name, i, tokens, dt, tool, level), ramp * i / max(1, n),
                                        deadline, window))
            tasks[name].append((stream_id(level, name, i), tool, task))
    out: dict[str, Any] = {}
    for name, group in tasks.items():
        results = await asyncio.gather(*(t for _, _, t in group))
        errors: dict[str, int] = {}
        firsts: list[tuple[str, float, float]] = []
        for (sid, tool, _), r in zip(group, results, strict=True):
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
            elif r["ttft"] is not None and not tool:
                firsts.append((sid, r["sent"], r["first"]))
        out[name] = {"streams": len(group), "errors": errors, "tokens": sum(r.get("deltas", 0) for r in results),
                     "started": min((r["started"] for r in results), default=0.0),
                     "ended": max((r["ended"] for r in results), default=0.0), "firsts": firsts,
                     "open": [(r["connected"], r["ended"]) for r in results if "connected" in r]}
    return {"targets": out, "probe": probe.snapshot()}


SLOW = 0.05
"""A first token later than this (s; the issue's p99 target) is a slow one, whose wait `summarise` splits."""
CAUSES = ("server full GC", "server young GC", "server busy", "server not run by the host", "client late",
           "upstream late", "the rest")


def covered(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of ``[lo, hi]`` inside the union of ``intervals``."""
    total, reach = 0.0, lo
    for start, end in sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def split_wait(sent: float, first: float, server: list[list[Any]], clients: list[list[Any]],
               upstream: list[list[Any]]) -> dict[str, float]:
    """Seconds of one first token's wait by `CAUSES`: inside a collection of the server's (full,
    or younger), its loop otherwise late with the thread running (busy: other requests' setup,
    other streams' tokens) or not (the host ran other processes), the clients' or the
    upstream's loop late (their own collections included; only where the server was not stalled
    itself), and the rest: no stall of 5 ms anywhere (the request's own work, many short waits)."""
    def kinds(stalls: list[list[Any]], *names: str) -> list[tuple[float, float]]:
        return [(a, b) for a, b, kind in stalls if kind in names]

    every = ("gc2", "gc", "busy", "host")
    full = covered(kinds(server, "gc2"), sent, first)
    young = covered(kinds(server, "gc"), sent, first)
    collecting = covered(kinds(server, "gc2", "gc"), sent, first)
    busy = covered(kinds(server, "gc2", "gc", "busy"), sent, first) - collecting
    server_any = covered(kinds(server, *every), sent, first)
    harness = covered(kinds(clients, *every) + kinds(upstream, *every), sent, first)
    client = covered(kinds(clients, *every), sent, first)
    # Harness stalls count where the server was not stalled itself (both at once: the host).
    anyone = kinds(server, *every) + kinds(clients, *every) + kinds(upstream, *every)
    outside = covered(anyone, sent, first) - server_any
    client_share = outside * (client / harness) if harness else 0.0
    out = {"server full GC": full, "server young GC": young, "server busy": max(0.0, busy),
           "server not run by the host": max(0.0, server_any - collecting - max(0.0, busy)),
           "client late": client_share, "upstream late": outside - client_share}
    out["the rest"] = max(0.0, (first - sent) - sum(out.values()))
    return out


def most_open(spans: list[tuple[float, float]]) -> int:
    """The most streams connected at one time (each open from its connect to its end)."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])  # an end before a start at a tie
    peak = held = 0
    for _, step in edges:
        held += step
        peak = max(peak, held)
    return peak


def summarise(shards: list[dict[str, Any]], reads: dict[str, float],
              stalls: dict[str, list[list[Any]]] | None = None) -> dict[str, dict[str, Any]]:
    """The shards' results merged per target: streams, errors, the most streams open at once,
    tokens, tokens/s over the span,
    time to first token p50/p99 ms, and its two legs where the upstream's ``reads`` (stream id →
    when it read the request) are known: in (written → read) and out (read → first delta). With
    the processes' ``stalls`` (target name, ``"upstream"``; the clients' come with their shards),
    where the waits of the first tokens slower than `SLOW` went (`split_wait`)."""
    stalls = stalls or {}
    clients = [stall for s in shards for stall in s["probe"].get("stalls", [])]
    out: dict[str, dict[str, Any]] = {}
    for name in shards[0]["targets"]:
        parts = [s["targets"][name] for s in shards]
        errors: dict[str, int] = {}
        for p in parts:
            for kind, count in p["errors"].items():
                errors[kind] = errors.get(kind, 0) + count
        streams = sum(p["streams"] for p in parts)
        tokens = sum(p["tokens"] for p in parts)
        span = max(p["ended"] for p in parts) - min(p["started"] for p in parts)
        firsts = [f for p in parts for f in p["firsts"]]
        ttft = serving_probe.quantiles([first - sent for _, sent, first in firsts])
        legs = [(reads[sid] - sent, first - reads[sid]) for sid, sent, first in firsts if sid in reads]
        into = serving_probe.quantiles([a for a, _ in legs])
        back = serving_probe.quantiles([b for _, b in legs])
        slow = dict.fromkeys(CAUSES, 0.0)
        n_slow = 0
        for _, sent, first in firsts:
            if first - sent > SLOW:
                n_slow += 1
                for cause, seconds in split_wait(sent, first, stalls.get(name, []), clients,
                                                 stalls.get("upstream", [])).items():
                    slow[cause] += seconds
        out[name] = {"streams": streams, "completed": streams - sum(errors.values()), "errors": errors,
                     "most_open": most_open([tuple(o) for p in parts for o in p.get("open", [])]),
                     "tokens": tokens, "span_s": span, "tokens_per_s": tokens / span if span > 0 else None,
                     "ttft_ms_p50": ttft["p50"], "ttft_ms_p99": ttft["p99"], "ttft_ms_max": ttft["max"],
                     "ttft_in_ms": into, "ttft_out_ms": back, "ttft_split": len(legs), "ttft_measured": len(firsts),
                     "ttft_slow": n_slow, "ttft_slow_wait_s": slow}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="JSON: targets {name: port}, n, tokens, dt, ramp, shard...")
    spec = json.loads(parser.parse_args().spec)
    try:
        import uvloop  # the harness, not a server under test

        result = uvloop.run(run(spec))
    except ImportError:
        result = asyncio.run(run(spec))
    if "result" in spec:  # bench_server.py: a file, whatever the result's size
        with open(spec["result"], "w") as f:
            json.dump(result, f)
    else:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
