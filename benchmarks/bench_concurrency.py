"""Many concurrent streaming sessions in one process: CPU per published event, added latency, RSS.

N sessions (default 1,000 and 10,000) run at once against one agent. Each session's fake model
streams ``--tokens`` (100) text tokens, token ``k`` scheduled at ``t0 + k × --interval`` (20 ms),
where ``t0`` is when that model call starts (session starts are spread over one interval). The
events go through ``--middleware`` (5) middleware at ``on_model_call`` — by default each one a
fused ``map`` (a per-event operator, the case that costs per event; ``--mw-kind passthrough`` for
hooks that return ``next(input)``) — and every event the caller receives is encoded as one SSE
frame with ``agentscope_py.server.encode_sse`` (or, when the server extra is not importable,
``"data: " + event.model_dump_json() + "\\n\\n"``; the output says which).

Reported per level:

* CPU µs per published event: ``time.process_time()`` over the level ÷ frames encoded (every
  event of every session, ~107 per session). It includes the simulation: the fake model's timers.
  ``--floor`` also runs the same sessions without the agent (model → one validated event per chunk
  → SSE), so the difference is what the runtime adds.
* added latency per text delta, p50/p99: when its frame was encoded minus when the model was
  scheduled to emit the token. When the process cannot keep up (N × 50 tokens/s × CPU per event
  > one core), this grows with the backlog: then the level is throughput-bound (busy ≥ 85 % of
  the wall time), and says so.
* peak RSS growth per session: /proc/self/statm sampled every 50 ms, peak minus the baseline
  before the sessions started, ÷ N.

Every level has a deadline (``--deadline`` s): sessions still running then are cancelled and the
level reports what completed (``partial: true``). ``--repeat N`` runs each level N times (floor and
agent alternated): this host's speed swings by ±20 % between runs, so the run with the median CPU
per event stands for the level, and the JSON keeps every run's figure.

    .venv/bin/python benchmarks/bench_concurrency.py                       # 1,000 and 10,000
    .venv/bin/python benchmarks/bench_concurrency.py --sessions 50 --tokens 10 --json   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from agentscope_py import ExtensionPoint, MiddlewareBase, ReActAgent, RuntimeContext
from agentscope_py.events import TextBlockDelta
from agentscope_py.message import ChatUsage
from agentscope_py.model.base import ChatChunk, ModelRequest

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def sse_encoder(kind: str = "auto") -> tuple[Callable[[Any], bytes], str]:
    def fallback(event: Any) -> bytes:
        return ("data: " + event.model_dump_json() + "\n\n").encode()

    if kind == "auto":
        try:
            from agentscope_py.server import encode_sse

            return encode_sse, "agentscope_py.server.encode_sse"
        except ImportError:
            pass
    return fallback, 'fallback: "data: " + event.model_dump_json() + "\\n\\n"'


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except OSError:  # not Linux: ru_maxrss is a peak, good enough for a ceiling
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Clock:
    """The simulated token clock: ``phases`` ticks per interval, one shared future per phase, so
    N sessions cost ``phases`` timers per interval instead of N (a per-session ``sleep`` per token
    would bill the benchmark's own timers to every event). ``fired[p]`` is the scheduled time of
    phase ``p``'s last tick; a tick fires late when the loop is busy, which is counted."""

    def __init__(self, interval: float, phases: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.interval = interval
        self.phases = phases
        self.futures: list[asyncio.Future[float]] = [self.loop.create_future() for _ in range(phases)]
        self.fired = [float("-inf")] * phases
        self.task = self.loop.create_task(self._run())

    async def _run(self) -> None:
        loop, step = self.loop, self.interval / self.phases
        start = loop.time()
        i = 0
        while True:
            due = start + i * step
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            p = i % self.phases
            fut, self.futures[p] = self.futures[p], loop.create_future()
            self.fired[p] = due
            fut.set_result(due)
            i += 1

    async def at(self, phase: int, due: float) -> None:
        """Return once phase ``phase`` has ticked at (or after) ``due``."""
        while self.fired[phase] < due - 1e-9:
            await self.futures[phase]

    def close(self) -> None:
        self.task.cancel()


class PacedModel:
    """Streams ``tokens`` text chunks; session i's token k is due at ``first_i + k × interval``,
    ``first_i`` being its phase's next tick when the call starts. ``first[i]`` records it."""

    name = "paced"

    def __init__(self, tokens: int, clock: Clock) -> None:
        self.clock = clock
        self.chunks = [ChatChunk(text=f"t{k} ") for k in range(tokens)]
        self.last = ChatChunk(usage=ChatUsage(input_tokens=10, output_tokens=tokens), finish_reason="stop")
        self.first: dict[int, float] = {}

    def stream(self, request: ModelRequest) -> Any:
        return self.play(int(request.messages[-1].text))

    async def play(self, session: int) -> Any:
        clock = self.clock
        phase = session % clock.phases
        first = await clock.futures[phase]
        self.first[session] = first
        interval, fired, futures = clock.interval, clock.fired, clock.futures
        for k, chunk in enumerate(self.chunks):
            if k:  # clock.at(phase, due), inlined: the simulation's cost is billed to every event
                due = first + k * interval - 1e-9
                while fired[phase] < due:
                    await futures[phase]
            yield chunk
        yield self.last


def middlewares(n: int, kind: str) -> list[MiddlewareBase]:
    def identity(event: Any) -> Any:
        return event

    class MapHook(MiddlewareBase):
        def active_points(self) -> Any:
            return (ExtensionPoint.ON_MODEL_CALL,)

        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input).map(identity)

    class PassThrough(MiddlewareBase):
        def active_points(self) -> Any:
            return (ExtensionPoint.ON_MODEL_CALL,)

        def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
            return next(input)

    cls = MapHook if kind == "map" else PassThrough
    return [cls() for _ in range(n)]


async def run_level(args: argparse.Namespace, n: int, floor: bool) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    encode, _ = sse_encoder(args.encoder)
    clock = Clock(args.interval, args.phases)
    model = PacedModel(args.tokens, clock)
    agent = (ReActAgent.builder().name("streamer").sys_prompt("Stream.").model(model)
             .middlewares(middlewares(args.middleware, args.mw_kind)).build())
    interval = args.interval
    first = model.first
    latencies: list[float] = []
    record = latencies.append
    published = 0
    completed = 0

    # loop.time() without its Python frame, where it is time.monotonic() (asyncio's own loops)
    now = time.monotonic if type(loop).time is asyncio.BaseEventLoop.time else loop.time

    async def session(i: int) -> None:
        nonlocal published, completed
        await asyncio.sleep(random.uniform(0, args.ramp))  # arrivals spread over the ramp
        k = 0
        if floor:
            async for chunk in model.play(i):
                if chunk.text:
                    encode(TextBlockDelta(reply_id="r", block_id="b", delta=chunk.text))
                    record(now() - (first[i] + k * interval))
                    k += 1
                published += 1
        else:
            async for event in agent.stream(str(i), ctx=RuntimeContext(user_id="bench", session_id=f"s{i}")):
                encode(event)
                published += 1
                if type(event) is TextBlockDelta:
                    record(now() - (first[i] + k * interval))
                    k += 1
        completed += 1

    peak = 0

    async def sampler() -> None:
        nonlocal peak
        while True:
            peak = max(peak, rss_bytes())
            await asyncio.sleep(0.05)

    gc.collect()
    base_rss = rss_bytes()
    peak = base_rss
    sample_task = loop.create_task(sampler())
    cpu0, wall0 = time.process_time(), time.perf_counter()
    tasks = [loop.create_task(session(i)) for i in range(n)]
    done, pending = await asyncio.wait(tasks, timeout=args.deadline)
    partial = bool(pending)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    peak = max(peak, rss_bytes())
    sample_task.cancel()
    clock.close()
    errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
    lat_ms = sorted(x * 1000 for x in latencies)

    def pct(p: float) -> float | None:
        if not lat_ms:
            return None
        return lat_ms[min(len(lat_ms) - 1, int(p / 100 * len(lat_ms)))]

    ideal = args.ramp + args.tokens * interval + interval
    return {
        "variant": "floor (model → event → SSE, no agent)" if floor else "agent",
        "sessions": n, "completed": completed, "partial": partial,
        "errors": [f"{type(e).__name__}: {e}" for e in errors[:3]], "error_count": len(errors),
        "events_published": published, "cpu_s": cpu, "wall_s": wall,
        "cpu_us_per_event": cpu / published * 1e6 if published else None,
        "latency_ms_p50": pct(50), "latency_ms_p99": pct(99), "latency_samples": len(lat_ms),
        "latency_ms_mean": statistics.fmean(lat_ms) if lat_ms else None,
        "peak_rss_kib_per_session": (peak - base_rss) / n / 1024,
        # Busy ≥ 85 % of the wall time, or much longer than the schedule: tokens queue behind CPU.
        "throughput_bound": cpu > 0.85 * wall or wall > 1.5 * ideal,
        "busy_fraction": cpu / wall if wall else None,
        "events_per_s": published / wall if wall else None,
    }


def report(r: dict[str, Any], n: int, floor: bool, suffix: str) -> None:
    note = []
    if r["partial"]:
        note.append("PARTIAL (deadline)")
    if r["throughput_bound"]:
        note.append("throughput-bound: latency is backlog")
    if r["error_count"]:
        note.append(f"{r['error_count']} errors: {r['errors'][0]}")

    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    print(f"{'floor' if floor else 'agent':<10}{n:>9,}{r['completed']:>8,}{r['events_published']:>11,}"
          f"{f(r['cpu_us_per_event'], '.2f'):>11}{f(r['latency_ms_p50'], '.2f'):>9}"
          f"{f(r['latency_ms_p99'], '.2f'):>9}{r['peak_rss_kib_per_session']:>10.1f}"
          f"{r['wall_s']:>8.1f}  {'; '.join(note)}{suffix}", flush=True)


def summarise(runs: list[dict[str, Any]], n: int, floor: bool, repeat: int) -> dict[str, Any]:
    """The run with the median CPU per event stands for the level; every run's figure is kept.
    The peak RSS is the largest of the runs: later runs in the process reuse the heap the first
    one grew (as a long-running server does), so only the first shows what a session costs."""
    cpu = [r["cpu_us_per_event"] for r in runs if r["cpu_us_per_event"] is not None]
    ordered = sorted(runs, key=lambda r: r["cpu_us_per_event"] if r["cpu_us_per_event"] is not None else float("inf"))
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["runs"] = len(runs)
    chosen["cpu_us_per_event_runs"] = cpu
    chosen["peak_rss_kib_per_session"] = max(r["peak_rss_kib_per_session"] for r in runs)
    if repeat > 1 and cpu:
        print(f"{'floor' if floor else 'agent':<10}{n:>9,}  CPU µs/event over {len(runs)} runs: median "
              f"{statistics.median(cpu):.2f}, {min(cpu):.2f}–{max(cpu):.2f}", flush=True)
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", default="1000,10000", help="comma-separated session counts")
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--interval", type=float, default=0.020, help="seconds between tokens (default 0.020)")
    p.add_argument("--ramp", type=float, default=1.0,
                   help="session starts are spread uniformly over this many seconds (default 1.0)")
    p.add_argument("--phases", type=int, default=4, help="clock ticks per interval (default 4)")
    p.add_argument("--middleware", type=int, default=5)
    p.add_argument("--mw-kind", choices=("map", "passthrough"), default="map")
    p.add_argument("--floor", action="store_true", help="also run each level without the agent")
    p.add_argument("--deadline", type=float, default=180.0, help="seconds per level before it is cut short")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per level (variants alternated); the run with the median CPU per event "
                        "stands for the level in the JSON, with every run's figure beside it")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--encoder", choices=("auto", "fallback"), default="auto",
                   help="auto: agentscope_py.server.encode_sse when importable; fallback: model_dump_json")
    p.add_argument("--gc", choices=("serve", "python"), default="serve",
                   help="serve: the collector settings `agentscope-py serve` applies (agentscope_py.server."
                        "tune_gc: gc.freeze() after start-up, thresholds GC_THRESHOLDS); python: Python's defaults")
    p.add_argument("--gc-threshold", type=int, default=0,
                   help="then set gc threshold0 (generation 0) to this, e.g. 50000")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--json-out", help="also write the JSON summary to this file")
    args = p.parse_args(argv)
    random.seed(args.seed)
    gc_mode = "python (700, 10, 10)"
    if args.gc == "serve":
        try:
            from agentscope_py.server import tune_gc

            tune_gc()
            gc_mode = f"serve (tune_gc: freeze, {gc.get_threshold()})"
        except ImportError as exc:  # no server extra: Python's defaults, and say so
            gc_mode = f"python (server extra missing: {exc})"
    if args.gc_threshold:
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
        gc_mode += f", threshold0 {args.gc_threshold}"
    levels = [int(x) for x in args.sessions.split(",") if x]
    _, encoder_name = sse_encoder(args.encoder)
    out: dict[str, Any] = {
        "machine": {"nproc": os.cpu_count(), "python": sys.version.split()[0],
                    "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None},
        "config": {"tokens": args.tokens, "interval_s": args.interval, "middleware": args.middleware,
                   "mw_kind": args.mw_kind, "encoder": encoder_name, "deadline_s": args.deadline,
                   "gc": gc_mode, "gc_threshold": list(gc.get_threshold())},
        "levels": [], "finished": False,
    }
    print(f"bench_concurrency: {args.tokens} tokens × {args.interval * 1000:.0f} ms per session, "
          f"{args.middleware} {args.mw_kind} middleware, SSE via {encoder_name}, gc: {gc_mode}")
    print(f"{'variant':<10}{'sessions':>9}{'done':>8}{'events':>11}{'CPU µs/ev':>11}{'p50 ms':>9}"
          f"{'p99 ms':>9}{'KiB/sess':>10}{'wall s':>8}  note")
    from bench_agents import reference_ms

    out["machine"]["reference_ms_start"] = round(reference_ms(), 1)
    try:
        for n in levels:
            variants = [True, False] if args.floor else [False]
            runs: dict[bool, list[dict[str, Any]]] = {floor: [] for floor in variants}
            for i in range(args.repeat):
                for floor in variants:  # alternated, so both variants see the host's swings alike
                    r = asyncio.run(run_level(args, n, floor))
                    runs[floor].append(r)
                    report(r, n, floor, f" (run {i + 1}/{args.repeat})" if args.repeat > 1 else "")
            for floor in variants:
                out["levels"].append(summarise(runs[floor], n, floor, args.repeat))
        out["finished"] = True
        out["machine"]["reference_ms_end"] = round(reference_ms(), 1)
        print(f"CPU speed probe (1M-iteration Python loop): {out['machine']['reference_ms_start']} ms at the "
              f"start, {out['machine']['reference_ms_end']} ms at the end (37 ms = this VM at its fastest)")
    except (KeyboardInterrupt, Exception) as exc:  # report what finished
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(f"stopped: {out['error']}; the rows above are what completed")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(out, fh, indent=1)
    if args.json:
        print(json.dumps(out))
    return 0 if out["finished"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
