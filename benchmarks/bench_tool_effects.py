"""What journaling a tool call costs: one run (two model calls, one tool call) whose tool is not
idempotent (its intent and result are written to the session's store) against the same run with
an idempotent tool (nothing journaled), on a SQLite store and in memory; the variants alternate
in batches in one process, so all see the same host.

    python benchmarks/bench_tool_effects.py [--runs 40 --batches 12] [--json]

Reported per variant: the median over batches of the wall and CPU time per run (CPU:
`time.process_time`, which counts the store's thread too) and the writes per run; and, per
store, journaled ÷ idempotent, and the difference per run (the cost of one journaled call).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from agentscope_py import ModelStep, ReActAgent, RuntimeContext, ScriptedModel
from agentscope_py.agent import InMemoryStateStore
from agentscope_py.agent.sqlite_store import SqliteStateStore
from agentscope_py.tool import tool


@tool
def pay(amount: int) -> str:
    """Pay ``amount``."""
    return f"paid {amount}"


@tool(idempotent=True)
def quote(amount: int) -> str:
    """Quote ``amount``."""
    return f"paid {amount}"


class Variant:
    def __init__(self, name: str, store: Any, tool_name: str) -> None:
        self.name, self.store, self.tool_name = name, store, tool_name
        self.model = ScriptedModel([ModelStep.tool_call(tool_name, {"amount": 3}), ModelStep.text("done")], loop=True)
        self.agent = ReActAgent(model=self.model, tools=[pay, quote], state_store=self.store)
        self.n = 0
        self.writes_per_run = 0
        self.wall: list[float] = []
        self.cpu: list[float] = []

    async def batch(self, runs: int) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(runs):
            self.n += 1  # a fresh session per run: every run writes the same amount
            await self.agent.call("go", ctx=RuntimeContext("u", f"{self.name}-{self.n}"))
        self.wall.append((time.perf_counter() - wall) / runs * 1e6)
        self.cpu.append((time.process_time() - cpu) / runs * 1e6)
        _, self.writes_per_run = await self.store.load("u", f"{self.name}-{self.n}")  # (the version: writes)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        sqlite = SqliteStateStore(Path(tmp) / "bench.db")
        memory = InMemoryStateStore()
        variants = [Variant("sqlite-journaled", sqlite, "pay"), Variant("sqlite-idempotent", sqlite, "quote"),
                    Variant("memory-journaled", memory, "pay"), Variant("memory-idempotent", memory, "quote")]
        for v in variants:  # warm-up
            await v.batch(5)
            v.wall.clear()
            v.cpu.clear()
        for b in range(args.batches):
            for v in (variants if b % 2 == 0 else list(reversed(variants))):
                await v.batch(args.runs)
        await sqlite.close()
    report: dict[str, Any] = {"runs": args.runs, "batches": args.batches, "variants": {}}
    for v in variants:
        report["variants"][v.name] = {"wall_us": round(statistics.median(v.wall), 1),
                                      "cpu_us": round(statistics.median(v.cpu), 1), "writes": v.writes_per_run}
    for store in ("sqlite", "memory"):
        j, i = report["variants"][f"{store}-journaled"], report["variants"][f"{store}-idempotent"]
        report[store] = {"wall_ratio": round(j["wall_us"] / i["wall_us"], 3),
                         "cpu_ratio": round(j["cpu_us"] / i["cpu_us"], 3),
                         "wall_per_call_us": round(j["wall_us"] - i["wall_us"], 1),
                         "cpu_per_call_us": round(j["cpu_us"] - i["cpu_us"], 1)}
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--json", action="store_true")
    result = asyncio.run(main(parser.parse_args()))
    if parser.parse_args().json:
        print(json.dumps(result))
    else:
        for name, v in result["variants"].items():
            print(f"{name:20} wall {v['wall_us']:8.1f} µs  cpu {v['cpu_us']:8.1f} µs  writes/run {v['writes']}")
        for store in ("sqlite", "memory"):
            r = result[store]
            print(f"{store}: journaled ÷ idempotent wall {r['wall_ratio']} cpu {r['cpu_ratio']}; "
                  f"one journaled call +{r['wall_per_call_us']} µs wall, +{r['cpu_per_call_us']} µs cpu")
