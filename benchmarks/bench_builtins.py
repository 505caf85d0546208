"""What five built-in middleware cost when installed but not triggered, and what a
cache hit saves.

The workload is `bench_agents.py`'s (a ReAct run: a model call asking for the tool ``lookup``,
the tool, a model call answering; no network), with a different user text per run so a response
cache always misses. Variants:

* ``passthrough`` — 5 pass-through middleware at the model-call and acting points: the baseline;
* ``builtins``    — the five built-ins the issue names, none triggering: `RetryMiddleware`,
  `TimeoutMiddleware` (generous deadlines), `RateLimitMiddleware` (a rate no run reaches),
  `ResponseCacheMiddleware` (in memory, every request a miss), `BudgetMiddleware` (a budget no
  run reaches). Target: ≤ 1.3× ``passthrough``.
* ``hit`` / ``miss`` — a model call with a 200-delta reply through `ResponseCacheMiddleware`,
  served from the cache (the same request each run) or by the scripted model (a new one each
  run). Target: a hit is served faster than the model call it replaces.

Each sweep runs one batch per variant, back to back in a rotating order, garbage collection
paused; the ratio is the median over sweeps of the paired batch times (pairs that ran moments
apart cancel a shared machine's drifts). ``--json`` prints the ratios as the last line.

    .venv/bin/python benchmarks/bench_builtins.py                   # 20 runs per batch, 31 sweeps
    .venv/bin/python benchmarks/bench_builtins.py --runs 10 --repeat 3 --json   # quick (a test runs this)
    .venv/bin/python benchmarks/bench_builtins.py --instructions     # valgrind: instructions per run

``--instructions`` counts instructions per run under valgrind (``bench_instructions.py``'s method:
(start-up + warm-up + N runs) − (start-up + warm-up), ÷ N, ``PYTHONHASHSEED=0``), for the two
variants and for each built-in in place of one of the five pass-throughs: figures the host's
speed swings do not move. ``--instructions streamed,streamed-budget`` counts the hit/miss
workload's 200-delta reply with no middleware and under a budget no run reaches: the difference is
what the budget does over a streamed reply.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from agentscope_py import ChatUsage, ExtensionPoint, MiddlewareBase, ModelStep, ReActAgent, RuntimeContext, Toolkit
from agentscope_py.middleware import (
    BudgetMiddleware,
    ModelFallbackMiddleware,
    RateLimitMiddleware,
    ResponseCacheMiddleware,
    RetryMiddleware,
    TimeoutMiddleware,
)
from agentscope_py.model import ScriptedModel
from agentscope_py.model.base import ChatChunk, ModelRequest, ToolCallChunk

USAGE = ChatUsage(input_tokens=10, output_tokens=5)
CALL = (ChatChunk(tool_call=ToolCallChunk(index=0, id="call_1", name="lookup", arguments='{"query": "x"}')),
        ChatChunk(usage=USAGE, finish_reason="tool_calls"))
ANSWER = (ChatChunk(text="The answer is 42."), ChatChunk(usage=USAGE, finish_reason="stop"))


class FakeModel:
    """`bench_agents.py`'s fake: a tool call, then (after the tool's result) the answer."""

    name = "fake"

    def stream(self, request: ModelRequest) -> Any:
        return self._play(request.messages[-1].role == "tool")

    async def _play(self, answered: bool) -> Any:
        for chunk in ANSWER if answered else CALL:
            yield chunk


async def lookup(query: str) -> str:
    """Look something up.

    Args:
        query: what to look up.
    """
    return "42"


class PassThrough(MiddlewareBase):
    def active_points(self) -> Any:
        return (ExtensionPoint.ON_MODEL_CALL, ExtensionPoint.ON_ACTING)

    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input)

    def on_acting(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input)


def builtins() -> list[MiddlewareBase]:
    return [
        RetryMiddleware(),
        TimeoutMiddleware(model_timeout=600, tool_timeout=600),
        RateLimitMiddleware(rate=1e9, burst=1e9),
        ResponseCacheMiddleware(),
        BudgetMiddleware(run_tokens=10**12),
    ]


def others() -> list[MiddlewareBase]:
    """Built-ins counted one at a time only (``--instructions``), in place of one pass-through."""
    return [ModelFallbackMiddleware(FakeModel())]


EACH = ("RetryMiddleware", "TimeoutMiddleware", "RateLimitMiddleware", "ResponseCacheMiddleware", "BudgetMiddleware")


def variant(name: str) -> list[MiddlewareBase]:
    """``passthrough``, ``builtins``, or a built-in's class name: it in place of one pass-through."""
    if name == "passthrough":
        return [PassThrough() for _ in range(5)]
    if name == "builtins":
        return builtins()
    one = [m for m in (*builtins(), *others()) if type(m).__name__ == name]
    if not one:
        raise SystemExit(f"unknown variant {name!r}")
    return [one[0]] + [PassThrough() for _ in range(4)]


def react_runner(middlewares: list[MiddlewareBase]) -> Callable[[int], Awaitable[Any]]:
    toolkit = Toolkit()
    toolkit.register(lookup)
    agent = ReActAgent.builder().model(FakeModel()).toolkit(toolkit).middlewares(middlewares).build()

    async def run(i: int) -> Any:
        ctx = RuntimeContext(user_id="bench", session_id="s")
        msg = await agent.call(f"question {i}", ctx=ctx)  # a new request each run: the cache misses
        ctx.agent_state.context.clear()  # type: ignore[union-attr]
        return msg

    return run


def reply_runner(middlewares: list[MiddlewareBase], same: bool) -> Callable[[int], Awaitable[Any]]:
    """A `call()` whose one model call streams 800 characters in 200 deltas: the same request
    each run (``same``) or a new one."""
    model = ScriptedModel([ModelStep.text("x" * 800, chunks=200)], loop=True)
    agent = ReActAgent.builder().model(model).middlewares(middlewares).build()

    async def run(i: int) -> Any:
        ctx = RuntimeContext(user_id="bench", session_id="c")
        msg = await agent.call("the same question" if same else f"question {i}", ctx=ctx)
        ctx.agent_state.context.clear()  # type: ignore[union-attr]
        return msg

    return run


def cache_runner(hit: bool) -> Callable[[int], Awaitable[Any]]:
    return reply_runner([ResponseCacheMiddleware(max_entries=100_000)], hit)


# ``--instructions`` variants on `reply_runner`'s streamed reply: with no middleware, and under a
# budget no run reaches (what the budget does per output delta).
STREAMED: dict[str, Callable[[], list[MiddlewareBase]]] = {
    "streamed": list,
    "streamed-budget": lambda: [BudgetMiddleware(run_tokens=10**12)],
}


async def batch(run: Callable[[int], Awaitable[Any]], runs: int, counter: itertools.count[int]) -> float:
    started = time.perf_counter()
    for _ in range(runs):
        await run(next(counter))
    return time.perf_counter() - started


async def measure(runs: int, repeat: int) -> dict[str, float]:
    counter = itertools.count()
    runners = {
        "passthrough": react_runner([PassThrough() for _ in range(5)]),
        "builtins": react_runner(builtins()),
        "miss": cache_runner(hit=False),
        "hit": cache_runner(hit=True),
    }
    for run in runners.values():  # warm-up (and the hit's entry)
        await batch(run, max(5, runs // 2), counter)
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    gc.disable()
    try:
        for sweep in range(repeat):
            order = names[sweep % len(names):] + names[:sweep % len(names)]
            for name in order:
                times[name].append(await batch(runners[name], runs, counter))
            gc.collect()
    finally:
        gc.enable()
    ratio = statistics.median(b / p for b, p in zip(times["builtins"], times["passthrough"], strict=True))
    hit = statistics.median(h / m for h, m in zip(times["hit"], times["miss"], strict=True))
    return {
        "builtins_vs_passthrough": ratio,
        "hit_vs_miss": hit,
        "passthrough_us_per_run": min(times["passthrough"]) / runs * 1e6,
        "builtins_us_per_run": min(times["builtins"]) / runs * 1e6,
        "miss_us_per_run": min(times["miss"]) / runs * 1e6,
        "hit_us_per_run": min(times["hit"]) / runs * 1e6,
    }


async def count_child(name: str, runs: int) -> None:
    counter = itertools.count()
    run = reply_runner(STREAMED[name](), False) if name in STREAMED else react_runner(variant(name))
    for _ in range(30 + runs):  # 30 warm-up runs in both processes
        await run(next(counter))


def instructions(names: list[str], runs: int) -> dict[str, float]:
    """Instructions per run of each variant, two valgrind processes per variant at a time."""
    from bench_instructions import collected  # (this script's directory is on the path)

    def start(name: str, n: int) -> subprocess.Popen[str]:
        cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
               "--child", name, "--runs", str(n)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONHASHSEED": "0"})

    out: dict[str, float] = {}
    for name in names:
        base, full = start(name, 0), start(name, runs)
        out[name] = (collected(full) - collected(base)) / runs
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="runs per batch")
    p.add_argument("--repeat", type=int, default=31, help="sweeps (the median of paired ratios counts)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON on the last line")
    p.add_argument("--instructions", nargs="?", const="passthrough,builtins," + ",".join(EACH),
                   help="count instructions per run under valgrind instead (comma-separated variants: "
                        "passthrough, builtins, or a built-in's class name in place of one pass-through: "
                        "one of the five, or ModelFallbackMiddleware; or streamed / streamed-budget: "
                        "a 200-delta reply with no middleware / under a budget)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        asyncio.run(count_child(args.child, args.runs))
        return 0
    if args.instructions:
        if shutil.which("valgrind") is None:
            print("bench_builtins: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
            return 2
        names = [n for n in args.instructions.split(",") if n]
        counts = instructions(names, 200 if args.runs == 20 else args.runs)
        base = counts.get("passthrough")
        for name, per_run in counts.items():
            ratio = f"  ({per_run / base:.3f}× passthrough)" if base else ""
            print(f"{name}: {per_run / 1000:,.1f} k instructions per run{ratio}")
        if args.json:
            print(json.dumps({"instructions_per_run": counts}))
        return 0
    out = asyncio.run(measure(args.runs, args.repeat))
    print(f"5 built-ins (not triggered) ÷ 5 pass-throughs: {out['builtins_vs_passthrough']:.3f}  (target ≤ 1.3)")
    print(f"  best batch: pass-through {out['passthrough_us_per_run']:.0f} µs/run, "
          f"built-ins {out['builtins_us_per_run']:.0f} µs/run")
    print(f"cache hit ÷ the model call it replaces: {out['hit_vs_miss']:.3f}  (target < 1)")
    print(f"  best batch: miss {out['miss_us_per_run']:.0f} µs/run, hit {out['hit_us_per_run']:.0f} µs/run")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
