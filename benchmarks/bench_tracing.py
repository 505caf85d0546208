"""What OtelTracingMiddleware costs when no OpenTelemetry SDK is configured.

The same agent run (three ReAct rounds: two tool calls, then a 200-delta answer, on
`ScriptedModel`) is timed in three variants:

* ``none``     — no middleware: the floor;
* ``otel_noop``— `OtelTracingMiddleware` with ``trace.NoOpTracerProvider()`` (no SDK). Target:
  within 5% of ``none`` (each hook passes straight through; no span, no wrapper);
* ``otel_sdk`` — for reference, the real SDK recording every span (a ``TracerProvider`` with an
  in-memory exporter), which is what tracing costs when it is on.

Each sweep runs one batch per variant, back to back in a rotating order, each batch on a fresh
agent with garbage collection paused. The ratio reported is the median over sweeps of ``variant
batch time / none batch time`` of the same sweep: pairing batches that ran moments apart cancels
the slow drifts of a shared machine. ``--json`` prints ``{"otel_noop": r, "otel_sdk": r}`` as the
last line.

    .venv/bin/python benchmarks/bench_tracing.py                # 20 runs per batch, 41 sweeps
    .venv/bin/python benchmarks/bench_tracing.py --runs 20 --repeat 3 --json   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import statistics
import time
from collections.abc import Callable

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agentscope_py import MiddlewareBase, ModelStep, ReActAgent, RuntimeContext, ScriptedModel, tool
from agentscope_py.middleware import OtelTracingMiddleware


@tool
async def lookup(q: str) -> str:
    """Look something up."""
    return f"result for {q}"


def script() -> list[ModelStep]:
    return [
        ModelStep.tool_call("lookup", {"q": "a"}, text="Let me check."),
        ModelStep.tool_call("lookup", {"q": "b"}),
        ModelStep.text("x" * 800, chunks=200),
    ]


def make_agent(middleware: MiddlewareBase | None) -> ReActAgent:
    model = ScriptedModel(script(), loop=True)
    builder = ReActAgent.builder().model(model).tools(lookup)
    if middleware is not None:
        builder.middleware(middleware)
    return builder.build()


_sessions = itertools.count()


async def time_runs(agent: ReActAgent, runs: int) -> float:
    # A new session per run: every run starts from an empty memory, so all runs are the same size.
    contexts = [RuntimeContext(session_id=f"s{next(_sessions)}") for _ in range(runs)]
    gc.collect()
    gc.disable()  # a collection landing in one variant's batch and not another's is noise
    try:
        start = time.perf_counter()
        for ctx in contexts:
            async for _ in agent.stream("go", ctx=ctx):
                pass
        return time.perf_counter() - start
    finally:
        gc.enable()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=41)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    exporter = InMemorySpanExporter()
    sdk = TracerProvider()
    sdk.add_span_processor(SimpleSpanProcessor(exporter))
    variants: dict[str, Callable[[], ReActAgent]] = {
        "none": lambda: make_agent(None),
        "otel_noop": lambda: make_agent(OtelTracingMiddleware(trace.NoOpTracerProvider())),
        "otel_sdk": lambda: make_agent(OtelTracingMiddleware(sdk)),
    }
    for build in variants.values():  # warm up
        await time_runs(build(), 5)
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for sweep in range(args.repeat):
        k = sweep % len(names)
        for name in names[k:] + names[:k]:  # rotate: no variant always goes first
            # A fresh agent per batch: its in-memory store starts empty, like every other's.
            times[name].append(await time_runs(variants[name](), args.runs))
            exporter.clear()

    # Each sweep's batches ran back to back, so their ratio cancels the machine's slow drifts;
    # the median of those paired ratios is the figure reported.
    ratios = {
        name: statistics.median(t / base for t, base in zip(times[name], times["none"], strict=True))
        for name in names if name != "none"
    }
    print(f"{args.runs} runs per batch, {args.repeat} sweeps (best batch shown; ratio: median of paired ratios)")
    for name in names:
        ratio = "" if name == "none" else f"  ratio {ratios[name]:.3f}"
        print(f"  {name:<10} {min(times[name]) * 1000 / args.runs:8.3f} ms/run{ratio}")
    verdict = "within" if ratios["otel_noop"] <= 1.05 else "OVER"
    print(f"no-op tracing overhead: {(ratios['otel_noop'] - 1) * 100:+.1f}% ({verdict} the 5% target)")
    if args.json:
        print(json.dumps({name: round(r, 4) for name, r in ratios.items()}))


if __name__ == "__main__":
    asyncio.run(main())
