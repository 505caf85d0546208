"""Events per second through N middleware layers, next to a bare async generator.

Every variant consumes the same 100,000 prebuilt events with ``async for``; the floor is a bare
``async def`` generator over the same list, measured in the same process, in the same sweep.
Best of ``--repeat`` (default 5) per variant; variants are run round-robin inside each sweep so a
slow moment on this shared machine hits all of them alike.

Variants:

* ``bare``            — ``async for e in gen()``: the floor.
* ``stream``          — ``EventStream(gen)`` with no operators.
* ``passthrough_10``  — 10 hooks ``return next(input)`` composed with the real chain
  (`agentscope_py.middleware.chain.compose` over `Participants`).
* ``map_N``           — N middleware, each ``return next(input).map(identity)``, composed with the
  real chain (this is what a user's map-hook costs), N = 1, 5, 10, 20.
* ``ops_map_N``       — the same N maps chained directly on one EventStream (no chain): the fused
  operator floor, for comparison.

``--json`` prints, as the last line, ``{"passthrough_10": r, "map_1": r, ..., "map_20": r}``: each
variant's events/s divided by the bare generator's events/s.

    .venv/bin/python benchmarks/bench_chain.py                 # full: 100k events, best of 5
    .venv/bin/python benchmarks/bench_chain.py --events 2000 --repeat 2 --json   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from agentscope_py.agent.context import RuntimeContext
from agentscope_py.events import TextBlockDelta
from agentscope_py.middleware.base import ExtensionPoint, MiddlewareBase, ModelCallInput
from agentscope_py.middleware.chain import Participants, compose
from agentscope_py.stream import EventStream

MAP_COUNTS = (1, 5, 10, 20)
POINT = ExtensionPoint.ON_MODEL_CALL


def identity(x: Any) -> Any:
    return x


class PassThrough(MiddlewareBase):
    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input)


class MapIdentity(MiddlewareBase):
    def on_model_call(self, agent: Any, ctx: Any, input: Any, next: Any) -> Any:
        return next(input).map(identity)


def make_events(n: int) -> list[TextBlockDelta]:
    return [TextBlockDelta(reply_id="r", block_id="b", delta=f"t{i}") for i in range(n)]


async def consume(it: Any) -> int:
    n = 0
    async for _ in it:
        n += 1
    return n


def build_variants(events: list[Any]) -> dict[str, Callable[[], Any]]:
    """name -> a zero-argument function returning a fresh async iterable of ``events``."""

    async def gen() -> AsyncIterator[Any]:
        for e in events:
            yield e

    ctx = RuntimeContext()
    mc_input = ModelCallInput(messages=(), tools=(), options={}, model=None)  # type: ignore[arg-type]

    def core(_input: Any) -> EventStream[Any]:
        return EventStream(gen)

    def chained(mws: list[MiddlewareBase]) -> Callable[[], Any]:
        parts = Participants(mws)

        def make() -> Any:
            # The fold is built per execution, as the agent does: its cost is inside the timing.
            return compose(POINT, parts, None, ctx, core)(mc_input)

        return make

    def ops(n: int) -> Callable[[], Any]:
        def make() -> Any:
            s: EventStream[Any] = EventStream(gen)
            for _ in range(n):
                s = s.map(identity)
            return s

        return make

    variants: dict[str, Callable[[], Any]] = {
        "bare": gen,
        "stream": lambda: EventStream(gen),
        "passthrough_10": chained([PassThrough() for _ in range(10)]),
    }
    for n in MAP_COUNTS:
        variants[f"map_{n}"] = chained([MapIdentity() for _ in range(n)])
    for n in MAP_COUNTS:
        variants[f"ops_map_{n}"] = ops(n)
    return variants


async def measure(events: list[Any], repeat: int) -> dict[str, float]:
    """Best wall time (s) per variant over ``repeat`` round-robin sweeps."""
    variants = build_variants(events)
    best = dict.fromkeys(variants, float("inf"))
    expected = len(events)
    for name, make in variants.items():  # warm-up (and a correctness check)
        got = await consume(make())
        if got != expected:
            raise AssertionError(f"{name}: {got} events, expected {expected}")
    for _ in range(repeat):
        for name, make in variants.items():
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                await consume(make())
                dt = time.perf_counter() - t0
            finally:
                gc.enable()
            best[name] = min(best[name], dt)
    return best


def report(best: dict[str, float], n_events: int, repeat: int) -> dict[str, Any]:
    bare = n_events / best["bare"]
    rows = []
    for name, dt in best.items():
        eps = n_events / dt
        rows.append((name, dt / n_events * 1e6, eps, eps / bare))
    print(f"bench_chain: {n_events:,} events, best of {repeat}, Python {sys.version.split()[0]}")
    print(f"{'variant':<16} {'µs/event':>9} {'events/s':>12} {'÷ bare':>7}")
    for name, us, eps, ratio in rows:
        print(f"{name:<16} {us:>9.3f} {eps:>12,.0f} {ratio:>7.3f}")
    ratios = {name: ratio for name, _, _, ratio in rows}
    print()
    print(f"targets: passthrough_10 ≥ 0.90× bare: {ratios['passthrough_10']:.3f} "
          f"({'met' if ratios['passthrough_10'] >= 0.9 else 'MISSED'}); "
          f"map_5 ≥ 0.25× bare: {ratios['map_5']:.3f} ({'met' if ratios['map_5'] >= 0.25 else 'MISSED'})")
    return {
        "passthrough_10": ratios["passthrough_10"],
        **{f"map_{n}": ratios[f"map_{n}"] for n in MAP_COUNTS},
        "ops_map_5": ratios["ops_map_5"],
        "bare_events_per_s": bare,
        "events": n_events,
        "repeat": repeat,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=100_000, help="events per run (default 100,000)")
    p.add_argument("--repeat", type=int, default=5, help="sweeps; the best one counts (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--json-out", help="also write the JSON summary to this file")
    args = p.parse_args(argv)
    if args.events < 1 or args.repeat < 1:
        p.error("--events and --repeat must be positive")
    events = make_events(args.events)
    best = asyncio.run(measure(events, args.repeat))
    summary = report(best, args.events, args.repeat)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=1)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
