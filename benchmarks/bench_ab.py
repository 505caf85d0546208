"""CPU µs per run of two trees, side by side: `bench_agents.py`'s agentscope-py run (2 model
calls, 1 tool call, pass-through middleware) in two long-lived processes, one per tree, asked in
alternating batches so that both see the same host (this VM's speed moves up to 2× within
minutes; sequential runs of the two trees compare two different machines).

    python benchmarks/bench_ab.py --before /path/to/old/checkout            # this tree is "after"
    python benchmarks/bench_ab.py --before /tmp/a --after /tmp/b --batches 20 --json

Each cell: ``--batches`` batches of ``--runs`` runs per tree (CPU time, `time.process_time`), the
order alternating per batch; reported: the minimum and the median per run, and after ÷ before
of each. Instruction counts (`bench_instructions.py`) do not move with the load; these are the
figures that say what the user's CPU spends.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def worker(tree: str) -> None:
    """Serve ``mode n runs`` lines from stdin with one JSON line each: CPU µs per run."""
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__name__.lower()]
    sys.path.insert(0, tree)
    sys.path.insert(0, str(HERE))
    import bench_agents

    async def main() -> None:
        runners: dict[int, Any] = {}
        for line in sys.stdin:
            mode, n_text, runs_text = line.split()
            n, runs = int(n_text), int(runs_text)
            if n not in runners:
                runners[n] = await bench_agents.build_agentscope_py(n)
                for _ in range(30):  # warm-up: first-use caches
                    await runners[n].call()
                    await runners[n].stream()
            run = runners[n].call if mode == "call" else runners[n].stream
            gc.collect()
            started = time.process_time()
            for _ in range(runs):
                await run()
            print(json.dumps({"us": (time.process_time() - started) / runs * 1e6}), flush=True)

    asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the checkout measured as 'before'")
    parser.add_argument("--after", default=str(HERE.parent), help="the checkout measured as 'after' (this one)")
    parser.add_argument("--middleware", default="0,5,20", help="comma-separated middleware counts")
    parser.add_argument("--modes", default="call,stream")
    parser.add_argument("--batches", type=int, default=12, help="batches per tree and cell")
    parser.add_argument("--runs", type=int, default=200, help="runs per batch")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    trees = {"before": args.before, "after": args.after}
    procs = {name: subprocess.Popen([sys.executable, __file__, "--before", "-", "--worker", tree],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
             for name, tree in trees.items()}

    def ask(name: str, mode: str, n: int) -> float:
        proc = procs[name]
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(f"{mode} {n} {args.runs}\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {name} worker ({trees[name]}) exited")
        return float(json.loads(line)["us"])

    cells: dict[str, dict[str, float]] = {}
    try:
        for mode in args.modes.split(","):
            for n in (int(x) for x in args.middleware.split(",")):
                values: dict[str, list[float]] = {"before": [], "after": []}
                for i in range(args.batches):
                    for name in ("before", "after") if i % 2 == 0 else ("after", "before"):
                        values[name].append(ask(name, mode, n))
                b_min, a_min = min(values["before"]), min(values["after"])
                b_med, a_med = statistics.median(values["before"]), statistics.median(values["after"])
                cells[f"{mode} {n}"] = {"before_min": b_min, "after_min": a_min, "ratio_min": a_min / b_min,
                                        "before_median": b_med, "after_median": a_med, "ratio_median": a_med / b_med}
                print(f"{mode:6} {n:2} mw   min: before {b_min:7.1f} µs, after {a_min:7.1f} µs, "
                      f"{a_min / b_min:5.3f}x   median: {b_med:7.1f}, {a_med:7.1f}, {a_med / b_med:5.3f}x", flush=True)
    finally:
        for proc in procs.values():
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=30)
    if args.json:
        print(json.dumps({"cells": cells, "batches": args.batches, "runs": args.runs}))


if __name__ == "__main__":
    main()
