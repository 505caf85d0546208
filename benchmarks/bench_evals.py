"""What evaluation costs: a dataset's throughput and memory, the runner's overhead over the same
agents run bare, and `EvalMiddleware`'s cost on the user's path at 100 % sampling.

The agent (on `ScriptedModel`): one tool call, then a 20-delta answer — two model calls, one tool.

* **throughput** — ``--cases`` cases (default 1,000) at ``--concurrency`` (default 50) with three
  evaluators (`Contains`, `ToolTrajectory`, `MaxModelCalls`): cases per second, and the Python
  heap's peak during the evaluation and what the finished report keeps (tracemalloc, in a separate
  pass, since tracing allocations slows the run);
* **overhead** — the same cases run bare (the same factory, ``agent.call`` at the same concurrency
  with the same worker pool, no events kept, nothing scored) against ``dataset.evaluate``, with the
  three evaluators and with none (the runner, contexts and report alone): the ratio of CPU time
  (``time.process_time``; on a shared machine wall time measures the neighbours too) of batches
  run back to back with the collector paused, median over ``--repeat`` sweeps;
* **online** — ``--runs`` sequential ``agent.call`` on one agent with `EvalMiddleware(sample_rate=1.0)`
  against the agent without it (and against one with a pass-through ``on_agent`` middleware: the
  layer any middleware at that hook costs, which `EvalMiddleware` has none of), CPU time
  (``time.process_time``, collector paused) per run.
  While the path is timed the one scoring worker is held by a gated evaluator and the queue holds
  one run, so every later run takes the whole path (the sampling draw, one append per event, the
  offer to the queue) and is dropped: the figure is the path's own cost, without the scoring and
  without runs piling up in memory. The scoring's CPU per run is measured apart (every run
  queued, then drained) and reported beside it.

``--instructions`` counts instructions instead (valgrind's callgrind, ``PYTHONHASHSEED=0``, the
collector left on): per run, (start-up + warm-up + N runs) − (start-up + warm-up), of ``plain``
(no middleware), ``layer`` (the pass-through ``on_agent`` middleware), ``finish`` (a no-op
``on_agent_finish`` alone), ``sampled`` (the online
path as timed above), ``unsampled`` (`EvalMiddleware` at ``sample_rate=0``: its hooks alone),
``bare``, ``machinery`` and ``eval`` (the throughput variants, 200 cases at concurrency 50). A
figure the host's load does not move; every process runs at once.

``--json`` prints the figures as one JSON object on the last line.

    .venv/bin/python benchmarks/bench_evals.py
    .venv/bin/python benchmarks/bench_evals.py --cases 100 --runs 200 --repeat 3 --json   # quick
    .venv/bin/python benchmarks/bench_evals.py --instructions [--variants plain,sampled]     # needs valgrind
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import tracemalloc
from typing import Any

from agentscope_py import ModelStep, ReActAgent, ScriptedModel, tool
from agentscope_py.evals import Case, Contains, Dataset, EvalContext, MaxModelCalls, ToolTrajectory
from agentscope_py.middleware import EvalMiddleware, ExtensionPoint, MiddlewareBase


class PassThrough(MiddlewareBase):
    """An ``on_agent`` middleware that does nothing: the layer any such middleware adds."""

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_AGENT})

    def on_agent(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input)


class FinishOnly(MiddlewareBase):
    """A middleware with a no-op ``on_agent_finish`` alone: what the finish notification costs."""

    def active_points(self) -> frozenset[ExtensionPoint]:
        return frozenset({ExtensionPoint.ON_AGENT_FINISH})

    async def on_agent_finish(self, agent: Any, ctx: Any, run: Any) -> None:
        return None


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def script(i: int) -> list[ModelStep]:
    return [ModelStep.tool_call("add", {"a": i, "b": 1}), ModelStep.text(f"The sum is {i + 1}. " + "x" * 76, chunks=20)]


def factory(case: Case) -> ReActAgent:
    return ReActAgent.builder().model(ScriptedModel(script(case.metadata["i"]))).tools(add).build()


def dataset(n: int) -> Dataset:
    cases = [Case(f"c{i}", f"{i} + 1?", expected_output=str(i + 1), metadata={"i": i}) for i in range(n)]
    return Dataset(cases, [Contains(), ToolTrajectory(["add"]), MaxModelCalls(2)])


async def bare(data: Dataset, concurrency: int) -> None:
    queue = list(reversed(data.cases))

    async def worker() -> None:
        while queue:
            case = queue.pop()
            await factory(case).call(case.input)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def timed(coro: Any) -> tuple[float, float]:
    """Wall and CPU seconds of ``coro``, the collector paused (it runs at the same points in every
    variant, and pausing it keeps a shared machine's noise out of the comparison)."""
    gc.collect()
    gc.disable()
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        await coro
        return time.perf_counter() - wall, time.process_time() - cpu
    finally:
        gc.enable()


async def throughput(n: int, concurrency: int, repeat: int) -> dict[str, Any]:
    data = dataset(n)
    machinery = Dataset(data.cases, [])  # the runner, contexts and report, no evaluator
    await data.evaluate(factory, concurrency=concurrency, progress=False)  # warm-up
    runs: dict[str, list[tuple[float, float]]] = {"eval": [], "machinery": [], "bare": []}
    ratios: dict[str, list[float]] = {"eval": [], "machinery": []}
    for sweep in range(repeat):
        variants = [("eval", lambda: data.evaluate(factory, concurrency=concurrency, progress=False)),
                    ("machinery", lambda: machinery.evaluate(factory, concurrency=concurrency, progress=False)),
                    ("bare", lambda: bare(data, concurrency))]
        variants = variants[sweep % 3:] + variants[: sweep % 3]
        times = {name: await timed(make()) for name, make in variants}
        for name, value in times.items():
            runs[name].append(value)
        for name in ratios:  # CPU: on a shared machine wall time measures the neighbours too
            ratios[name].append(times[name][1] / times["bare"][1])
    tracemalloc.start()
    report = await data.evaluate(factory, concurrency=concurrency, progress=False)
    _, peak = tracemalloc.get_traced_memory()
    gc.collect()
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert report.pass_rate == 1.0, report.render()

    def median(name: str, index: int) -> float:
        return statistics.median(t[index] for t in runs[name])

    return {
        "cases": n, "concurrency": concurrency,
        "cases_per_s": n / median("eval", 0), "bare_cases_per_s": n / median("bare", 0),
        "cpu_us_per_case": median("eval", 1) / n * 1e6, "bare_cpu_us_per_case": median("bare", 1) / n * 1e6,
        "overhead_ratio": statistics.median(ratios["eval"]),
        "machinery_overhead_ratio": statistics.median(ratios["machinery"]),
        "peak_heap_mib": peak / 2**20,
        "report_kib_per_case": held / n / 1024,
    }


async def online(runs: int, repeat: int) -> dict[str, Any]:
    gate = asyncio.Event()

    async def held(ctx: EvalContext) -> bool:
        await gate.wait()
        return True

    evaluators = [Contains("sum"), ToolTrajectory(["add"]), MaxModelCalls(2)]

    def agent(mw: MiddlewareBase | None) -> ReActAgent:
        model = ScriptedModel(script(1), loop=True)
        builder = ReActAgent.builder().model(model).tools(add)
        if mw is not None:
            builder.middleware(mw)
        return builder.build()

    async def cpu(a: ReActAgent) -> float:
        gc.collect()
        gc.disable()
        try:
            started = time.process_time()
            for _ in range(runs):
                await a.call("1 + 1?")
            return (time.process_time() - started) / runs
        finally:
            gc.enable()

    ratios, layer, path, score = [], [], [], []
    for sweep in range(repeat + 1):
        gate.clear()
        # The path: the one worker is held on its first run and the queue holds one more, so
        # every later run takes the whole path (sampled, its events kept, offered to the queue)
        # and is then dropped. Holding every run back instead would pile them up in memory,
        # which scoring (emptying the queue) never does.
        path_mw = EvalMiddleware([held, *evaluators], sample_rate=1.0, queue_size=1)
        order = [("plain", agent(None)), ("layer", agent(PassThrough())), ("sampled", agent(path_mw))]
        order = order[sweep % 3:] + order[: sweep % 3]
        per_run = {name: await cpu(a) for name, a in order}
        gate.set()
        await path_mw.drain()
        await path_mw.aclose()
        assert path_mw.sampled == runs and path_mw.dropped == runs - 2
        # The scoring, off the path: every run queued while the worker is held, then drained.
        gate.clear()
        score_mw = EvalMiddleware([held, *evaluators], sample_rate=1.0, queue_size=runs + 1)
        await cpu(agent(score_mw))
        gate.set()
        started = time.process_time()
        await score_mw.drain()
        scoring = (time.process_time() - started) / runs
        await score_mw.aclose()
        assert score_mw.scored == runs and score_mw.dropped == 0
        if sweep:  # the first sweep warms up
            ratios.append(per_run["sampled"] / per_run["plain"])
            layer.append(per_run["sampled"] / per_run["layer"])
            path.append(per_run["plain"])
            score.append(scoring)
    return {"runs": runs, "path_cpu_ratio": statistics.median(ratios),
            "path_cpu_ratio_vs_passthrough_layer": statistics.median(layer),
            "plain_cpu_us_per_run": statistics.median(path) * 1e6,
            "scoring_cpu_us_per_run": statistics.median(score) * 1e6}


ONLINE_VARIANTS = ("plain", "layer", "finish", "sampled", "unsampled")
OFFLINE_VARIANTS = ("bare", "machinery", "eval")


async def counted(variant: str, n: int) -> None:
    """What one ``--instructions`` child runs: a warm-up, then ``n`` runs of ``variant``."""
    if variant in ONLINE_VARIANTS:
        gate = asyncio.Event()

        async def held(ctx: EvalContext) -> bool:
            await gate.wait()
            return True

        evaluators = [held, Contains("sum"), ToolTrajectory(["add"]), MaxModelCalls(2)]
        mw: MiddlewareBase | None = {
            "layer": PassThrough(), "finish": FinishOnly(),
            "sampled": EvalMiddleware(evaluators, sample_rate=1.0, queue_size=1),
            "unsampled": EvalMiddleware(evaluators, sample_rate=0.0)}.get(variant)
        builder = ReActAgent.builder().model(ScriptedModel(script(1), loop=True)).tools(add)
        if mw is not None:
            builder.middleware(mw)
        a = builder.build()
        for _ in range(30 + n):
            await a.call("1 + 1?")
        gate.set()
        if isinstance(mw, EvalMiddleware):
            await mw.aclose()
        return
    data = dataset(50 + n)
    warm, cases = Dataset(data.cases[:50], data.evaluators), data.cases[50:]
    await warm.evaluate(factory, concurrency=50, progress=False)
    await bare(Dataset(data.cases[:50], []), 50)
    if variant == "bare":
        await bare(Dataset(cases, []), 50)
    else:
        await Dataset(cases, data.evaluators if variant == "eval" else []).evaluate(
            factory, concurrency=50, progress=False)


def instructions(variants: list[str], runs: int, cases: int) -> dict[str, float]:
    """Instructions per run of each variant (see the module docstring)."""
    from bench_instructions import collected  # benchmarks/ is this script's sys.path[0]

    def count(variant: str, n: int) -> subprocess.Popen[str]:
        cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
               "--count", variant, "--runs", str(n)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONHASHSEED": "0"})

    sizes = {variant: runs if variant in ONLINE_VARIANTS else cases for variant in variants}
    procs = {variant: (count(variant, 0), count(variant, n)) for variant, n in sizes.items()}  # all at once
    out: dict[str, float] = {}
    for variant, (base, full) in procs.items():
        out[variant] = (collected(full) - collected(base)) / sizes[variant]
        print(f"{variant}: {out[variant] / 1000:,.1f} k instructions per run", flush=True)
    for a, b in (("layer", "plain"), ("finish", "plain"), ("sampled", "plain"), ("unsampled", "plain"),
                 ("machinery", "bare"), ("eval", "bare")):
        if a in out and b in out:
            print(f"{a}/{b}: x{out[a] / out[b]:.4f}")
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--instructions", action="store_true", help="count instructions (needs valgrind)")
    parser.add_argument("--variants", default=",".join(ONLINE_VARIANTS + OFFLINE_VARIANTS),
                        help="--instructions: which variants")
    parser.add_argument("--count", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count:
        await counted(args.count, args.runs)
        return
    if args.instructions:
        if shutil.which("valgrind") is None:
            sys.exit("bench_evals: valgrind is not installed (apt-get install valgrind)")
        counts = instructions([v for v in args.variants.split(",") if v], 100, 200)
        if args.json:
            print(json.dumps({"instructions_per_run": counts}))
        return
    result = {"throughput": await throughput(args.cases, args.concurrency, args.repeat),
              "online": await online(args.runs, args.repeat)}
    t, o = result["throughput"], result["online"]
    print(f"{t['cases']} cases at concurrency {t['concurrency']}: {t['cases_per_s']:.0f} cases/s evaluated, "
          f"{t['bare_cases_per_s']:.0f} bare (wall); CPU {t['cpu_us_per_case']:.0f} us/case evaluated, "
          f"{t['bare_cpu_us_per_case']:.0f} bare: evaluate/bare x{t['overhead_ratio']:.3f} with 3 evaluators, "
          f"x{t['machinery_overhead_ratio']:.3f} without; peak heap {t['peak_heap_mib']:.1f} MiB, "
          f"report {t['report_kib_per_case']:.2f} KiB/case")
    print(f"EvalMiddleware at 100 %: user's path CPU x{o['path_cpu_ratio']:.3f} "
          f"({o['plain_cpu_us_per_run']:.0f} us/run bare), x{o['path_cpu_ratio_vs_passthrough_layer']:.3f} over a "
          f"pass-through on_agent middleware; scoring {o['scoring_cpu_us_per_run']:.0f} us/run off the path")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
